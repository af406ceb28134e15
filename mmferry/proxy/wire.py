"""HTTP/1.1 for the proxy's clients, on asyncio's own transports: kept-alive connections by
host, a request written in one go, an answer's head and body parsed straight from the bytes
read.

aiohttp spent 210-260 us of CPU a call here (its request and response objects, timers, a task
per connection's payload, cookie and redirect machinery the proxy never uses); these calls take
60-100 us. Both the encoders' calls (whole_calls.py) and the engine's streamed answers
(http.py) run on it.

An answer's body is framed as HTTP/1.1 says: by Content-Length, in chunks, or by the
connection's end (that connection is not reused). A kept-alive connection the peer closed while
it idled fails a request before any byte of answer: the request is sent once more on a fresh
connection (the peer never read it). Anything else cut short closes its connection.
"""

from __future__ import annotations

import asyncio
import functools
import ssl
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

HEAD_LIMIT = 64 * 1024  # an answer's status line and headers, at most


class BadAnswer(ConnectionError):
    """The peer's bytes are not an HTTP/1.1 answer (a transport error: the call failed)."""


class ConnectTimeout(ConnectionError):
    """No connection within the connect timeout (not a call's own deadline, a TimeoutError)."""


class ReadTimeout(ConnectionError):
    """No byte of the answer within the read timeout."""


class Connection(asyncio.Protocol):
    """One connection: what arrived, and a future to wait for more."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.ended = False  # the peer closed, or the connection broke
        self.read_timeout_s: float | None = None
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
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def usable(self) -> bool:
        return not self.ended and self.transport is not None and not self.transport.is_closing()

    async def more(self) -> bool:
        """Wait for bytes (at most `read_timeout_s`: ReadTimeout); False once the peer has
        ended the connection."""
        if self.ended:
            return False
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            if self.read_timeout_s is None:
                await self._waiter
            else:
                try:
                    async with asyncio.timeout(self.read_timeout_s):
                        await self._waiter
                except TimeoutError:
                    raise ReadTimeout(
                        f"no byte of the answer within {self.read_timeout_s:g} s"
                    ) from None
        finally:
            self._waiter = None
        return bool(self.buffer) or not self.ended

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


class Head:
    """An answer's status line and headers: `status`, `headers` (lower-case names; a repeated
    header's values joined by ", "), and how its body is framed."""

    __slots__ = ("status", "headers", "keep", "length", "chunked")

    def __init__(self, status: int, headers: dict[str, str], keep: bool) -> None:
        self.status = status
        self.headers = headers
        self.keep = keep  # the connection may carry another request
        self.length: int | None = None  # None with `chunked`, or to the connection's end
        self.chunked = False


class EndedEarly(Exception):
    """The connection ended before any byte of the answer."""


@functools.lru_cache(maxsize=256)
def target(url: str) -> tuple[tuple[str, int, bool], bytes, bytes]:
    """((host, port, TLS), path with query, the Host header's line) of an http(s) URL; the path
    is sent as given (the proxy has percent-encoded it already, paths.py)."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"not an http(s) URL: {url!r}")
    tls = parts.scheme == "https"
    port = parts.port or (443 if tls else 80)
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return (parts.hostname, port, tls), path.encode(), f"Host: {parts.netloc}\r\n".encode()


def request_head(method: str, path: bytes, host: bytes, headers: bytes, body: bytes) -> bytes:
    """A request's head; `headers`: lines already written, each ending in CRLF."""
    head = b"%s %s HTTP/1.1\r\n%s%s" % (method.encode(), path, host, headers)
    if body or method not in ("GET", "HEAD"):
        head += b"Content-Length: %d\r\n" % len(body)
    return head + b"\r\n"


def header_lines(headers: dict[str, str]) -> bytes:
    """`headers` as request header lines; ValueError for a name or value that would split a
    line (no caller of the proxy's gets here with one: its server refuses them)."""
    out = []
    for k, v in headers.items():
        if "\r" in k or "\n" in k or "\r" in v or "\n" in v or ":" in k:
            raise ValueError(f"a header not fit to send: {k[:40]!r}")
        out.append(f"{k}: {v}\r\n")
    return "".join(out).encode("latin-1")


