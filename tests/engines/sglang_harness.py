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
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tests.engines.vllm_harness import Result

ROOT = Path(__file__).resolve().parents[2]
SGLANG_PYTHON = ROOT / ".sglang-venv" / "bin" / "python"
HERE = Path(__file__).resolve().parent
DRIVER = HERE / "sglang_driver.py"
SHIM = HERE / "sglang_shim"
START_TIMEOUT_S = 600
STEP_TIMEOUT_S = 300
NEW_TOKENS = 16
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
class SglangEngine:
    """One `sglang.Engine` in a driver subprocess; `generate` sends requests, waits for the
    answer."""

    proc: subprocess.Popen
    workdir: Path
    start_s: float = 0.0
    lines: list[str] = field(default_factory=list)
    _answers: list[str] = field(default_factory=list)
    _cond: threading.Condition = field(default_factory=threading.Condition)
    _jobs: int = 0

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
        threading.Thread(target=engine._read, daemon=True).start()
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

    def _read(self) -> None:
        for line in self.proc.stdout:
            with self._cond:
                if line.startswith(("[{", "[]", "{")):
                    self._answers.append(line)
                else:
                    self.lines.append(line)
                self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    def _wait(self, ready, timeout: float) -> None:
        with self._cond:
            ok = self._cond.wait_for(lambda: ready() or self.proc.poll() is not None, timeout)
            if not ready():
                tail = "".join(self.lines[-60:])
                why = "exited" if ok else "timed out"
                raise RuntimeError(f"SGLang driver {why}:\n{tail}")

    def generate(self, requests: list[dict[str, Any]], tokens: int = NEW_TOKENS) -> Any:
        """Results in request order, or {"error": ..., "request": k, "alive": bool}."""
        self._jobs += 1
        path = self.workdir / f"job{self._jobs}.pt"
        torch.save({"requests": requests, "tokens": tokens}, path)
        n = len(self._answers)
        self.proc.stdin.write(f"{path}\n")
        self.proc.stdin.flush()
        self._wait(lambda: len(self._answers) > n, STEP_TIMEOUT_S)
        answer = json.loads(self._answers[n])
        if isinstance(answer, dict):
            return answer
        return [Result(a["tokens"], [[tuple(p) for p in s] for s in a["top5"]]) for a in answer]

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
