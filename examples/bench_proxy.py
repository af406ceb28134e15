"""vLLM's own serving benchmark against a plain vLLM and `mmferry proxy`, rounds interleaved.

    python examples/bench_proxy.py --vllm-python .vllm-venv/bin/python --model /ckpt \
        --target plain=http://127.0.0.1:8000 --target proxy=http://127.0.0.1:8080 \
        --rounds 5 -- --dataset-name random --random-input-len 64 --random-output-len 8 \
        --num-prompts 40 --request-rate 4

Each round runs `vllm.benchmarks.serve` (OpenAI chat backend; the CPU wheel's `vllm bench`
console script stops on its package name, the module does not) once per target, in turn, and
the median and spread over the rounds of TTFT p50 and p99 and of request throughput are printed
per target. Arguments after `--` go to vLLM's benchmark as they are (dataset, rate, ...).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
from pathlib import Path

RUNNER = (
    "import sys\n"
    "from vllm.benchmarks.serve import add_cli_args, main\n"
    "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
    "p = FlexibleArgumentParser()\n"
    "add_cli_args(p)\n"
    "main(p.parse_args(sys.argv[1:]))\n"
)
FIGURES = (("median_ttft_ms", "TTFT p50 ms"), ("p99_ttft_ms", "TTFT p99 ms"))


def one_round(python: str, model: str, url: str, extra: list[str], out: Path) -> dict:
    cmd = [python, "-c", RUNNER, "--backend", "openai-chat", "--base-url", url]
    cmd += ["--endpoint", "/v1/chat/completions", "--model", model, "--seed", "0"]
    cmd += ["--percentile-metrics", "ttft", "--metric-percentiles", "50,99"]
    cmd += ["--save-result", "--result-dir", str(out.parent), "--result-filename", out.name]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    subprocess.run([*cmd, *extra], check=True, capture_output=True, env=env)
    return json.loads(out.read_text())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--vllm-python", required=True, help="the python of vLLM's environment")
    p.add_argument("--model", required=True, help="the served model (its path or name)")
    p.add_argument("--target", action="append", required=True, metavar="NAME=URL")
    p.add_argument("--rounds", type=int, default=5)
    args, extra = p.parse_known_args()
    extra = [a for a in extra if a != "--"]
    targets = dict(t.split("=", 1) for t in args.target)
    runs: dict[str, list[dict]] = {name: [] for name in targets}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for name, url in targets.items():
                out = Path(tmp) / f"{name}-{r}.json"
                runs[name].append(one_round(args.vllm_python, args.model, url, extra, out))
    for name, results in runs.items():
        cells = []
        for key, label in (*FIGURES, ("request_throughput", "req/s")):
            values = [res[key] for res in results]
            mid = statistics.median(values)
            cells.append(f"{label} {mid:.1f} ({min(values):.1f}-{max(values):.1f})")
        print(f"{name:<8} " + " | ".join(cells) + f"  over {len(results)} rounds")


if __name__ == "__main__":
    main()
