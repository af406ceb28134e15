"""`examples/bench_proxy.py` run for real, one short round, so the one command keeps working: it
starts its own processes for (a) and (c) (a plain vLLM; two encoders, a vLLM with the connector,
the proxy), checks both set-ups give the same tokens, runs vLLM's benchmark on each, both
workloads at both rates, then text-only directly and through the proxy, and reports; and
`examples/proxy_cpu.py` (the proxy's own CPU a request) for a few requests."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.engines.conftest import needs_vllm

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
PROMPTS = 2


@pytest.mark.timeout(1800)  # two vLLM servers start, one after the other, on a shared machine
def test_one_short_round(tmp_path):
    needs_vllm()
    out = tmp_path / "result.json"
    cmd = [sys.executable, str(ROOT / "examples" / "bench_proxy.py"), "--rounds", "1"]
    cmd += ["--setups", "a,c", "--num-prompts", str(PROMPTS), "--warmup-prompts", "0"]
    cmd += ["--rates", "50,100", "--text", "--text-rate", "100", "--images", "1", "--pool", "2"]
    cmd += ["--breakdown", "0", "--json", str(out), "--logs", str(tmp_path / "logs")]
    t0 = time.monotonic()
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=1700, cwd=ROOT)
    took = time.monotonic() - t0
    print(f"examples/bench_proxy.py, one short round: {took:.0f} s")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "shared memory left behind" not in run.stderr
    result = json.loads(out.read_text())
    check = result["check"]
    assert check["a"] == check["c"]
    assert check["a"] != check["other images"]
    runs = result["multimodal"]["runs"]
    assert len(runs) == 4  # all-distinct and half-repeated, each at both rates
    for work, per in runs.items():
        assert set(per) == {"a", "c"}, work
        for key, rounds in per.items():
            assert [r["completed"] for r in rounds] == [PROMPTS], (work, key)
            assert all(r["median_ttft_ms"] > 0 for r in rounds), (work, key)
    for name, rounds in result["text"].items():
        assert [r["completed"] for r in rounds] == [PROMPTS], name
    # The images went through the encoders: the proxy called them in every run.
    counts = [c for per in result["multimodal"]["counts"].values() for c in per["c"]]
    assert len(counts) == len(runs) and all(c["calls"] > 0 for c in counts), counts
    assert "(c) - (a) TTFT p50" in run.stdout


def test_the_proxy_cpu_example_runs():
    cmd = [sys.executable, str(ROOT / "examples" / "proxy_cpu.py"), "--requests", "5"]
    run = subprocess.run(cmd + ["--warmup", "1"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    cpu = re.search(
        r"this: proxy CPU ms a request ([\d.]+) .* encoder CPU ms a call ([\d.]+) ", run.stdout
    )
    assert cpu is not None, run.stdout
    assert all(float(x) > 0 for x in cpu.groups()), run.stdout
    assert re.search(r"latency p50 [\d.]+ \([\d.]+-[\d.]+\) ms", run.stdout)
    assert re.search(r"the engine directly: latency p50 [\d.]+ ms", run.stdout)
    assert re.search(r"tower [\d.]+ ms, JPEG decode [\d.]+ ms", run.stdout)
