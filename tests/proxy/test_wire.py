"""The proxy's HTTP/1.1 clients (proxy/wire.py): the encoders' whole-answer calls
(whole_calls.py) and the engine's streamed answers (http.py), against raw asyncio servers that
answer each request with scripted bytes: every framing HTTP/1.1 allows, kept-alive connections
reused and never a broken one, a stream's bytes passed on as they arrive, and the peers that
lie."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import pytest

from mmferry.proxy.http import Client
from mmferry.proxy.whole_calls import WholeCalls
from mmferry.proxy.wire import BadAnswer, ConnectTimeout, ReadTimeout
from mmferry.testing.ports import unreachable_port

Answer = Callable[[bytes, asyncio.StreamWriter], Awaitable[None]]


class Peer:
    """A loopback server: each request's head and body recorded, `answer` writes the reply."""

    def __init__(self, answer: Answer) -> None:
        self.answer = answer
        self.requests: list[tuple[int, bytes, bytes]] = []  # (connection, head, body)
        self.connections = 0
        self.closed = 0
        self.reader: asyncio.StreamReader | None = None
        self.server: asyncio.Server | None = None

    async def __aenter__(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.reader = reader  # the latest connection's
        n = self.connections
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except asyncio.IncompleteReadError:
                    return
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                body = await reader.readexactly(length)
                self.requests.append((n, head, body))
                await self.answer(head, writer)
                if writer.is_closing():
                    return
        finally:
            self.closed += 1
            writer.close()


def says(*raw: bytes, close: bool = False) -> Answer:
    async def answer(head: bytes, writer: asyncio.StreamWriter) -> None:
        for part in raw:
            writer.write(part)
            await writer.drain()
            await asyncio.sleep(0.01)  # a read each: the parser meets every split
        if close:
            writer.close()

    return answer


OK = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 11\r\n\r\n"


def run(main: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(main())


def test_a_call_writes_one_request_and_its_connection_is_kept_for_the_next():
    async def main() -> None:
        peer = Peer(says(OK[:20], OK[20:] + b'{"a": 1}', b"..."))
        async with peer as url:
            calls = WholeCalls(connect_timeout_s=2, headers={"Authorization": "Bearer k"})
            big = bytes(range(256)) * 400  # past the size written in one piece
            r = await calls.call("POST", url + "/encode?x=1", big, json=True)
            assert (r.status_code, r.content) == (200, b'{"a": 1}...')
            assert r.headers["content-type"] == "application/json"
            r = await calls.call("GET", url + "/health")
            assert r.status_code == 200
            await calls.aclose()
        (c1, head1, body1), (c2, head2, body2) = peer.requests
        assert c1 == c2 == 1  # one connection for both
        assert body1 == big and body2 == b""
        lines = head1.decode().split("\r\n")
        assert lines[0] == "POST /encode?x=1 HTTP/1.1"
        port = url.rsplit(":", 1)[1]
        for expected in (
            f"Host: 127.0.0.1:{port}",
            "Authorization: Bearer k",
            "Content-Type: application/json",
            f"Content-Length: {len(big)}",
        ):
            assert expected in lines
        assert head2.decode().startswith("GET /health HTTP/1.1\r\n")
        assert b"content-length" not in head2.lower()

    run(main)


def test_chunked_answers_and_repeated_headers():
    chunked = (
        b"HTTP/1.1 429 Too Many Requests\r\nTransfer-Encoding: chunked\r\n"
        b"Retry-After: 3\r\nX-Seen: a\r\nx-seen: b\r\n\r\n"
    )
    body = b"5;ext=1\r\nhello\r\n1\r\n \r\n" + b"B\r\nworld, more\r\n0\r\nTrailer: t\r\n\r\n"

    async def main() -> None:
        peer = Peer(says(chunked, body[:9], body[9:30], body[30:]))
        async with peer as url:
            calls = WholeCalls(connect_timeout_s=2)
            for _ in range(2):
                r = await calls.call("POST", url + "/encode", b"{}")
                assert r.status_code == 429
                assert r.content == b"hello world, more"
                assert r.headers["retry-after"] == "3"
                assert r.headers["x-seen"] == "a, b"
            await calls.aclose()
        assert peer.connections == 1

    run(main)


@pytest.mark.parametrize(
    "raw",
    [
        b"HTTP/1.0 200 OK\r\n\r\nuntil the end",
        b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nuntil the end",
    ],
    ids=["http-1.0", "connection-close"],
)
def test_an_answer_that_ends_with_its_connection_is_read_whole_and_not_reused(raw):
    async def main() -> None:
        peer = Peer(says(raw, close=True))
        async with peer as url:
            calls = WholeCalls(connect_timeout_s=2)
            for _ in range(2):
                r = await calls.call("GET", url + "/health")
                assert r.content == b"until the end"
            await calls.aclose()
        assert peer.connections == 2

    run(main)


def test_interim_answers_are_passed_over():
    early = b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n"

    async def main() -> None:
        peer = Peer(says(early, OK + b'{"a": 1}...'))
        async with peer as url:
            calls = WholeCalls(connect_timeout_s=2)
            r = await calls.call("POST", url + "/encode", b"{}")
            assert (r.status_code, r.content) == (200, b'{"a": 1}...')
            assert "link" not in r.headers
            await calls.aclose()

    run(main)


def test_a_kept_connection_the_peer_closed_while_it_idled_is_not_a_failure():
    """The peer answers with a length (keep-alive) and then closes while the connection idles,
    as uvicorn does past its keep-alive timeout: the next call goes on a new connection, sent
    once."""

    async def answer(head: bytes, writer: asyncio.StreamWriter) -> None:
        writer.write(OK + b'{"a": 1}...')
        await writer.drain()
        writer.close()

    async def main() -> None:
        peer = Peer(answer)
        async with peer as url:
            calls = WholeCalls(connect_timeout_s=2)
            await calls.call("POST", url + "/encode", b"1")
            await asyncio.sleep(0.1)  # the close arrives while the connection idles
            r = await calls.call("POST", url + "/encode", b"2")
            assert r.status_code == 200
            await calls.aclose()
        assert [(c, body) for c, _, body in peer.requests] == [(1, b"1"), (2, b"2")]

    run(main)


def test_bytes_a_peer_writes_on_an_idle_connection_are_never_read_as_an_answer():
    async def answer(head: bytes, writer: asyncio.StreamWriter) -> None:
        writer.write(OK + b'{"a": 1}...')
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.write(b"HTTP/1.1 500 Stale\r\nContent-Length: 0\r\n\r\n")

    async def main() -> None:
        async with Peer(answer) as url:
            calls = WholeCalls(connect_timeout_s=2)
            await calls.call("POST", url + "/encode", b"1")
            await asyncio.sleep(0.2)  # the stray answer arrives while the connection idles
            r = await calls.call("POST", url + "/encode", b"2")
            assert r.status_code == 200
            await calls.aclose()

    run(main)


def test_a_kept_connection_that_ends_as_the_call_is_sent_has_the_call_sent_once_more():
    """The peer's close crosses the next request on a kept connection (it answers a
    connection's first request only, then drops it unanswered): sent again on a new one."""

    async def answer(head: bytes, writer: asyncio.StreamWriter) -> None:
        served = [c for c, _, _ in peer.requests]
        if served.count(served[-1]) > 1:
            writer.close()
            return
        writer.write(OK + b'{"a": 1}...')
        await writer.drain()

    async def main() -> None:
        async with peer as url:
            calls = WholeCalls(connect_timeout_s=2)
            for body in (b"1", b"2"):
                r = await calls.call("POST", url + "/encode", body)
                assert r.status_code == 200
            await calls.aclose()
        assert [(c, body) for c, _, body in peer.requests] == [(1, b"1"), (1, b"2"), (2, b"2")]

    peer = Peer(answer)
    run(main)


@pytest.mark.parametrize(
    "raw, message",
    [
        (b"SPDY/3 200 OK\r\n\r\n", "status line"),
        (b"HTTP/1.1 2OO OK\r\n\r\n", "status line"),
        (b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n", "header line"),
        (b"HTTP/1.1 200 OK\r\n X-Folded: x\r\n\r\n", "header line"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n", "content-length"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 20\r\n\r\nshort", "short"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\n", "transfer-encoding"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", "chunk size"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n-1\r\nab\r\n", "chunk size"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n0x2\r\nab\r\n", "chunk size"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n+2\r\nab\r\n", "chunk size"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: \xb2\r\n\r\nab", "content-length"),
        (b"HTTP/1.1 2\xb20 OK\r\n\r\n", "status line"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nabXY", "CRLF"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n9\r\nab", "ended"),
        (b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: h2c\r\n\r\n", "switching"),
        (b"HTTP/1.1 200 OK\r\nX: " + b"y" * 70_000, "head over"),
        (b"HTTP/1.1 200 OK\r\nX:", "within the answer's head"),
    ],
)
def test_an_answer_not_http_is_a_transport_error_and_its_connection_is_dropped(raw, message):
    async def main() -> None:
        peer = Peer(says(raw, close=True))
        async with peer as url:
            calls = WholeCalls(connect_timeout_s=2)
            with pytest.raises(BadAnswer, match=message) as e:
                await calls.call("POST", url + "/encode", b"{}")
            assert isinstance(e.value, OSError)  # what the encoder pool counts as down
            assert not any(calls._pool._idle.values())
            await calls.aclose()

    run(main)


def test_a_new_connection_closed_before_any_answer_fails_the_call_without_a_resend():
    async def main() -> None:
        peer = Peer(says(close=True))
        async with peer as url:
            calls = WholeCalls(connect_timeout_s=2)
            with pytest.raises(ConnectionResetError, match="before answering"):
                await calls.call("POST", url + "/encode", b"{}")
            await calls.aclose()
        assert len(peer.requests) == 1

    run(main)


def test_a_call_cancelled_by_its_deadline_closes_its_connection():
    """The peer answers the first call a byte at a time past the caller's deadline: the call
    ends at the deadline, its connection is closed (the peer sees it go), the next call gets a
    new one and a whole answer."""
    slow = [bytes([b]) for b in OK + b'{"a": 1}...']

    async def answer(head: bytes, writer: asyncio.StreamWriter) -> None:
        parts = slow if peer.connections == 1 else [OK + b'{"a": 1}...']
        for part in parts:
            writer.write(part)
            await writer.drain()
            if len(parts) > 1:
                await asyncio.sleep(0.05)

    async def main() -> None:
        async with peer as url:
            calls = WholeCalls(connect_timeout_s=2)
            t0 = time.monotonic()
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(0.5):
                    await calls.call("POST", url + "/encode", b"{}")
            assert time.monotonic() - t0 < 2.5  # the deadline, not the slow answer (4 s)
            r = await calls.call("POST", url + "/encode", b"{}")
            assert r.content == b'{"a": 1}...'
            await asyncio.sleep(0.1)
            assert peer.closed == 1  # the first connection
            await calls.aclose()
        assert peer.connections == 2

    peer = Peer(answer)
    run(main)


@pytest.mark.parametrize("kind", ["refused", "silent"])
def test_an_unreachable_peer_fails_within_the_connect_timeout(kind):
    async def main() -> None:
        with unreachable_port(kind) as port:
            calls = WholeCalls(connect_timeout_s=0.5)
            t0 = time.monotonic()
            expected = ConnectTimeout if kind == "silent" else ConnectionRefusedError
            with pytest.raises(expected):
                await calls.call("GET", f"http://127.0.0.1:{port}/health")
            assert time.monotonic() - t0 < 3.0
            await calls.aclose()

    run(main)


def test_a_url_not_http_is_refused():
    async def main() -> None:
        calls = WholeCalls(connect_timeout_s=0.5)
        with pytest.raises(ValueError, match="not an http"):
            await calls.call("GET", "ftp://127.0.0.1:1/health")

    run(main)


def test_a_stream_passes_each_piece_on_as_it_arrives_and_keeps_its_connection():
    """Chunks written a second apart reach the reader one by one, not at the end; `arrived`
    and `at_eof` say what is in and what was read; the connection serves the next call."""
    head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
    head += b"transfer-encoding: chunked\r\nset-cookie: a=1\r\nset-cookie: b=2\r\n\r\n"
    events = [b"data: one\n\n", b"data: two\n\n", b"data: [DONE]\n\n"]
    gap_s = 0.3

    async def answer(request: bytes, writer: asyncio.StreamWriter) -> None:
        writer.write(head)
        for e in events:
            writer.write(b"%x\r\n%s\r\n" % (len(e), e))
            await writer.drain()
            await asyncio.sleep(gap_s)
        writer.write(b"0\r\n\r\n")

    async def main() -> None:
        async with Peer(answer) as url:
            client = Client(connect_timeout_s=2, read_timeout_s=5)
            for _ in range(2):
                r = await client.send("POST", url + "/v1/chat/completions", {"x-a": "1"}, b"{}")
                assert r.status_code == 200 and r.headers["set-cookie"] == "a=1, b=2"
                got, times = [], []
                t0 = time.monotonic()
                async for piece in r.aiter_raw():
                    got.append(piece)
                    times.append(time.monotonic() - t0)
                    if len(got) < len(events):
                        assert not r.at_eof() and not r.arrived()
                assert got == events
                assert times[1] - times[0] > gap_s / 2  # the first came before the second
                assert r.at_eof() and r.arrived()
                await r.aclose()
            await client.aclose()

    asyncio.run(main())


def test_a_whole_answer_in_one_read_has_arrived_and_ends_with_its_last_piece():
    raw = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
    raw += b"3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n"

    async def main() -> None:
        peer = Peer(says(raw))
        async with peer as url:
            client = Client(connect_timeout_s=2, read_timeout_s=5)
            for _ in range(2):
                r = await client.send("GET", url + "/v1/models")
                await asyncio.sleep(0.1)
                assert r.arrived() and not r.at_eof()
                pieces = r.aiter_raw()
                assert await pieces.__anext__() == b"abc"
                assert not r.at_eof()
                assert await pieces.__anext__() == b"de"
                assert r.at_eof()  # the last chunk taken with the last byte of data
                await r.aclose()
            await client.aclose()
        assert peer.connections == 1

    asyncio.run(main())


def test_a_stream_left_midway_closes_its_connection_and_one_that_stalls_is_cut():
    """The client leaves after the first event: the engine sees its connection close (and
    aborts). A stream that stops sending fails after the read timeout."""
    head = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"

    async def answer(request: bytes, writer: asyncio.StreamWriter) -> None:
        writer.write(head + b"3\r\none\r\n")
        await writer.drain()
        for _ in range(1500):  # until the client leaves (its FIN read as the body's end)
            if peer.reader is not None and peer.reader.at_eof():
                return
            await asyncio.sleep(0.02)

    async def main() -> None:
        async with peer as url:
            client = Client(connect_timeout_s=2, read_timeout_s=0.5)
            r = await client.send("POST", url + "/v1/chat/completions", {}, b"{}")
            pieces = r.aiter_raw()
            assert await pieces.__anext__() == b"one"
            await r.aclose()
            for _ in range(50):
                if peer.closed:
                    break
                await asyncio.sleep(0.02)
            assert peer.closed == 1
            r = await client.send("POST", url + "/v1/chat/completions", {}, b"{}")
            t0 = time.monotonic()
            with pytest.raises(ReadTimeout):
                async for _ in r.aiter_raw():
                    pass
            assert 0.4 < time.monotonic() - t0 < 3.0
            await r.aclose()
            await client.aclose()
        assert peer.connections == 2

    peer = Peer(answer)
    asyncio.run(main())


def test_a_body_by_length_streams_and_an_empty_one_frees_its_connection_at_once():
    async def answer(request: bytes, writer: asyncio.StreamWriter) -> None:
        if request.startswith(b"DELETE"):
            writer.write(b"HTTP/1.1 204 No Content\r\n\r\n")
            return
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 6\r\n\r\nabc")
        await writer.drain()
        await asyncio.sleep(0.2)
        writer.write(b"def")

    async def main() -> None:
        peer = Peer(answer)
        async with peer as url:
            client = Client(connect_timeout_s=2, read_timeout_s=5)
            r = await client.send("DELETE", url + "/x")
            assert r.status_code == 204 and r.at_eof() and r.arrived()
            r = await client.send("GET", url + "/x")
            assert not r.arrived()
            assert [p async for p in r.aiter_raw()] == [b"abc", b"def"]
            assert r.at_eof()
            await r.aclose()
            await client.aclose()
        assert peer.connections == 1

    asyncio.run(main())
