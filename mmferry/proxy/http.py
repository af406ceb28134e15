"""The proxy's HTTP client toward the engine, on wire.py's connections: the answer's head at
once, its body streamed as it arrives. The encoders' calls, read whole, are whole_calls.py's.

The client follows no redirect (an engine's 3xx goes to the client as it came) and keeps no
cookie (one client's cookie must never reach another's request); the URL's path is sent as
given (the proxy has already percent-encoded it, paths.py), and the body's bytes as the engine
wrote them (nothing decompressed: the proxy asks for `identity`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from mmferry.proxy.wire import Body, Connection, Head, Pool, header_lines, request_head, target


def transport_errors() -> tuple[type[BaseException], ...]:
    """What a call raises when its peer cannot be reached, breaks the connection or answers
    otherwise than HTTP/1.1 (timeouts of the connection included: all are OSErrors)."""
    return (OSError,)


class Reply:
    """An answer: status and headers at once; the body streamed (`aiter_raw`)."""

    def __init__(
        self, pool: Pool, key: tuple[str, int, bool], conn: Connection, head: Head
    ) -> None:
        self._pool = pool
        self._key = key
        self._conn: Connection | None = conn
        self._body = Body(conn, head)
        self._head = head
        self.status_code = head.status
        self.headers = head.headers  # lower-case names; a repeated header's values joined
        if self._body.done:
            self._release()

    def at_eof(self) -> bool:
        """Whether every byte of the body has been read."""
        return self._body.done

    def arrived(self) -> bool:
        """Whether every byte of the body has been received (read or not)."""
        return self._body.arrived()

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        """The body's bytes as they arrive."""
        try:
            async for piece in self._body.pieces():
                yield piece
        except BaseException:
            self._drop()
            raise
        self._release()

    def _release(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            self._pool.release(self._key, conn, self._head)

    def _drop(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()

    async def aclose(self) -> None:
        """The connection back to the pool if the body was read to its end, else closed (the
        peer sees the client leave: the engine aborts the request)."""
        if self._body.done:
            self._release()
        else:
            self._drop()


class Client:
    """Kept-alive connections to the engine. `read_timeout_s`: the longest wait for any byte
    of an answer (None: none); `connect_timeout_s`: a connection within this."""

    def __init__(self, *, connect_timeout_s: float, read_timeout_s: float | None) -> None:
        self._pool = Pool(connect_timeout_s)
        self._read_timeout_s = read_timeout_s

    async def send(
        self, method: str, url: str, headers: dict[str, str] | None = None, body: bytes = b""
    ) -> Reply:
        """The answer once its head is in; its body is still to be read or streamed."""
        key, path, host = target(url)
        head = request_head(method, path, host, header_lines(headers or {}), body)
        conn, answer = await self._pool.exchange(key, method, head, body, self._read_timeout_s)
        return Reply(self._pool, key, conn, answer)

    async def aclose(self) -> None:
        self._pool.close()
