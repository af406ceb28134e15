"""The proxy's calls whose answer it reads whole (the encoders' routes), on wire.py's
connections: the request written in one go, the answer read to its end.

Whoever calls puts one deadline on the whole call (an encoder trickling its answer cannot hold
a request past it); a call cancelled by it closes its connection.
"""

from __future__ import annotations

from mmferry.proxy.wire import Pool, header_lines, read_body, request_head, target


class WholeReply:
    """An answer read whole: `status_code`, `headers` (lower-case names; a repeated header's
    values joined by ", "), `content`."""

    __slots__ = ("status_code", "headers", "content")

    def __init__(self, status: int, headers: dict[str, str], content: bytes) -> None:
        self.status_code = status
        self.headers = headers
        self.content = content

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", "replace")


class WholeCalls:
    """`call` sends a request and reads its answer whole. `connect_timeout_s`: a new
    connection within this; `headers`: sent with every call."""

    def __init__(self, *, connect_timeout_s: float, headers: dict[str, str] | None = None) -> None:
        self._pool = Pool(connect_timeout_s)
        self._fixed = header_lines(headers or {})
        self._json = self._fixed + b"Content-Type: application/json\r\n"

    async def call(
        self, method: str, url: str, body: bytes = b"", json: bool = False
    ) -> WholeReply:
        """The whole answer to `method` on `url` with `body`; OSError (ConnectionError,
        ConnectTimeout, BadAnswer) when the peer cannot be reached or answers otherwise than
        HTTP/1.1."""
        key, path, host = target(url)
        head = request_head(method, path, host, self._json if json else self._fixed, body)
        conn, answer = await self._pool.exchange(key, method, head, body)
        try:
            content = await read_body(conn, answer)
        except BaseException:
            conn.close()  # cancelled or cut short: never reused
            raise
        self._pool.release(key, conn, answer)
        return WholeReply(answer.status, answer.headers, content)

    async def aclose(self) -> None:
        self._pool.close()