class Pool:
    """Kept-alive connections by (host, port, TLS), opened within `connect_timeout_s`."""

    def __init__(self, connect_timeout_s: float) -> None:
        self.connect_timeout_s = connect_timeout_s
        self._idle: dict[tuple[str, int, bool], list[Connection]] = {}
        self._ssl: ssl.SSLContext | None = None

    def idle(self, key: tuple[str, int, bool]) -> Connection | None:
        """A kept connection still open, or None. One the peer wrote to while it idled is
        closed: those bytes would be read as the next request's answer."""
        idle = self._idle.get(key)
        while idle:
            conn = idle.pop()
            if conn.usable() and not conn.buffer:
                return conn
            conn.close()
        return None

    def release(self, key: tuple[str, int, bool], conn: Connection, head: Head) -> None:
        """`conn`, its answer read to its end, kept for the next request where its head and
        state allow, else closed."""
        if head.keep and conn.usable() and not conn.buffer:
            conn.read_timeout_s = None
            self._idle.setdefault(key, []).append(conn)
        else:
            conn.close()

    async def connect(self, key: tuple[str, int, bool]) -> Connection:
        host, port, tls = key
        loop = asyncio.get_running_loop()
        context = None
        if tls:
            context = self._ssl = self._ssl or ssl.create_default_context()
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, conn = await loop.create_connection(
                    Connection, host, port, ssl=context, server_hostname=host if tls else None
                )
        except TimeoutError:
            raise ConnectTimeout(
                f"no connection to {host}:{port} within {self.connect_timeout_s:g} s"
            ) from None
        return conn

    async def exchange(
        self,
        key: tuple[str, int, bool],
        method: str,
        head: bytes,
        body: bytes,
        read_timeout_s: float | None = None,
    ) -> tuple[Connection, Head]:
        """The request sent and its answer's head read, on a kept connection or a new one;
        the connection is the caller's until its body is read (then `release`) or it is closed.
        `read_timeout_s`: the longest wait for any byte of the answer."""
        conn = self.idle(key)
        if conn is not None:
            conn.read_timeout_s = read_timeout_s
            try:
                return conn, await _send(conn, method, head, body)
            except EndedEarly:
                pass  # closed by the peer while it idled: once more on a new connection
        conn = await self.connect(key)
        conn.read_timeout_s = read_timeout_s
        try:
            return conn, await _send(conn, method, head, body)
        except EndedEarly:
            raise ConnectionResetError("the peer closed the connection before answering") from None

    def close(self) -> None:
        for idle in self._idle.values():
            for conn in idle:
                conn.close()
        self._idle.clear()


async def _send(conn: Connection, method: str, head: bytes, body: bytes) -> Head:
    assert conn.transport is not None
    try:
        if len(body) < 65536:
            conn.transport.write(head + body)
        else:
            conn.transport.write(head)
            conn.transport.write(body)
        return await read_head(conn, method)
    except BaseException:
        conn.close()  # cancelled, ended or a broken answer: never reused
        raise


async def read_head(conn: Connection, method: str) -> Head:
    """The answer's head, its bytes taken from the buffer; EndedEarly when the connection
    ended before any byte, BadAnswer when what came is not HTTP/1.1."""
    while True:
        head = await _one_head(conn, method)
        if head is not None:
            return head


async def _one_head(conn: Connection, method: str) -> Head | None:
    """A head read from the buffer; None for an interim answer (1xx: the next one follows)."""
    buf = conn.buffer
    while True:
        end = buf.find(b"\r\n\r\n")
        if end >= 0:
            break
        if len(buf) > HEAD_LIMIT:
            raise BadAnswer(f"an answer's head over {HEAD_LIMIT} bytes")
        if not await conn.more():
            if not buf:
                raise EndedEarly
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
    if status == 101:
        raise BadAnswer("an answer switching protocols (101), to a request that asked for none")
    if 100 <= status < 200:
        return None  # 100 Continue (a client's Expect passed on), 103 Early Hints
    keep = version == "HTTP/1.1" and "close" not in headers.get("connection", "").lower()
    head = Head(status, headers, keep)
    if method == "HEAD" or status in (204, 304):
        head.length = 0
        return head
    coding = headers.get("transfer-encoding")
    if coding is not None:
        if coding.lower() != "chunked":
            raise BadAnswer(f"transfer-encoding {coding!r}")
        head.chunked = True
        return head
    length = headers.get("content-length")
    if length is None:
        head.keep = False  # the body ends with the connection
        return head
    if not (length.isascii() and length.isdigit()):
        raise BadAnswer(f"content-length {length!r}")
    head.length = int(length)
    return head


def _status(line: str) -> tuple[int, str]:
    version, _, rest = line.partition(" ")
    code = rest[:3]
    digits = code.isascii() and code.isdigit() and len(code) == 3
    if version not in ("HTTP/1.1", "HTTP/1.0") or not digits or rest[3:4] not in ("", " "):
        raise BadAnswer(f"not an HTTP/1.1 status line: {line[:80]!r}")
    return int(code), version


async def exactly(conn: Connection, n: int) -> bytes:
    """The next `n` bytes of the body; BadAnswer if the connection ends first."""
    buf = conn.buffer
    while len(buf) < n:
        if not await conn.more():
            raise BadAnswer(f"the connection ended {n - len(buf)} bytes short of the answer")
    return _front(buf, n)


def _front(buf: bytearray, most: int) -> bytes:
    """At most `most` bytes off the front of `buf`."""
    piece = bytes(buf[:most]) if len(buf) > most else bytes(buf)
    del buf[: len(piece)]
    return piece


