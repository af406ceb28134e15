"""The real processes of the proxy tests, on loopback: vLLM's OpenAI server (from vLLM's own
environment), `mmferry serve` encoders and `mmferry proxy` front ends."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from mmferry.testing.ports import free_port
from tests.engines.sglang_harness import (
    VLLM_LEFTOVERS,
    ShmLeftovers,
    descendants,
    shm_names,
)
from tests.engines.vllm_harness import VLLM_PYTHON, vllm_env

ROOT = Path(__file__).resolve().parents[2]
# The chat template joins the content as vLLM renders it (text, and one vision placeholder per
# media part), so pixels and embeddings get the same prompt.
TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
START_TIMEOUT_S = 600


def stop(proc: subprocess.Popen | None) -> None:
    """SIGTERM, then SIGKILL after 60 s; waits for the exit."""
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@dataclass
class VllmServer:
    """`python -m vllm.entrypoints.openai.api_server` (the CPU wheel's `vllm serve` stops on its
    package name) serving a tiny checkpoint, with `--enable-mm-embeds` and, when given, the
    encoder-cache connector toward mmferry encoders (or `ec_transfer`, a whole
    --ec-transfer-config; `extra`: more arguments)."""

    model: Path
    work: Path
    connector: dict | None = None
    ec_transfer: dict | None = None
    extra: list[str] = field(default_factory=list)
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen | None = None
    shm: ShmLeftovers | None = None
    # None: the checkpoint's own chat template (which writes the model's image placeholder).
    template: str | None = TEMPLATE

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log(self) -> Path:
        return self.work / "vllm.log"

    def start(self) -> VllmServer:
        before = shm_names()
        cmd = [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server"]
        cmd += ["--model", str(self.model), "--host", "127.0.0.1", "--port", str(self.port)]
        cmd += ["--enable-mm-embeds", "--dtype", "float32", "--enforce-eager", "--seed", "0"]
        cmd += ["--max-model-len", "2048", "--max-num-seqs", "16"]
        cmd += ["--limit-mm-per-prompt", json.dumps({"image": 4, "video": 1})]
        if self.template is not None:
            template = self.work / "template.jinja"
            template.write_text(self.template)
            cmd += ["--chat-template", str(template)]
        if self.connector is not None:
            config = {
                "ec_connector": "MmferryECConnector",
                "ec_connector_module_path": "mmferry.engines.vllm_connector",
                "ec_role": "ec_consumer",
                "ec_connector_extra_config": self.connector,
            }
            cmd += ["--ec-transfer-config", json.dumps(config)]
        if self.ec_transfer is not None:
            cmd += ["--ec-transfer-config", json.dumps(self.ec_transfer)]
        cmd += self.extra
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(
                cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=vllm_env(False),
                cwd=self.work,
            )
        self.shm = ShmLeftovers(self.proc.pid, before, kinds=VLLM_LEFTOVERS, tree=True)
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if self.proc.poll() is not None:
                self.stop()
                raise RuntimeError("vLLM exited:\n" + self.log.read_text()[-4000:])
            try:
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                    self.shm.note()
                    return self
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("vLLM did not come up:\n" + self.log.read_text()[-4000:])
            time.sleep(1)

    def stop(self) -> None:
        """Stopped with every process under it, and what they made in /dev/shm removed (a
        force-killed engine core unlinks none of its segments)."""
        if self.proc is None:
            return
        if self.shm is not None:
            self.shm.note()
        # NOTE: taken before the server stops: its children then belong to init.
        tree = descendants(self.proc.pid)
        stop(self.proc)
        for pid in tree:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while any(Path(f"/proc/{pid}").exists() for pid in tree) and time.monotonic() < deadline:
            time.sleep(0.1)
        if self.shm is not None:
            self.shm.remove()

    def metric(self, name: str, **labels: str) -> float:
        """The sum of a vLLM metric's samples whose labels include `labels`."""
        return scrape(self.url, name, **labels)


def cpu_seconds(pid: int, named: str | None = None) -> float:
    """CPU time (user and system) used so far by `pid` and every process under it (/proc),
    or only by those of them whose command name is `named`."""
    parents: dict[int, int] = {}
    ticks: dict[int, int] = {}
    names: dict[int, str] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
        except OSError:
            continue  # gone meanwhile
        fields = stat[stat.rindex(")") + 2 :].split()
        names[int(name)] = stat[stat.index("(") + 1 : stat.rindex(")")]
        parents[int(name)] = int(fields[1])
        ticks[int(name)] = int(fields[11]) + int(fields[12])  # utime, stime
    tree, grew = {pid}, True
    while grew:
        below = {p for p, parent in parents.items() if parent in tree} - tree
        tree |= below
        grew = bool(below)
    tree = {p for p in tree if named is None or names.get(p) == named}
    return sum(ticks.get(p, 0) for p in tree) / os.sysconf("SC_CLK_TCK")


