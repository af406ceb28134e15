"""A real `mmferry serve` process on loopback for the engine tests (a fixed port, so a restart
comes back where the connector points)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Service:
    model: Path
    port: int
    proc: subprocess.Popen | None = None
    lines: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    args: list[str] = field(default_factory=list)  # more `mmferry serve` options

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> Service:
        cmd = [sys.executable, "-m", "mmferry", "serve", "--model", str(self.model)]
        cmd += ["--port", str(self.port), "--shm-mib", "16", "--cache-mib", "64", *self.args]
        env = {k: v for k, v in os.environ.items() if k != "MMFERRY_API_KEY"}
        env.update(PYTHONPATH=str(ROOT), **self.env)
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
        )
        ready, listening = threading.Event(), threading.Event()

        def read() -> None:
            for line in self.proc.stdout:
                self.lines.append(line)
                if "listening on " in line:
                    listening.set()
                    ready.set()
            ready.set()  # the output ended: the process is gone (a port taken, a bad model)

        threading.Thread(target=read, daemon=True).start()
        if not ready.wait(120) or not listening.is_set():
            self.stop()
            raise RuntimeError("mmferry serve did not start:\n" + "".join(self.lines))
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
