"""What stands in front of the routes: the API key and the cap on a request body's size, as one
ASGI middleware, so a refused request never reaches JSON parsing, tokenization or the engine.

- `api_key`: every path but /health and the playground page (/) needs `Authorization: Bearer
  <key>` (vLLM's and SGLang's `--api-key`); a missing or wrong key gets 401. The page holds no
  data: the requests it sends carry the key the user types into it.
- `max_body_bytes`: a body declared (Content-Length) or found (chunked) larger gets 413 without
  being parsed or kept. What the client still sends is read and dropped first (up to
  DRAIN_FACTOR x the cap), so a client that reads only after sending gets the 413, not a reset.

Both answer with OpenAI's error body, as every other error of the server does.
"""

from __future__ import annotations

import hmac
import json

from tandem.server.responses import error_payload

OPEN_PATHS = frozenset({"/health", "/"})  # the playground page holds no data; its requests send the key
DRAIN_FACTOR = 16


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> bytes:
    return json.dumps(error_payload(message, type_, param, code)).encode()


class RequestGuard:
    def __init__(self, app, api_key: str | None = None, max_body_bytes: int | None = None) -> None:
        if max_body_bytes is not None and max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be >= 1, got {max_body_bytes}")
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or ())
        if self.api_key is not None and scope["path"] not in OPEN_PATHS and not self._authorized(headers):
            await _respond(send, 401, error_body(
                "a valid API key is required: send the header 'Authorization: Bearer <key>'",
                "invalid_request_error", code="invalid_api_key"), [(b"www-authenticate", b"Bearer")])
            return
        if self.max_body_bytes is None:
            await self.app(scope, receive, send)
            return
        declared = headers.get(b"content-length")
        if declared is not None:
            try:
                size = int(declared)
            except ValueError:
                await _respond(send, 400, error_body("the Content-Length header is not a number",
                                                     "invalid_request_error"))
                return
            if size > self.max_body_bytes:
                if size <= DRAIN_FACTOR * self.max_body_bytes:
                    await _drain(receive)
                await self._too_large(send, size)
                return
            await self.app(scope, receive, send)  # the server reads no more than it declared
            return
        # No declared length (chunked): read it here, up to the cap, and hand the app the whole body.
        # (An exception raised from inside the app's own reading would reach the client as a 400.)
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                return
            body += message.get("body", b"")
            if len(body) > self.max_body_bytes:
                body = bytearray()
                if message.get("more_body", False):
                    await _drain(receive, DRAIN_FACTOR * self.max_body_bytes)
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


async def _drain(receive, limit: int | None = None) -> None:
    """Read and drop the rest of a request body (at most `limit` bytes of it)."""
    seen = 0
    while limit is None or seen <= limit:
        message = await receive()
        seen += len(message.get("body", b""))
        if message["type"] != "http.request" or not message.get("more_body", False):
            return


async def _respond(send, status: int, body: bytes, headers: list[tuple[bytes, bytes]] = ()) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": body})
