"""uvicorn's h11 protocol with a bound on each request head: its size and the time it may take to arrive.

uvicorn's default parser (httptools) takes a head of any size, and neither parser gives up on a client that
sends its headers a byte at a time; the Gate, which checks the key, only runs once a head is complete. So the
server runs this protocol: a head (request line and headers) over ``max_header_bytes`` is answered 431, one not
complete ``header_timeout`` seconds after its first byte 408, each as JSON naming the limit's flag, and the
connection is closed; a connection that sends no byte of a head for ``idle_timeout`` seconds (after it opened, or
after the last response on a kept-alive one) is closed without a word. Real clients write a head at once, so its
time is short (1 s by default) and a slow one is answered quickly; waiting for a request is a different thing and
gets its own, longer time. h11 reads the head in linear time (the header count is bounded by the Gate,
``max_headers``).
"""

from __future__ import annotations

import json

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from localrl.config_io import flag_name
from localrl.serving.limits import RequestLimits

HEAD_END = b"\r\n\r\n"


def bounded_protocol(limits: RequestLimits) -> type[H11Protocol]:
    """The protocol class for ``uvicorn.Config(http=...)`` with ``limits``' head bounds."""
    return type("BoundedH11Protocol", (BoundedH11Protocol,), {"limits": limits})


def raw_error(status: int, reason: str, message: str, code: str) -> bytes:
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                 "code": code}}).encode()
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            f"connection: close\r\n\r\n").encode() + body


class BoundedH11Protocol(H11Protocol):
    limits = RequestLimits()

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # h11 answers a bare 400 to an unfinished head over its own bound (16 KiB unless configured): the bound
        # a head is held to is ``max_header_bytes``, checked below, however the head's bytes arrive
        self.conn = h11.Connection(h11.SERVER, max_incomplete_event_size=self.limits.max_header_bytes)

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._head_bytes, self._tail, self._deadline = 0, b"", None
        self._arm(self.limits.idle_timeout, self._idle)

    def _arm(self, seconds: float, then) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(seconds, then)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _reading_head(self) -> bool:
        return self.conn.their_state is h11.IDLE

    def data_received(self, data: bytes) -> None:
        if self._reading_head() and data:
            room = self.limits.max_header_bytes - self._head_bytes
            if len(data) > room and HEAD_END not in self._tail + data[:max(room, 0)]:
                return self._refuse(431, "Request Header Fields Too Large",
                                    self._over("max_header_bytes", "request line and headers"), "headers_too_large")
            if not self._head_bytes:  # a head begins: from its first byte it has header_timeout to arrive
                self._arm(self.limits.header_timeout, self._too_slow)
            self._head_bytes += len(data)
            self._tail = (self._tail + data)[-3:]
        super().data_received(data)
        if not self._reading_head():
            self._head_bytes, self._tail = 0, b""
            self._disarm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm(self.limits.idle_timeout, self._idle)  # waiting for the next request on this connection

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _idle(self) -> None:
        self._deadline = None
        if not self.transport.is_closing() and self._reading_head() and not self._head_bytes:
            self.transport.close()  # nothing asked: nothing to answer

    def _too_slow(self) -> None:
        self._deadline = None
        if not self.transport.is_closing() and self._reading_head():
            self._refuse(408, "Request Timeout", self._over("header_timeout", "request line and headers",
                                                            unit=" s"), "header_timeout")

    def _over(self, name: str, what: str, unit: str = " bytes") -> str:
        return f"{what}: over the server's limit of {getattr(self.limits, name)}{unit} ({name}, its {flag_name(name)})"

    def _refuse(self, status: int, reason: str, message: str, code: str) -> None:
        self._disarm()
        self.transport.write(raw_error(status, reason, message, code))
        self.transport.close()
