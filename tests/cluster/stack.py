"""Starting mmferry's servers inside a cluster's hosts: each binds its host's address only,
and is reached from other hosts (or the test, in the root namespace) over the links."""

from __future__ import annotations

import json
import os
import subprocess
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


def vllm(net: Net, host: Host, model: Path, connector: dict, timeout_s: float = 600) -> str:
    """vLLM's OpenAI server inside `host` (on its address only), with `MmferryECConnector`
    (`connector`: its extra config) and `--enable-mm-embeds`; waits for its /health and returns
    its URL. Output to WORK/vllm-HOST.log."""
    from tests.engines import vllm_harness
    from tests.proxy.procs import TEMPLATE
    from tests.store import cluster as local

    template = net.work / "template.jinja"
    template.write_text(TEMPLATE)
    config = {
        "ec_connector": "MmferryECConnector",
        "ec_connector_module_path": "mmferry.engines.vllm_connector",
        "ec_role": "ec_consumer",
        "ec_connector_extra_config": connector,
    }
    port = 8000
    cmd = [str(vllm_harness.VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server"]
    cmd += ["--model", str(model), "--host", host.addr, "--port", str(port)]
    cmd += ["--enable-mm-embeds", "--dtype", "float32", "--enforce-eager", "--seed", "0"]
    cmd += ["--max-model-len", "2048", "--max-num-seqs", "16", "--chat-template", str(template)]
    cmd += ["--limit-mm-per-prompt", json.dumps({"image": 4, "video": 1})]
    cmd += ["--ec-transfer-config", json.dumps(config)]
    # NOTE: vLLM's CPU default: the engine core in a process of its own and the model's worker
    # in another (as tensor parallel runs it), so the connector's scheduler and worker each
    # learn apart what they can reach.
    env = {**vllm_harness.vllm_env(False), **local.env(), "MC_TCP_BIND_ADDRESS": host.addr}
    log = net.work / f"vllm-{host.name}.log"
    proc = host.popen(cmd, env=env, log=log, cwd=net.work)
    url = f"http://{host.addr}:{port}"
    return healthy("vLLM", url, proc, log, timeout_s)


def healthy(name: str, url: str, proc: subprocess.Popen, log: Path, timeout_s: float) -> str:
    """`url` once its /health answers 200; RuntimeError with the log's end if `proc` exits or
    `timeout_s` passes first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited:\n{log.read_text()[-4000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return url
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError(f"{name} did not start:\n{log.read_text()[-4000:]}")
