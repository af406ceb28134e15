"""A real `mmferry serve` subprocess on 127.0.0.1 (free port) with a one-layer random tower."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

ROOT = Path(__file__).resolve().parents[2]
IMAGE_MAX_PIXELS = 65536  # qwen3-vl's minimum: every test image becomes 64 tokens or so
DEPTH = 1
API_KEY = "test-key-0123456789"


def png(width: int, height: int, seed: int) -> bytes:
    """A seeded noise image as PNG bytes."""
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


@dataclass
class Server:
    proc: subprocess.Popen
    url: str
    lines: list[str] = field(default_factory=list)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            return self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


def start_server(args: list[str], *, env: dict[str, str] | None = None) -> Server:
    """Start `mmferry serve --port 0 ...` and wait for the port it prints."""
    cmd = [sys.executable, "-m", "mmferry", "serve", "--port", "0", "--depth", str(DEPTH)]
    cmd += ["--max-pixels", str(IMAGE_MAX_PIXELS), *args]
    full_env = {k: v for k, v in os.environ.items() if k != "MMFERRY_API_KEY"}
    full_env.update(PYTHONPATH=str(ROOT), **(env or {}))
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=full_env
    )
    server = Server(proc, "")
    ready = threading.Event()

    def read() -> None:
        for line in proc.stdout:
            server.lines.append(line)
            if "listening on " in line:
                server.url = line.split("listening on ")[1].strip()
                ready.set()
        ready.set()

    threading.Thread(target=read, daemon=True).start()
    if not ready.wait(300) or not server.url:
        server.stop()
        raise RuntimeError("mmferry serve did not start:\n" + "".join(server.lines))
    return server


@pytest.fixture(scope="session")
def media_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("media")
    for i, (w, h) in enumerate([(64, 64), (96, 48), (40, 72)]):
        (d / f"img{i}.png").write_bytes(png(w, h, seed=i))
    (d / "broken.png").write_bytes(png(64, 64, seed=9)[:60])
    return d


@pytest.fixture(scope="module")
def server(media_dir) -> Iterator[Server]:
    s = start_server(
        [
            "--allow-path",
            str(media_dir),
            "--limit-request-bytes",
            str(2 << 20),
            "--limit-items",
            "5",
            "--limit-pixels",
            str(1_000_000),
            "--shm-mib",
            "16",
        ],
        env={"MMFERRY_API_KEY": API_KEY},
    )
    yield s
    s.stop()
