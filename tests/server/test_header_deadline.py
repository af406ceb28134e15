"""The header deadline on both of uvicorn's HTTP protocols (server/protocol.py): httptools',
which the service and the proxy run where it is installed, and h11's, where it is not. A
loopback server in this process, one trivial ASGI app, raw sockets."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest
import uvicorn

from mmferry.server.protocol import (
    h11_header_deadline_protocol,
    httptools_header_deadline_protocol,
)

TIMEOUT_S = 0.5
REQUEST = b"GET /x HTTP/1.1\r\nHost: a\r\n\r\n"


async def app(scope: dict, receive: Callable, send: Callable) -> None:
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


async def answer(reader: asyncio.StreamReader) -> bytes:
    return await asyncio.wait_for(reader.read(65536), 5)


@pytest.mark.parametrize(
    "factory", [httptools_header_deadline_protocol, h11_header_deadline_protocol]
)
def test_the_header_deadline(factory):
    cuts: list[float] = []

    async def main() -> None:
        protocol = factory(TIMEOUT_S, lambda: cuts.append(time.monotonic()))
        config = uvicorn.Config(app, host="127.0.0.1", port=0, http=protocol, log_level="error")
        server = uvicorn.Server(config)
        serving = asyncio.ensure_future(server.serve())
        while not server.started:
            await asyncio.sleep(0.01)
        port = server.servers[0].sockets[0].getsockname()[1]
        try:
            # Nothing sent at all, and headers sent a piece at a time: 408 at the deadline.
            silent = await asyncio.open_connection("127.0.0.1", port)
            dripping = await asyncio.open_connection("127.0.0.1", port)
            t0 = time.monotonic()
            for piece in (b"GET /x HT", b"TP/1.1\r\n", b"Host: a\r\n"):
                dripping[1].write(piece)
                await asyncio.sleep(0.1)
            for reader, _ in (silent, dripping):
                got = await answer(reader)
                assert got.startswith(b"HTTP/1.1 408"), got[:100]
                assert b"--header-timeout" in got
            assert TIMEOUT_S - 0.05 < time.monotonic() - t0 < TIMEOUT_S + 2
            assert len(cuts) == 2
            # A whole request is answered, and its kept-alive connection idles past the
            # deadline uncut; its next request is timed from its own first byte.
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(REQUEST)
            assert (await answer(reader)).startswith(b"HTTP/1.1 200")
            await asyncio.sleep(TIMEOUT_S * 2)
            writer.write(REQUEST)
            assert (await answer(reader)).startswith(b"HTTP/1.1 200")
            writer.write(b"GET /x HTTP/1.1\r\n")  # and then nothing
            assert (await answer(reader)).startswith(b"HTTP/1.1 408")
            assert len(cuts) == 3
            for _, w in (silent, dripping, (reader, writer)):
                w.close()
        finally:
            server.should_exit = True
            await serving

    asyncio.run(main())
