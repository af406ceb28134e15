"""The proxy's calls whose answer it reads whole (the encoders' routes): HTTP/1.1 on asyncio's
own transports, a pool of kept-alive connections for each encoder.

aiohttp spent 210-260 us of CPU on each such call here (its request and response objects,
timers, a task per connection's payload, its cookie and redirect machinery, all unused by a
call that posts bytes and reads the answer whole); this client writes the request in one go and
parses the status line, headers and body straight from the bytes read, 60-100 us a call. The
engine's answers, streamed to the client, stay aiohttp's (http.py).

The answer's framing is HTTP/1.1's: a Content-Length, chunks, or the connection's end (then
the connection is not reused). Whoever calls puts one deadline on the whole call; a call
cancelled by it closes its connection. A kept-alive connection the encoder closed while it
idled fails a call before any byte of answer: that call is sent once more on a fresh
connection (the encoder never read it).
"""

from __future__ import annotations

import asyncio
import functools
import ssl
from urllib.parse import urlsplit

HEAD_LIMIT = 64 * 1024  # an answer's status line and headers, at most


class BadAnswer(ConnectionError):
    """The peer's bytes are not an HTTP/1.1 answer (a transport error: the call failed)."""


class ConnectTimeout(ConnectionError):
    """No connection within the connect timeout (not the call's own deadline, a TimeoutError)."""


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


class _Connection(asyncio.Protocol):
    """One connection: what arrived, and a future to wait for more."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.ended = False  # the peer closed, or the connection broke
        self.error: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        self._wake()

    def eof_received(self) -> bool:
        self.ended = True
        self._wake()
        return False  # the transport closes itself

    def connection_lost(self, exc: Exception | None) -> None:
        self.ended = True
        self.error = exc
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def usable(self) -> bool:
        return not self.ended and self.transport is not None and not self.transport.is_closing()

    async def more(self) -> bool:
        """Wait for bytes; False once the peer has ended the connection."""
        if self.ended:
            return False
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None
        return bool(self.buffer) or not self.ended

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


@functools.lru_cache(maxsize=256)
def _target(url: str) -> tuple[str, str, int, bool, bytes]:
    """(host, path with query, port, TLS, the Host header's line) of an http(s) URL."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"not an http(s) URL: {url!r}")
    tls = parts.scheme == "https"
    port = parts.port or (443 if tls else 80)
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return parts.hostname, path, port, tls, f"Host: {parts.netloc}\r\n".encode("latin-1")


class WholeCalls:
    """Kept-alive connections by host; `call` sends a request and reads its answer whole.
    `connect_timeout_s`: a new connection within this; `headers`: sent with every call."""

    def __init__(self, *, connect_timeout_s: float, headers: dict[str, str] | None = None) -> None:
        self.connect_timeout_s = connect_timeout_s
        self._fixed = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items()).encode()
        self._idle: dict[tuple[str, int, bool], list[_Connection]] = {}
        self._ssl: ssl.SSLContext | None = None

    async def call(
        self, method: str, url: str, body: bytes = b"", json: bool = False
    ) -> WholeReply:
        """The whole answer to `method` on `url` with `body`; OSError (ConnectionError,
        ConnectTimeout, BadAnswer) when the peer cannot be reached or answers otherwise than
        HTTP/1.1."""
        host, path, port, tls, host_line = _target(url)
        head = b"%s %s HTTP/1.1\r\n%s%s" % (method.encode(), path.encode(), host_line, self._fixed)
        if json:
            head += b"Content-Type: application/json\r\n"
        if body or method not in ("GET", "HEAD"):
            head += b"Content-Length: %d\r\n" % len(body)
        head += b"\r\n"
        request = head + body if len(body) < 65536 else None
        key = (host, port, tls)
        idle = self._idle.setdefault(key, [])
        while idle:
            conn = idle.pop()
            if not conn.usable():
                conn.close()
                continue
            reply = await self._exchange(conn, key, method, head, body, request, reused=True)
            if reply is not None:
                return reply
            break  # closed by the peer while it idled: once more on a new connection
        conn = await self._connect(host, port, tls)
        reply = await self._exchange(conn, key, method, head, body, request, reused=False)
        assert reply is not None
        return reply

    async def _connect(self, host: str, port: int, tls: bool) -> _Connection:
        loop = asyncio.get_running_loop()
        context = None
        if tls:
            context = self._ssl = self._ssl or ssl.create_default_context()
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, conn = await loop.create_connection(
                    _Connection, host, port, ssl=context, server_hostname=host if tls else None
                )
        except TimeoutError:
            raise ConnectTimeout(
                f"no connection to {host}:{port} within {self.connect_timeout_s:g} s"
            ) from None
        return conn

    async def _exchange(
        self,
        conn: _Connection,
        key: tuple[str, int, bool],
        method: str,
        head: bytes,
        body: bytes,
        request: bytes | None,
        reused: bool,
    ) -> WholeReply | None:
        """The answer; None when a reused connection ended before any byte of it."""
        assert conn.transport is not None
        try:
            if request is not None:
                conn.transport.write(request)
            else:
                conn.transport.write(head)
                conn.transport.write(body)
            reply, keep = await _read_answer(conn, method)
        except _EndedEarly:
            conn.close()
            if reused:
                return None
            raise ConnectionResetError("the peer closed the connection before answering") from None
        except BaseException:
            conn.close()  # cancelled, or a broken answer: never reused
            raise
        if keep and conn.usable() and not conn.buffer:
            self._idle[key].append(conn)
        else:
            conn.close()
        return reply

    async def aclose(self) -> None:
        for idle in self._idle.values():
            for conn in idle:
                conn.close()
        self._idle.clear()


