"""Drive the installed SGLang from mmferry's test process: a driver subprocess in SGLang's own
environment (`.sglang-venv`, see the Makefile) with its engine on the CPU, requests written
with `torch.save`, answers read as JSON. mmferry's side (the embeddings) is computed here.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from tests.engines.driver import DriverEngine

ROOT = Path(__file__).resolve().parents[2]
SGLANG_PYTHON = ROOT / ".sglang-venv" / "bin" / "python"
HERE = Path(__file__).resolve().parent
DRIVER = HERE / "sglang_driver.py"
SHIM = HERE / "sglang_shim"
START_TIMEOUT_S = 600
# SGLang's engine on the CPU (see sglang_shim/sgl_kernel for the import shim), offline.
SGLANG_ENV = {
    "SGLANG_USE_CPU_ENGINE": "1",
    "HF_HUB_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "PYTHONPATH": str(SHIM),
}
# float32 so both towers compute alike; no CUDA graphs, radix cache or warmup. The KV pool is
# capped by max_total_tokens (a few MB here); SGLang sizes its budget as the memory free after
# loading minus (1 - mem_fraction_static) of the memory free before, so a small fraction fails
# the start whenever other processes on the machine allocate during the load ("Loaded weights
# leave no GPU memory for the KV cache"); half keeps the start independent of them.
ENGINE_OPTIONS: dict[str, Any] = {
    "device": "cpu",
    "attention_backend": "torch_native",
    "disable_cuda_graph": True,
    "disable_radix_cache": True,
    "skip_server_warmup": True,
    "tp_size": 1,
    "mem_fraction_static": 0.5,
    "max_total_tokens": 4096,
    "dtype": "float32",
    "random_seed": 0,
}


def sglang_env(**extra: str) -> dict[str, str]:
    env = {**os.environ, **SGLANG_ENV, **extra}
    env.pop("VIRTUAL_ENV", None)
    return env


@dataclass
class SglangEngine(DriverEngine):
    """One `sglang.Engine` in a driver subprocess; `generate` sends requests, waits for the
    answer."""

    name: ClassVar[str] = "SGLang"
    start_s: float = 0.0

    @classmethod
    def start(cls, model: Path, workdir: Path, env: dict[str, str] | None = None, **options):
        opts = {**ENGINE_OPTIONS, **options}
        proc = subprocess.Popen(
            [str(SGLANG_PYTHON), str(DRIVER), str(model), json.dumps(opts)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=sglang_env(**(env or {})),
            cwd=workdir,
            start_new_session=True,  # stop() can end the scheduler it spawns with it
        )
        engine = cls(proc, workdir)
        engine._follow()
        try:
            engine._wait(lambda: engine._ready() is not None, START_TIMEOUT_S)
        except BaseException:
            engine.stop()
            raise
        engine.start_s = engine._ready()
        return engine

    def _ready(self) -> float | None:
        for line in self.lines:
            m = re.search(r"sglang-driver: ready in ([0-9.]+) s", line)
            if m:
                return float(m.group(1))
        return None

    def stop(self) -> None:
        """Close the driver's stdin (it shuts the engine down), then end its process group."""
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
                self.proc.wait(timeout=60)
            except (subprocess.TimeoutExpired, OSError):
                pass
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, 9)  # the scheduler and detokenizer it spawned
        if self.proc.poll() is None:
            self.proc.wait()
