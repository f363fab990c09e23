"""What uvicorn leaves open on a connection before a request reaches the app: how long a client may
take to send a request's headers, and how many bytes of them it may send.

uvicorn times out only an idle keep-alive connection after a response; a connection that sends
nothing, or part of a request line or of its headers, stays open for as long as the client
likes, and the headers grow as long as it likes (uvicorn's httptools parser sets no bound).
`guarded_protocol` returns uvicorn's own HTTP protocol class (the one `--http auto` picks) with
both bounded: headers that stop arriving for `read_timeout_s` get 408, headers past
`max_header_bytes` get 431, each with OpenAI's error body, and the connection is closed; a
connection that sent nothing is closed silently. The body's own timeout is the RequestGuard's
(guard.py), where the ASGI app reads it.
"""

from __future__ import annotations

import asyncio

from tandem.server.guard import error_body

REASONS = {408: "Request Timeout", 431: "Request Header Fields Too Large"}


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
            super().data_received(data)
            if self.transport.is_closing():  # uvicorn refused it (a malformed request)
                self._disarm()
            elif self._awaiting_headers():
                self._header_bytes += len(data)
                if self._header_bytes > max_header_bytes:
                    self._refuse(431, f"the request's headers are over {max_header_bytes} bytes "
                                      "(tandem serve --max-request-header-bytes)", "request_header_too_large")
                elif self._header_timer is None:
                    self._arm()
            else:  # a request has started: its body's time is the app's to bound
                self._header_bytes = 0
                self._disarm()

        def _awaiting_headers(self) -> bool:
            return self.cycle is None or self.cycle.response_complete

        def _arm(self) -> None:
            self._disarm()
            self._header_timer = self.loop.call_later(read_timeout_s, self._headers_timed_out)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_timed_out(self) -> None:
            self._header_timer = None
            if self.transport.is_closing() or not self._awaiting_headers():
                return
            if self._header_bytes:
                self._refuse(408, f"the request's headers did not arrive within {read_timeout_s:g} s "
                                  "(tandem serve --request-read-timeout)", "request_timeout")
            else:  # nothing sent: nobody to answer
                self.transport.close()

        def _refuse(self, status: int, message: str, code: str) -> None:
            self._disarm()
            body = error_body(message, "invalid_request_error", code=code)
            head = (f"HTTP/1.1 {status} {REASONS[status]}\r\ncontent-type: application/json\r\n"
                    f"content-length: {len(body)}\r\nconnection: close\r\n\r\n")
            self.transport.write(head.encode() + body)
            self.transport.close()

    return GuardedHTTPProtocol