class _EndedEarly(Exception):
    """The connection ended before any byte of the answer."""


async def _read_answer(conn: _Connection, method: str) -> tuple[WholeReply, bool]:
    """(the answer, whether the connection may carry another request)."""
    buf = conn.buffer
    while True:
        end = buf.find(b"\r\n\r\n")
        if end >= 0:
            break
        if len(buf) > HEAD_LIMIT:
            raise BadAnswer(f"an answer's head over {HEAD_LIMIT} bytes")
        if not await conn.more():
            if not buf:
                raise _EndedEarly
            raise BadAnswer("the connection ended within the answer's head")
    lines = bytes(buf[:end]).decode("latin-1").split("\r\n")
    del buf[: end + 4]
    status, version = _status(lines[0])
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, colon, value = line.partition(":")
        if not colon or not name or name != name.strip():
            raise BadAnswer(f"a header line not an HTTP header: {line[:80]!r}")
        name = name.lower()
        value = value.strip()
        headers[name] = f"{headers[name]}, {value}" if name in headers else value
    if 100 <= status < 200:
        raise BadAnswer(f"an interim answer {status} to a request that asked for none")
    keep = version == "HTTP/1.1" and "close" not in headers.get("connection", "").lower()
    if method == "HEAD" or status in (204, 304):
        return WholeReply(status, headers, b""), keep
    coding = headers.get("transfer-encoding")
    if coding is not None:
        if coding.lower() != "chunked":
            raise BadAnswer(f"transfer-encoding {coding!r}")
        return WholeReply(status, headers, await _chunks(conn)), keep
    length = headers.get("content-length")
    if length is None:
        while await conn.more():
            pass  # the body ends with the connection
        content = bytes(buf)
        buf.clear()
        return WholeReply(status, headers, content), False
    if not length.isdigit():
        raise BadAnswer(f"content-length {length!r}")
    return WholeReply(status, headers, await _exactly(conn, int(length))), keep


def _status(line: str) -> tuple[int, str]:
    version, _, rest = line.partition(" ")
    code = rest[:3]
    if version not in ("HTTP/1.1", "HTTP/1.0") or not code.isdigit() or rest[3:4] not in ("", " "):
        raise BadAnswer(f"not an HTTP/1.1 status line: {line[:80]!r}")
    return int(code), version


async def _exactly(conn: _Connection, n: int) -> bytes:
    buf = conn.buffer
    while len(buf) < n:
        if not await conn.more():
            raise BadAnswer(f"the connection ended {n - len(buf)} bytes short of the answer")
    content = bytes(buf[:n]) if len(buf) > n else bytes(buf)
    del buf[:n]
    return content


async def _chunks(conn: _Connection) -> bytes:
    buf = conn.buffer
    out = bytearray()
    while True:
        while (eol := buf.find(b"\r\n")) < 0:
            if len(buf) > HEAD_LIMIT:
                raise BadAnswer("a chunk's size line too long")
            if not await conn.more():
                raise BadAnswer("the connection ended within a chunked answer")
        size_text = bytes(buf[:eol]).split(b";", 1)[0].strip()
        try:
            size = int(size_text, 16)
        except ValueError:
            raise BadAnswer(f"a chunk size {size_text[:20]!r}") from None
        del buf[: eol + 2]
        if size == 0:
            # The trailers (none expected) end with an empty line.
            while (eol := buf.find(b"\r\n")) != 0:
                if eol > 0:
                    del buf[: eol + 2]
                    continue
                if not await conn.more():
                    raise BadAnswer("the connection ended within a chunked answer's trailer")
            del buf[:2]
            return bytes(out)
        out += await _exactly(conn, size)
        if await _exactly(conn, 2) != b"\r\n":
            raise BadAnswer("a chunk not ended by CRLF")
