"""What uvicorn leaves open on a connection before a request reaches the app: how long a client may
take to send a request's headers, and how many bytes of them it may send.

uvicorn times out only an idle keep-alive connection after a response; a connection that sends
nothing, or part of a request line or of its headers, stays open for as long as the client
likes, and the headers grow as long as it likes (uvicorn's httptools parser sets no bound; a
client pipelining the next request's headers behind a long answer was read without end).
`guarded_protocol` returns uvicorn's own HTTP protocol class (the one `--http auto` picks) with
both bounded: the bytes that arrive between one request's end and the next one's headers are
counted and timed from the first of them (or from the connection's start), and headers that
take longer than `read_timeout_s` get 408, headers past `max_header_bytes` 431, each with
OpenAI's error body, and the connection closes; a connection that sent nothing closes
silently, and so does one whose answer was still being written (a status line cannot cut into
it). Malformed HTTP gets OpenAI's error body too, not uvicorn's plain text. The body's own
timeout is the RequestGuard's (guard.py), where the ASGI app reads it.
"""

from __future__ import annotations

import asyncio

from tandem.server.guard import error_body

REASONS = {400: "Bad Request", 408: "Request Timeout", 431: "Request Header Fields Too Large"}


def guarded_protocol(read_timeout_s: float, max_header_bytes: int) -> type:
    """uvicorn's HTTP protocol class with the headers' time and size bounded (module doc)."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    class GuardedHTTPProtocol(AutoHTTPProtocol):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self._header_timer: asyncio.TimerHandle | None = None
            self._header_bytes = 0

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            cycle, between = self.cycle, self._between_requests()
            super().data_received(data)
            if self.transport.is_closing():  # uvicorn refused it (a malformed request)
                self._disarm()
            elif self.cycle is not cycle:  # a request's headers arrived: its body's time is the app's to bound
                self._header_bytes = 0
                self._disarm()
            elif between:  # all of it went to the next request's line and headers, still incomplete
                self._header_bytes += len(data)
                if self._header_bytes > max_header_bytes:
                    self._refuse(431, f"the request's headers are over {max_header_bytes} bytes "
                                      "(tandem serve --max-request-header-bytes)", "request_header_too_large")
                elif self._header_timer is None:
                    self._arm()

        def send_400_response(self, msg: str) -> None:  # uvicorn's parser refused the bytes
            self._refuse(400, "the request is not valid HTTP/1.1, and the server could not read it",
                         "invalid_http_request")

        def _between_requests(self) -> bool:
            """Whether the bytes that arrive now start a new request: no request yet, or the
            last one's body is complete (its answer may still be in progress)."""
            return self.cycle is None or self.cycle.response_complete or not self.cycle.more_body

        def _answering(self) -> bool:
            return self.cycle is not None and not self.cycle.response_complete

        def _arm(self) -> None:
            self._disarm()
            self._header_timer = self.loop.call_later(read_timeout_s, self._headers_timed_out)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_timed_out(self) -> None:
            self._header_timer = None
            if self.transport.is_closing() or not self._between_requests():
                return
            if self._header_bytes:
                self._refuse(408, f"the request's headers did not arrive within {read_timeout_s:g} s "
                                  "(tandem serve --request-read-timeout)", "request_timeout")
            elif not self._answering():  # nothing sent: nobody to answer
                self.transport.close()

        def _refuse(self, status: int, message: str, code: str) -> None:
            self._disarm()
            if not self._answering():  # a status line cannot cut into an answer being written
                body = error_body(message, "invalid_request_error", code=code)
                head = (f"HTTP/1.1 {status} {REASONS[status]}\r\ncontent-type: application/json\r\n"
                        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n")
                self.transport.write(head.encode() + body)
            self.transport.close()

    return GuardedHTTPProtocol
