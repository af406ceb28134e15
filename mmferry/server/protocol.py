"""The HTTP/1.1 connection the service and the proxy run under uvicorn: httptools' (h11's where
it is not installed), with a deadline for each request's headers.

uvicorn times a connection only while it idles between requests: a new connection that sends
nothing, or headers a byte at a time, holds its socket for ever. Here a connection gets
`--header-timeout` seconds from its opening, or from the first byte of a later request, to
complete the request's headers; past it the service answers 408 `header_timeout` and closes.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any


def _answer(timeout_s: float) -> bytes:
    message = (
        f"the request headers did not arrive within header_timeout_s={timeout_s:g} "
        "(--header-timeout)"
    )
    body = json.dumps({"error": {"kind": "header_timeout", "message": message}}).encode()
    head = (
        "HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
        f"connection: close\r\ncontent-length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


class _Deadline:
    """The deadline's timer, for either protocol class (listed before it): armed when a
    connection opens, `_headers_late` when it runs out."""

    timeout_s = 0.0  # these three set by _timed
    answer = b""
    _header_timer: Any = None

    @staticmethod
    def on_timeout() -> None:
        pass

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)  # type: ignore[misc]
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)  # type: ignore[misc]

    def _arm(self) -> None:
        self._disarm()
        loop = self.loop  # type: ignore[attr-defined]
        self._header_timer = loop.call_later(self.timeout_s, self._headers_late)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_late(self) -> None:
        raise NotImplementedError

    def _cut(self) -> None:
        """The 408 written, the connection closed, the cut counted."""
        self.on_timeout()
        transport = self.transport  # type: ignore[attr-defined]
        transport.write(self.answer)
        transport.close()


def _timed(cls: type, timeout_s: float, on_timeout: Callable[[], None]) -> type:
    """`cls` (a _Deadline) given its deadline, its answer and what counts a cut."""
    cls.timeout_s = timeout_s  # type: ignore[attr-defined]
    cls.answer = _answer(timeout_s)  # type: ignore[attr-defined]
    cls.on_timeout = staticmethod(on_timeout)  # type: ignore[attr-defined]
    return cls


def header_deadline_protocol(timeout_s: float, on_timeout: Callable[[], None]) -> type:
    """uvicorn's HTTP protocol class with the header deadline: httptools' (llhttp, compiled)
    where it is installed, else h11's; `on_timeout` counts each cut."""
    try:
        import httptools  # noqa: F401 - only whether it is there
    except ImportError:
        return h11_header_deadline_protocol(timeout_s, on_timeout)
    return httptools_header_deadline_protocol(timeout_s, on_timeout)


def httptools_header_deadline_protocol(timeout_s: float, on_timeout: Callable[[], None]) -> type:
    """uvicorn's httptools protocol class with the header deadline."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class HeaderDeadlineProtocol(_Deadline, HttpToolsProtocol):
        _awaiting_headers = True  # a request's first byte came (or the connection opened)

        def on_message_begin(self) -> None:
            super().on_message_begin()
            # NOTE: the first byte of a request on a kept-alive connection starts its deadline;
            # an idle connection is uvicorn's keep-alive timeout's to close.
            self._awaiting_headers = True
            if self._header_timer is None:
                self._arm()

        def on_headers_complete(self) -> None:
            self._awaiting_headers = False
            self._disarm()
            super().on_headers_complete()

        def _headers_late(self) -> None:
            self._header_timer = None
            if self.transport.is_closing() or not self._awaiting_headers:
                return
            if self.cycle is not None and not self.cycle.response_complete:
                # A pipelined request stalled behind an answer still going out: the answer
                # is not cut; the connection closes once it is sent.
                self.cycle.keep_alive = False
                return
            self._cut()

    return _timed(HeaderDeadlineProtocol, timeout_s, on_timeout)


def h11_header_deadline_protocol(timeout_s: float, on_timeout: Callable[[], None]) -> type:
    """uvicorn's h11 protocol class with the header deadline."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeaderDeadlineProtocol(_Deadline, H11Protocol):
        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.conn.their_state is h11.IDLE:
                # NOTE: the first bytes of a request on a kept-alive connection start its
                # deadline; an idle connection is uvicorn's keep-alive timeout's to close.
                if self._header_timer is None and self.conn.trailing_data[0]:
                    self._arm()
            else:
                self._disarm()  # the headers are in

        def _headers_late(self) -> None:
            self._header_timer = None
            if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
                return
            self._cut()

    return _timed(HeaderDeadlineProtocol, timeout_s, on_timeout)
