"""`examples/bench_proxy.py` run for real, one short round, so the one command keeps working: it
starts its own processes (a plain vLLM, two encoders, a vLLM with the connector, the proxy),
checks both set-ups give the same tokens, runs vLLM's benchmark on each and reports."""

from __future__ import annotations

import json
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
    cmd += ["--num-prompts", str(PROMPTS), "--text-prompts", str(PROMPTS), "--warmup-prompts", "0"]
    cmd += ["--request-rate", "100", "--text-rate", "100", "--images", "1", "--pool", "2"]
    cmd += ["--json", str(out), "--logs", str(tmp_path / "logs")]
    t0 = time.monotonic()
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=1700, cwd=ROOT)
    took = time.monotonic() - t0
    print(f"examples/bench_proxy.py, one short round: {took:.0f} s")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "shared memory left behind" not in run.stderr
    result = json.loads(out.read_text())
    check = result["check"]
    assert check["images, plain vLLM"] == check["images, through the proxy"]
    assert check["images, plain vLLM"] != check["other images, plain vLLM"]
    for part in ("multimodal", "text"):
        for name, rounds in result[part]["runs"].items():
            assert [r["completed"] for r in rounds] == [PROMPTS], (part, name)
            assert all(r["median_ttft_ms"] > 0 for r in rounds), (part, name)
    (cache,) = result["multimodal"]["cache"]
    assert cache["hits"] + cache["misses"] > 0  # the images went through the encoders
    assert "proxy less plain, TTFT p50 per round" in run.stdout
