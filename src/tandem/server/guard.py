"""What stands in front of the routes: the API key, the cap on a request body's size and the time
its body may take to arrive, as one ASGI middleware, so a refused request never reaches JSON
parsing, tokenization or the engine.

- `api_key`: every path but /health and the playground page (/) needs `Authorization: Bearer
  <key>` (vLLM's and SGLang's `--api-key`); a missing or wrong key gets 401. The page holds no
  data: the requests it sends carry the key the user types into it.
- `max_body_bytes`: a body declared (Content-Length) or found (chunked) larger gets 413 without
  being parsed or kept. What the client still sends is read and dropped first (up to
  DRAIN_FACTOR x the cap), so a client that reads only after sending gets the 413, not a reset.
- `max_header_bytes`: a request line and headers larger than that get 431 (connections.py
  refuses them sooner where they arrive in pieces).
- `read_timeout_s`: a body that stops arriving for that long gets 408 (a client that sends part
  of a request and stops no longer holds it open for ever; connections.py bounds the headers).
- A request the server's shutdown cancels before its answer began (the drain timeout ran out,
  or its body was still arriving) gets 503, not uvicorn's plain-text 500.

All answer with OpenAI's error body, as every other error of the server does.
"""

from __future__ import annotations

import asyncio
import hmac
import json

from tandem.server.responses import error_payload

OPEN_PATHS = frozenset({"/health", "/"})  # the playground page holds no data; its requests send the key
DRAIN_FACTOR = 16
UNAUTHORIZED_DRAIN_BYTES = 8 * 2**20  # what a refused key's body may take to be read and dropped, without a cap
READ_TIMEOUT_S = 60.0  # as nginx's client_header_timeout and client_body_timeout


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> bytes:
    return json.dumps(error_payload(message, type_, param, code)).encode()


class RequestGuard:
    def __init__(self, app, api_key: str | None = None, max_body_bytes: int | None = None,
                 read_timeout_s: float = READ_TIMEOUT_S, max_header_bytes: int | None = None) -> None:
        if max_body_bytes is not None and max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be >= 1, got {max_body_bytes}")
        if not read_timeout_s > 0:
            raise ValueError(f"read_timeout_s must be > 0, got {read_timeout_s}")
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        self.max_body_bytes = max_body_bytes
        self.read_timeout_s = read_timeout_s
        self.max_header_bytes = max_header_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracked_send(message) -> None:
            nonlocal started
            started = True
            await send(message)

        try:
            await self._guarded(scope, receive, tracked_send)
        except asyncio.CancelledError:  # the server is shutting down (uvicorn cancels what still runs)
            if not started:
                await _respond(send, 503, error_body("the server shut down before this request was answered; retry",
                                                     "service_unavailable", code="shutting_down"),
                               [(b"connection", b"close")])
            raise

    async def _guarded(self, scope, receive, send) -> None:
        if self.max_header_bytes is not None and header_bytes(scope) > self.max_header_bytes:
            await _respond(send, 431, error_body(
                f"the request's headers are over {self.max_header_bytes} bytes "
                "(tandem serve --max-request-header-bytes)",
                "invalid_request_error", code="request_header_too_large"), [(b"connection", b"close")])
            return
        headers = dict(scope.get("headers") or ())
        if self.api_key is not None and scope["path"] not in OPEN_PATHS and not self._authorized(headers):
            # The body is read and dropped first (within the cap), as for a 413, and the
            # connection closes: its rest must not be taken for the next request.
            if not _expects_continue(headers):
                await _drain(receive, self.read_timeout_s, self.max_body_bytes or UNAUTHORIZED_DRAIN_BYTES)
            await _respond(send, 401, error_body(
                "a valid API key is required: send the header 'Authorization: Bearer <key>'",
                "invalid_request_error", code="invalid_api_key"),
                [(b"www-authenticate", b"Bearer"), (b"connection", b"close")])
            return
        declared = headers.get(b"content-length")
        if declared is not None:
            try:
                size = int(declared)
            except ValueError:
                await _respond(send, 400, error_body("the Content-Length header is not a number",
                                                     "invalid_request_error"))
                return
            if self.max_body_bytes is not None and size > self.max_body_bytes:
                # A client that waits for "100 Continue" has sent nothing yet: refused at once.
                if size <= DRAIN_FACTOR * self.max_body_bytes and not _expects_continue(headers):
                    await _drain(receive, self.read_timeout_s)
                await self._too_large(send, size)
                return
        # Read the body here, within the cap and the read timeout, and hand the app all of it.
        # (An exception raised from inside the app's own reading would reach the client as a 400.)
        body = bytearray()
        while True:
            try:
                message = await asyncio.wait_for(receive(), self.read_timeout_s)
            except TimeoutError:
                await _respond(send, 408, error_body(
                    f"the request's body stopped arriving for {self.read_timeout_s:g} s "
                    "(tandem serve --request-read-timeout)", "invalid_request_error", code="request_timeout"),
                    [(b"connection", b"close")])
                return
            if message["type"] != "http.request":  # the client went away
                return
            body += message.get("body", b"")
            if self.max_body_bytes is not None and len(body) > self.max_body_bytes:
                body = bytearray()
                if message.get("more_body", False):
                    await _drain(receive, self.read_timeout_s, DRAIN_FACTOR * self.max_body_bytes)
                await self._too_large(send, None)
                return
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": bytes(body), "more_body": False}

        await self.app(scope, replay, send)

    def _authorized(self, headers: dict[bytes, bytes]) -> bool:
        scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.api_key)

    async def _too_large(self, send, size: int | None) -> None:
        what = f"{size} bytes" if size is not None else "more than that"
        await _respond(send, 413, error_body(
            f"the request body is {what}; this server accepts at most {self.max_body_bytes} bytes "
            "(tandem serve --max-request-bytes)", "invalid_request_error", code="request_too_large"),
            [(b"connection", b"close")])


def _expects_continue(headers: dict[bytes, bytes]) -> bool:
    """Whether the client waits for "100 Continue" before it sends its body (uvicorn sends that
    on the app's first receive)."""
    return headers.get(b"expect", b"").lower() == b"100-continue"


def header_bytes(scope) -> int:
    """About how many bytes a request's line and headers took on the wire."""
    line = len(scope.get("raw_path") or b"") + len(scope.get("query_string") or b"")
    return line + sum(len(name) + len(value) + 4 for name, value in scope.get("headers") or ())


async def _drain(receive, timeout_s: float, limit: int | None = None) -> None:
    """Read and drop the rest of a request body (at most `limit` bytes of it, while it keeps
    arriving within timeout_s)."""
    seen = 0
    while limit is None or seen <= limit:
        try:
            message = await asyncio.wait_for(receive(), timeout_s)
        except TimeoutError:
            return
        seen += len(message.get("body", b""))
        if message["type"] != "http.request" or not message.get("more_body", False):
            return


async def _respond(send, status: int, body: bytes, headers: list[tuple[bytes, bytes]] = ()) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": body})