def send_json(handler: Any, body: bytes) -> None:
    """A 200 JSON answer from a stdlib handler (the tests' recording upstreams)."""
    handler.send_response(200)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body)


def scrape(url: str, name: str, **labels: str) -> float:
    """The sum of the Prometheus samples `name{...}` at `url`/metrics matching `labels`."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name) or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        metric, _, rest = head.partition("{")
        if metric != name:
            continue
        if all(f'{k}="{v}"' in rest for k, v in labels.items()):
            total += float(value)
    return total


@dataclass
class Proc:
    """An `mmferry` command (or `python -m module`) that prints "listening on URL" once it
    serves."""

    args: list[str]
    env: dict[str, str] = field(default_factory=dict)
    module: str = "mmferry"
    proc: subprocess.Popen | None = None
    url: str = ""
    lines: list[str] = field(default_factory=list)
    root: Path = ROOT  # the checkout whose code runs (a benchmark's baseline: another one)

    def start(self, timeout_s: float = 300) -> Proc:
        env = {k: v for k, v in os.environ.items() if not k.startswith("MMFERRY_")}
        # NOTE: PYTHONSAFEPATH: `python -m` puts the working directory ahead of PYTHONPATH,
        # and a baseline checkout's process started from this one would run this one's code.
        env.update(PYTHONPATH=str(self.root), PYTHONSAFEPATH="1", **self.env)
        self.lines = []
        self.proc = subprocess.Popen(
            [sys.executable, "-m", self.module, *self.args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        ready = threading.Event()

        def read() -> None:
            for line in self.proc.stdout:
                self.lines.append(line)
                if "listening on " in line:
                    self.url = line.split("listening on ")[1].strip()
                    ready.set()
            ready.set()  # the output ended: the process is gone

        threading.Thread(target=read, daemon=True).start()
        if not ready.wait(timeout_s) or self.proc.poll() is not None:
            self.stop()
            raise RuntimeError(f"mmferry {self.args[0]} did not start:\n" + "".join(self.lines))
        return self

    def stop(self) -> None:
        stop(self.proc)

    def kill(self) -> None:
        """SIGKILL, as a crash."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def encoder(model: Path, port: int | None = None) -> Proc:
    """An `mmferry serve` on a fixed port (a restart comes back at the same URL)."""
    port = port or free_port()
    args = ["serve", "--model", str(model), "--port", str(port)]
    return Proc([*args, "--shm-mib", "16", "--cache-mib", "64", "--preprocess-threads", "1"])


def proxy(llm: str, encoders: list[str], mode: str, *extra: str, **env: str) -> Proc:
    """An `mmferry proxy` on a free port."""
    args = ["proxy", "--llm", llm, "--mode", mode, "--dtype", "float32", "--port", "0"]
    for url in encoders:
        args += ["--encoder", url]
    return Proc([*args, *extra], env=env)


@dataclass
class Received:
    """One request as it reached the recording engine: method, path as sent, body bytes."""

    method: str
    path: str
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


@contextlib.contextmanager
def loopback_server(handler: type) -> Iterator[str]:
    """A stdlib HTTP server with `handler` on a free loopback port, in a thread; yields
    "127.0.0.1:<port>"."""
    from http.server import ThreadingHTTPServer

    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


class RecordingEngine:
    """The engine's place behind a proxy: a stdlib HTTP server that keeps every request it gets
    (any method, any path) and answers `answer` (JSON, 200), or 500 to the chat requests while
    `fail_chats` is above 0 (counting down); a chat request is answered `delay_s` after it
    arrived (an engine still planning it)."""

    def __init__(self, answer: Any = None, keep_alive: bool = False) -> None:
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.seen: list[Received] = []
        self.fail_chats = 0
        self.delay_s = 0.0
        self.answer = json.dumps(answer if answer is not None else {"id": "recorded"}).encode()
        engine = self

        class Handler(BaseHTTPRequestHandler):
            # keep_alive: connections kept open between requests, as vLLM's server keeps them
            protocol_version = "HTTP/1.1" if keep_alive else "HTTP/1.0"
            # The headers and the body are two writes: without this, Nagle's algorithm holds
            # the body for the client's delayed ACK (40 ms) on a kept-open connection.
            disable_nagle_algorithm = keep_alive

            def handle_any(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                engine.seen.append(Received(self.command, self.path, body))
                if self.path.endswith("/chat/completions"):
                    time.sleep(engine.delay_s)
                if engine.fail_chats > 0 and self.path.endswith("/chat/completions"):
                    engine.fail_chats -= 1
                    self.send_response(500)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                send_json(self, engine.answer)

            do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = handle_any  # noqa: N815

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def take(self) -> list[Received]:
        """What arrived since the last call."""
        seen, self.seen = self.seen, []
        return seen

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
