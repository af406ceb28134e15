"""A Mooncake master (with its HTTP metadata server) and a holder lending the store its memory,
both on host S's address, and the environment a process on another host needs to use them
(Mooncake's own transfer engine binds the host's address, never loopback).

The master's admin port answers which segments are mounted (`/get_all_segments`: the holder's;
a client lending no memory, as `serve --store` and vLLM's connector, mounts none) and which keys
it holds (`/get_all_keys`). At the run's end, once every other process has ended, the master is
asked until neither lists anything of the run: a holder that ended without unmounting (killed,
as here) is dropped by the master after `CLIENT_TTL_S` without a heartbeat, its keys with it;
one still alive somewhere (a process that outlived its run) would keep its segment listed."""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass

import httpx

from mmferry.testing.cluster import Host, Net
from tests.store import cluster as local

RPC, HTTP, METRICS, HOLDER = 50051, 8080, 9003, 17812
CLIENT_TTL_S = 10  # the master drops a client (and its segments) silent this long


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

    def _admin(self, path: str) -> list[str]:
        r = httpx.get(f"http://{self.host.addr}:{METRICS}/{path}", timeout=5)
        r.raise_for_status()
        return r.text.split()

    def segments(self) -> list[str]:
        """The segments mounted in the store now, as its master lists them."""
        return self._admin("get_all_segments")

    def keys(self) -> list[str]:
        """The keys in the store now, as its master lists them."""
        return self._admin("get_all_keys")

    def held(self, timeout: float = CLIENT_TTL_S + 10) -> list[str]:
        """Once the run's other processes have ended: the segments and keys the master still
        lists after `timeout` (none, unless a holder of the run lives on)."""
        deadline = time.monotonic() + timeout
        while True:
            left = [f"Mooncake segment {s}" for s in self.segments()]
            left += [f"Mooncake key {k}" for k in self.keys()]
            if not left or time.monotonic() > deadline:
                return left
            time.sleep(0.5)

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
                f"--client_ttl={CLIENT_TTL_S}",
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
        # The holder's segment listed: the master's answer at the end is worth something.
        deadline = time.monotonic() + 30
        while not any(s.startswith(f"{h.addr}:") for s in self.segments()):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the master lists no segment of {h.addr}: {self.segments()}")
            time.sleep(0.2)
        net.check_before_stop(self.held, keep=[master])
        return self
