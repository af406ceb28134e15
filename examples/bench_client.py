"""vLLM's serving benchmark (`vllm.benchmarks.serve`, the module: the CPU wheel's `vllm bench`
console script stops on its package name) as one long-lived client process in vLLM's
environment, run once per command it reads, so a run costs no import of vLLM.

random-mm draws every image fresh, so nothing would repeat: each run wraps its image generator
so that with probability `share` (drawn from the dataset's own seeded generator) an image is
one of `pool` fixed images, the same in every run, else vLLM's own fresh one.
"""

from __future__ import annotations

import json
import subprocess
from collections import Counter
from pathlib import Path
from typing import Any

from tests.engines.vllm_harness import VLLM_PYTHON, vllm_env

# Runs in vLLM's environment; one JSON line in ([share, pool], argv) -> one line "done" out.
RUNNER = """\
import json, sys
import numpy as np
from PIL import Image
from vllm.benchmarks.datasets.datasets import RandomMultiModalDataset
from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser

fresh = RandomMultiModalDataset.generate_synthetic_image
for line in sys.stdin:
    (share, pool), argv = json.loads(line)

    def image(self, width, height, share=share, pool=pool):
        if share > 0 and self._rng.random() < share:
            rng = np.random.default_rng([int(self._rng.integers(pool)), height, width])
            return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))
        return fresh(self, width, height)

    RandomMultiModalDataset.generate_synthetic_image = image
    p = FlexibleArgumentParser()
    add_cli_args(p)
    try:
        main(p.parse_args(argv))
        print("\\nbench-client: done", flush=True)
    except BaseException as e:
        print(f"\\nbench-client: failed {type(e).__name__}: {e}", flush=True)
"""


class Client:
    """The benchmark client; `start` a run, `finish` waits for its saved result."""

    def __init__(self, model: Path) -> None:
        self.model = model
        self.proc = subprocess.Popen(
            [str(VLLM_PYTHON), "-c", RUNNER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=vllm_env(False),
        )
        self.out: Path | None = None

    def start(self, url: str, seed: int, args: list[str], repeat: list[float], out: Path) -> None:
        cmd = ["--backend", "openai-chat", "--base-url", url, "--endpoint", "/v1/chat/completions"]
        cmd += ["--model", str(self.model), "--seed", str(seed), "--disable-tqdm"]
        # The processes are up (checked before); the ready check would send one request more.
        cmd += ["--ready-check-timeout-sec", "0"]
        cmd += ["--percentile-metrics", "ttft", "--metric-percentiles", "50,99"]
        cmd += ["--save-result", "--save-detailed"]
        cmd += ["--result-dir", str(out.parent), "--result-filename", out.name]
        self.out = out
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps([repeat, [*cmd, *args]]) + "\n")
        self.proc.stdin.flush()

    def finish(self, allow_failed: bool = False) -> dict[str, Any]:
        """The run's saved result. A failed request stops the benchmark (with the errors vLLM's
        client recorded) unless `allow_failed`."""
        assert self.proc.stdout is not None and self.out is not None
        lines = []
        for line in self.proc.stdout:
            lines.append(line)
            if line.startswith("bench-client: "):
                break
        if not lines or not lines[-1].startswith("bench-client: done"):
            raise RuntimeError("vLLM's benchmark failed:\n" + "".join(lines[-40:]))
        result = json.loads(self.out.read_text())
        if result["failed"] and not allow_failed:
            errors = Counter(e for e in result["errors"] if e).most_common(3)
            raise RuntimeError(f"{result['failed']} requests failed: {errors}")
        return result

    def run(self, url: str, seed: int, args: list[str], repeat: list[float], out: Path) -> dict:
        self.start(url, seed, args, repeat, out)
        return self.finish()

    def stop(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