async def read_body(conn: Connection, head: Head) -> bytes:
    """The whole body."""
    if head.length is not None:
        return await exactly(conn, head.length)
    return b"".join([piece async for piece in Body(conn, head).pieces()])


class Body:
    """An answer's body read as it arrives: `pieces()` yields its bytes (each what one or more
    reads brought); `done` once every byte and the framing's end were taken; `arrived()`
    whether the rest is in already (nothing left to wait for)."""

    def __init__(self, conn: Connection, head: Head) -> None:
        self.conn = conn
        self.head = head
        self.done = head.length == 0
        # Bytes of data left: of the body (by length) or of the current chunk (0: a chunk's
        # size line is next).
        self.left = head.length or 0
        self.crlf_due = False  # a chunk's data taken, its CRLF not yet

    def arrived(self) -> bool:
        if self.done:
            return True
        buf = self.conn.buffer
        if self.head.length is not None:
            return len(buf) >= self.left
        if not self.head.chunked:
            return False  # known only once the connection ends
        at = self.left + 2 if self.left or self.crlf_due else 0
        return _last_chunk_at(buf, at) is not None

    async def pieces(self) -> AsyncIterator[bytes]:
        conn, buf = self.conn, self.conn.buffer
        if self.head.length is not None:
            while self.left:
                if not buf and not await conn.more():
                    raise BadAnswer(f"the connection ended {self.left} bytes short of the answer")
                piece = self._take(self.left)
                if not self.left:
                    self.done = True
                yield piece
            return
        if not self.head.chunked:
            while True:
                if buf:
                    yield self._take(len(buf))
                if not await conn.more() and not buf:
                    self.done = True
                    return
        while not self.done:
            if self.crlf_due:
                if await exactly(conn, 2) != b"\r\n":
                    raise BadAnswer("a chunk not ended by CRLF")
                self.crlf_due = False
            if not self.left:
                self.left = await self._size_line()
                if not self.left:
                    await self._trailer()
                    return
            if not buf and not await conn.more():
                raise BadAnswer("the connection ended within a chunked answer")
            # NOTE: a chunk's bytes go on as they arrive, not once the whole chunk is in: a
            # stream's event is never held back for the rest of its chunk.
            piece = self._take(self.left)
            if not self.left:
                self.crlf_due = True
                self._end_if_in()
            yield piece

    def _take(self, most: int) -> bytes:
        piece = _front(self.conn.buffer, most)
        self.left -= len(piece)
        return piece

    async def _size_line(self) -> int:
        conn, buf = self.conn, self.conn.buffer
        while (eol := buf.find(b"\r\n")) < 0:
            if len(buf) > HEAD_LIMIT:
                raise BadAnswer("a chunk's size line too long")
            if not await conn.more():
                raise BadAnswer("the connection ended within a chunked answer")
        size = _chunk_size(buf[:eol])
        if size is None:
            raise BadAnswer(f"a chunk size {bytes(buf[:eol])[:20]!r}")
        del buf[: eol + 2]
        return size

    def _end_if_in(self) -> None:
        """The body's end taken at once where it is in already (the chunk's CRLF, the last
        chunk, its trailers), so that `done` holds as soon as the last byte of data is."""
        buf = self.conn.buffer
        if buf[:2] == b"\r\n" and _last_chunk_at(buf, 2) == 2:
            del buf[: buf.find(b"\r\n\r\n", buf.find(b"\r\n", 2)) + 4]
            self.crlf_due = False
            self.done = True

    async def _trailer(self) -> None:
        """The trailers (none expected) up to the empty line that ends the body."""
        conn, buf = self.conn, self.conn.buffer
        while (eol := buf.find(b"\r\n")) != 0:
            if eol > 0:
                del buf[: eol + 2]
                continue
            if not await conn.more():
                raise BadAnswer("the connection ended within a chunked answer's trailer")
        del buf[:2]
        self.done = True


_HEX = frozenset(b"0123456789abcdefABCDEF")


def _chunk_size(line: bytes | bytearray) -> int | None:
    """A chunk's size, or None for a size line that is not hex digits (int() would also take
    a sign, a 0x, underscores: a size of -1 had the body's reader spin)."""
    text = bytes(line).split(b";", 1)[0].strip()
    if not text or not _HEX.issuperset(text):
        return None
    return int(text, 16)


def _last_chunk_at(buf: bytes | bytearray, at: int) -> int | None:
    """Where in `buf` the last chunk (size 0, its trailers and the empty line) starts, with
    every chunk before it whole from `at` (a chunk boundary), or None: not all in yet."""
    while True:
        eol = buf.find(b"\r\n", at)
        if eol < 0:
            return None
        size = _chunk_size(buf[at:eol])
        if size is None:
            return None
        if size == 0:
            return at if buf.find(b"\r\n\r\n", eol) >= 0 else None
        at = eol + 2 + size + 2
        if at > len(buf):
            return None
