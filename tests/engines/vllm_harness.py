"""Drive the installed vLLM from mmferry's test process: a driver subprocess in vLLM's own
environment (`.vllm-venv`, see the Makefile), requests written with `torch.save`, answers read
as JSON. mmferry's side (the embeddings) is computed here; vLLM's side runs only there.
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from tests.engines.driver import DriverEngine

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = ROOT / ".vllm-venv" / "bin" / "python"
DRIVER = Path(__file__).resolve().parent / "vllm_driver.py"
START_TIMEOUT_S = 600
# Quiet, offline, loopback-only vLLM on the CPU with a small KV cache.
VLLM_ENV = {
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "VLLM_HOST_IP": "127.0.0.1",
    "HF_HUB_OFFLINE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}
# Engine options shared by every test engine: float32 so both towers compute alike, no
# torch.compile (a minute per start on two cores), a short context.
ENGINE_OPTIONS: dict[str, Any] = {
    "dtype": "float32",
    "enforce_eager": True,
    "max_model_len": 2048,
    "limit_mm_per_prompt": {"image": 4, "video": 1},
    "enable_mm_embeds": True,
    "seed": 0,
}


def vllm_env(in_process: bool = True) -> dict[str, str]:
    """The environment for a vLLM process; the checkout on PYTHONPATH for the connector."""
    env = {**os.environ, **VLLM_ENV, "PYTHONPATH": str(ROOT)}
    env.pop("VIRTUAL_ENV", None)
    if in_process:
        # The engine core in the driver's own process: starts in seconds, not a minute.
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    return env


@dataclass
class VllmEngine(DriverEngine):
    """One `LLM` in a driver subprocess; `generate` sends requests and waits for the answer."""

    name: ClassVar[str] = "vLLM"

    @classmethod
    def start(cls, model: Path, workdir: Path, *, in_process: bool = True, **options: Any):
        opts = {**ENGINE_OPTIONS, **options}
        proc = subprocess.Popen(
            [str(VLLM_PYTHON), str(DRIVER), str(model), json.dumps(opts)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=vllm_env(in_process),
            cwd=workdir,
        )
        engine = cls(proc, workdir)
        engine._follow()
        engine._wait(lambda: any("vllm-driver: ready" in x for x in engine.lines), START_TIMEOUT_S)
        return engine

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
