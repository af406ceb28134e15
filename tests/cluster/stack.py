"""Starting mmferry's servers inside a cluster's hosts: each binds its host's address only,
and is reached from other hosts (or the test, in the root namespace) over the links."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import httpx

from mmferry.testing.cluster import Host, Net

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).parent


def env(**extra: str) -> dict[str, str]:
    full = {k: v for k, v in os.environ.items() if not k.startswith("MMFERRY_")}
    full["PYTHONPATH"] = str(ROOT)
    full.update(extra)
    return full


def start(
    net: Net,
    host: Host,
    name: str,
    args: list[str],
    *,
    extra_env: dict | None = None,
    python: str = sys.executable,
    timeout_s: float = 300,
) -> str:
    """`python ARGS` inside `host`, output to WORK/NAME.log; waits for its "listening on URL"
    line and returns URL (which must be on the host's own address)."""
    log = net.work / f"{name}.log"
    start_at = log.stat().st_size if log.exists() else 0  # a restart appends to the log
    proc = host.popen([python, *args], env=env(**(extra_env or {})), log=log)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = log.read_bytes()[start_at:].decode(errors="replace") if log.exists() else ""
        for line in text.splitlines():
            if "listening on " in line and line.split("listening on ")[1].startswith("http"):
                url = line.split("listening on ")[1].strip()
                assert f"//{host.addr}:" in url, f"{name} bound {url}, not {host.addr}"
                return url
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited:\n{text[-4000:]}")
        time.sleep(0.2)
    raise RuntimeError(f"{name} did not start:\n{log.read_text()[-4000:]}")


def encoder(net: Net, host: Host, model: Path, *extra: str) -> str:
    args = ["-m", "mmferry", "serve", "--model", str(model), "--host", host.addr, "--port", "0"]
    args += ["--shm-mib", "0", "--cache-mib", "64", "--preprocess-threads", "1", *extra]
    return start(net, host, f"serve-{host.name}", args)


def engine(net: Net, host: Host, port: int = 8000) -> tuple[str, Path]:
    record = net.work / f"engine-{host.name}.jsonl"
    url = start(
        net,
        host,
        f"engine-{host.name}",
        [str(HERE / "engine.py"), host.addr, str(port), str(record)],
    )
    return url, record


def scrape(url: str, name: str) -> float:
    """The sum of a Prometheus metric's samples at URL/metrics."""
    total = 0.0
    for line in httpx.get(f"{url}/metrics", timeout=5).text.splitlines():
        if line.startswith(name) and not line.startswith("#"):
            head, _, value = line.rpartition(" ")
            if head.partition("{")[0] == name:
                total += float(value)
    return total
