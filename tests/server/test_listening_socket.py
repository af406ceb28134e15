"""The socket `mmferry serve` and `mmferry proxy` listen on: asyncio turns Nagle off on the
connections it accepts, so a response written in parts never waits for the peer's delayed ACK
(about 40 ms a call)."""

from __future__ import annotations

import asyncio
import socket

import pytest

from mmferry.server.run import listening_socket


@pytest.mark.parametrize("host", ["127.0.0.1", "::1"])
def test_accepted_connections_have_nagle_off(host: str) -> None:
    if host == "::1" and not socket.has_ipv6:
        pytest.skip("no IPv6 on this host")
    sock = listening_socket(host, 0)
    port = sock.getsockname()[1]

    async def main() -> int:
        accepted: asyncio.Future = asyncio.get_running_loop().create_future()

        def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            raw = writer.get_extra_info("socket")
            accepted.set_result(raw.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        server = await asyncio.start_server(on_connect, sock=sock)
        async with server:
            _, writer = await asyncio.open_connection(host, port)
            nodelay = await asyncio.wait_for(accepted, 10)
            writer.close()
        return nodelay

    assert asyncio.run(main()) != 0
