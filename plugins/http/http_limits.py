"""What one HTTP client may hold or slip past: uvicorn's h11 protocol with a read deadline and a
connection cap, and requests framed two ways refused.

uvicorn times out idle keep-alive connections only: a client that connects and sends nothing, or
trickles its headers or body, holds its connection (and, once the headers are in, a handler) for
as long as it likes. `LimitedH11Protocol` (passed to uvicorn as its `http` protocol class, its own
extension point) closes a connection whose request is not complete `read_timeout` seconds after
its first byte (or after the connection opened), and answers a connection over `max_connections`
with one 503 (an OpenAI error body) before closing it.

A request with both Content-Length and Transfer-Encoding may be read one way by a proxy in front and
the other way here, the difference smuggling a second request onto the connection (RFC 9112 6.3:
handle as an error and close). `RefuseAmbiguousFraming`, an ASGI middleware, answers 400 without
reading the body and closes the connection, so nothing after it on that connection is served.
"""

from __future__ import annotations

import json

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

BUSY_BODY = json.dumps({"error": {"message": "server busy: too many open connections; retry later",
                                  "type": "server_error", "param": None, "code": "overloaded"}}).encode()
BUSY = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: 1\r\n"
        b"connection: close\r\ncontent-length: " + str(len(BUSY_BODY)).encode() + b"\r\n\r\n" + BUSY_BODY)


AMBIGUOUS_BODY = json.dumps({"error": {
    "message": "a request may not carry both Content-Length and Transfer-Encoding (RFC 9112 6.3)",
    "type": "invalid_request_error", "param": None, "code": None}}).encode()


class RefuseAmbiguousFraming:
    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            names = {name for name, _ in scope["headers"]}
            if b"content-length" in names and b"transfer-encoding" in names:
                await send({"type": "http.response.start", "status": 400, "headers": [
                    (b"content-type", b"application/json"), (b"content-length", str(len(AMBIGUOUS_BODY)).encode()),
                    (b"connection", b"close")]})
                await send({"type": "http.response.body", "body": AMBIGUOUS_BODY})
                return
        await self.app(scope, receive, send)


class Limits:
    def __init__(self, read_timeout: float = 30.0, max_connections: int = 1024):
        self.read_timeout, self.max_connections = read_timeout, max_connections
        self.cut = 0  # connections closed by the read deadline (for the log and tests)


def limited_protocol(limits: Limits) -> type:
    class LimitedH11Protocol(H11Protocol):
        _deadline = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            if len(self.connections) > limits.max_connections:
                transport.write(BUSY)
                transport.close()
                return
            self._arm()

        def data_received(self, data: bytes) -> None:
            if self._deadline is None and self.conn.their_state is h11.IDLE:
                self._arm()  # the first byte of the next request on a kept-alive connection
            super().data_received(data)
            if self._deadline is not None and self.conn.their_state not in (h11.IDLE, h11.SEND_BODY):
                self._disarm()  # the whole request is in (or the connection is done with)

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            self._deadline = self.loop.call_later(limits.read_timeout, self._read_timed_out)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _read_timed_out(self) -> None:
            self._deadline = None
            if not self.transport.is_closing():
                limits.cut += 1
                self.transport.close()  # its handler, if any, sees a disconnect and ends quietly

    return LimitedH11Protocol
