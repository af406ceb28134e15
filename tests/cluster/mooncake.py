"""A Mooncake master (with its HTTP metadata server) and a holder lending the store its memory,
both on host S's address, and the environment a process on another host needs to use them
(Mooncake's own transfer engine binds the host's address, never loopback)."""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass

from mmferry.testing.cluster import Host, Net
from tests.store import cluster as local

RPC, HTTP, METRICS, HOLDER = 50051, 8080, 9003, 17812


def env(host: Host) -> dict[str, str]:
    return {**local.env(), "MC_TCP_BIND_ADDRESS": host.addr}


def _wait(host: Host, port: int, proc, log, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[-1]} exited:\n{log.read_text()[-3000:]}")
        with socket.socket() as s:
            s.settimeout(1)
            if s.connect_ex((host.addr, port)) == 0:
                return
        time.sleep(0.2)
    raise RuntimeError(f"nothing listens on {host.addr}:{port}:\n{log.read_text()[-3000:]}")


@dataclass
class Store:
    host: Host
    segment: str = "256 MB"

    @property
    def url(self) -> str:
        return f"mooncake://{self.host.addr}:{RPC}?metadata={self.metadata}&retry_s=1"

    @property
    def metadata(self) -> str:
        return f"http://{self.host.addr}:{HTTP}/metadata"

    def start(self, net: Net) -> Store:
        h = self.host
        full = {**local.env(), "MC_TCP_BIND_ADDRESS": h.addr, "PATH": "/usr/bin:/bin"}
        log = net.work / "mooncake_master.log"
        master = h.popen(
            [
                str(local.BIN / "mooncake_master"),
                f"--rpc_port={RPC}",
                f"--rpc_address={h.addr}",
                "--enable_http_metadata_server=true",
                f"--http_metadata_server_host={h.addr}",
                f"--http_metadata_server_port={HTTP}",
                f"--metrics_port={METRICS}",
                f"--metrics_host={h.addr}",
            ],
            env=full,
            log=log,
        )
        _wait(h, RPC, master, log)
        _wait(h, HTTP, master, log)
        log = net.work / "mooncake_client.log"
        holder = h.popen(
            [
                str(local.BIN / "mooncake_client"),
                f"--host={h.addr}",
                f"--global_segment_size={self.segment}",
                f"--master_server_address={h.addr}:{RPC}",
                f"--metadata_server={self.metadata}",
                "--protocol=tcp",
                f"--port={HOLDER}",
            ],
            env=full,
            log=log,
        )
        _wait(h, HOLDER, holder, log)
        return self
