"""A real Mooncake Store on loopback TCP for the store tests: a master with its metadata server
and a holder process lending the store its memory (so entries outlive the processes that wrote
them). The Mooncake wheel and libibverbs come from `make mooncake-venv`."""

from __future__ import annotations

import ctypes
import os
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from mmferry.testing.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
MOONCAKE = ROOT / ".mooncake-venv"
SITE = MOONCAKE / "site"
LIBS = [MOONCAKE / "root/usr/lib/x86_64-linux-gnu", MOONCAKE / "root/lib/x86_64-linux-gnu"]
BIN = SITE / "mooncake"


def installed() -> bool:
    return (MOONCAKE / ".installed").is_file()


def env() -> dict[str, str]:
    """The environment a process needs to run Mooncake here (loopback, the unpacked libs, the
    wheel's folder on PYTHONPATH after the checkout)."""
    lib = ":".join(str(p) for p in LIBS)
    old = os.environ.get("LD_LIBRARY_PATH")
    return {
        "MC_TCP_BIND_ADDRESS": "127.0.0.1",
        "LD_LIBRARY_PATH": f"{lib}:{old}" if old else lib,
        "PYTHONPATH": f"{ROOT}:{SITE}",
    }


def import_here() -> None:
    """Make `mooncake.store` importable in this (already started) process: the loader reads
    LD_LIBRARY_PATH only at start, so the libraries are loaded by path first."""
    os.environ["MC_TCP_BIND_ADDRESS"] = "127.0.0.1"
    for name in ("libnl-3.so.200", "libnl-route-3.so.200", "libibverbs.so.1"):
        path = next(p / name for p in LIBS if (p / name).exists())
        ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
    if str(SITE) not in sys.path:
        sys.path.append(str(SITE))


def _wait_port(port: int, proc: subprocess.Popen, log: Path, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[0]} exited:\n{log.read_text()[-3000:]}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise RuntimeError(f"nothing listens on {port}:\n{log.read_text()[-3000:]}")


@dataclass
class Cluster:
    work: Path
    segment: str = "256 MB"
    rpc: int = field(default_factory=free_port)
    http: int = field(default_factory=free_port)
    metrics: int = field(default_factory=free_port)
    holder_port: int = field(default_factory=free_port)
    # Extra flags for mooncake_master (a test that needs a longer lease than its 10 s default).
    master_args: tuple[str, ...] = ()
    master: subprocess.Popen | None = None
    holder: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"mooncake://127.0.0.1:{self.rpc}?metadata={self.metadata}&retry_s=1"

    @property
    def metadata(self) -> str:
        return f"http://127.0.0.1:{self.http}/metadata"

    def _spawn(self, name: str, args: list[str]) -> subprocess.Popen:
        log = self.work / f"{name}.log"
        full = {**os.environ, **env()}
        with open(log, "ab") as out:
            return subprocess.Popen(
                [str(BIN / name), *args], stdout=out, stderr=subprocess.STDOUT, env=full
            )

    def start_master(self) -> None:
        self.master = self._spawn(
            "mooncake_master",
            [
                f"--rpc_port={self.rpc}",
                "--rpc_address=127.0.0.1",
                "--enable_http_metadata_server=true",
                "--http_metadata_server_host=127.0.0.1",
                f"--http_metadata_server_port={self.http}",
                f"--metrics_port={self.metrics}",
                "--metrics_host=127.0.0.1",
                *self.master_args,
            ],
        )
        _wait_port(self.rpc, self.master, self.work / "mooncake_master.log")
        _wait_port(self.http, self.master, self.work / "mooncake_master.log")

    def start(self) -> Cluster:
        for attempt in range(3):
            try:
                self._start()
                return self
            except BaseException as e:
                self.stop()  # a holder that failed leaves no master behind
                # A port free when chosen can be taken before the server binds it (another
                # process's outgoing connection): the first start may pick fresh ones; a
                # restart keeps its ports, which the clients already know.
                taken = isinstance(e, RuntimeError) and "Address already in use" in str(e)
                if not taken or attempt == 2:
                    raise
                self.rpc, self.http, self.metrics, self.holder_port = (
                    free_port() for _ in range(4)
                )
        raise AssertionError("not reached: the last attempt returns or raises")

    def _start(self) -> None:
        self.start_master()
        self.holder = self._spawn(
            "mooncake_client",
            [
                "--host=127.0.0.1",
                f"--global_segment_size={self.segment}",
                f"--master_server_address=127.0.0.1:{self.rpc}",
                f"--metadata_server={self.metadata}",
                "--protocol=tcp",
                f"--port={self.holder_port}",
            ],
        )
        _wait_port(self.holder_port, self.holder, self.work / "mooncake_client.log")

    def stop_master(self) -> None:
        _end(self.master)
        self.master = None

    def stop(self) -> None:
        _end(self.holder)
        _end(self.master)
        self.holder = self.master = None


def _end(proc: subprocess.Popen | None) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.kill()
    proc.wait(timeout=30)


@dataclass
class Service:
    """A real `mmferry serve` process with Mooncake importable."""

    proc: subprocess.Popen
    url: str = ""
    lines: list[str] = field(default_factory=list)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def start_service(args: list[str]) -> Service:
    """`mmferry serve --port 0 ARGS`; waits for the port it prints."""
    cmd = [sys.executable, "-m", "mmferry", "serve", "--port", "0", *args]
    full = {k: v for k, v in os.environ.items() if k != "MMFERRY_API_KEY"}
    full.update(env())
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=full
    )
    service = Service(proc)
    ready = threading.Event()

    def read() -> None:
        for line in proc.stdout:
            service.lines.append(line)
            # NOTE: Mooncake's own log says "listening on" too.
            if line.startswith("mmferry serve: listening on "):
                service.url = line.split("listening on ")[1].strip()
                ready.set()
        ready.set()

    threading.Thread(target=read, daemon=True).start()
    if not ready.wait(300) or not service.url:
        service.stop()
        raise RuntimeError("mmferry serve did not start:\n" + "".join(service.lines))
    return service
