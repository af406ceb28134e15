"""Drive the installed vLLM from mmferry's test process: a driver subprocess in vLLM's own
environment (`.vllm-venv`, see the Makefile), requests written with `torch.save`, answers read
as JSON. mmferry's side (the embeddings) is computed here; vLLM's side runs only there.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = ROOT / ".vllm-venv" / "bin" / "python"
DRIVER = Path(__file__).resolve().parent / "vllm_driver.py"
START_TIMEOUT_S = 600
STEP_TIMEOUT_S = 300
NEW_TOKENS = 16
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
class Result:
    tokens: list[int]
    top5: list[list[tuple[int, float]]]

    def max_logprob_diff(self, other: Result) -> float:
        """Largest difference of the top-5 logprobs; inf when the top-5 token ids differ."""
        worst = 0.0
        for a, b in zip(self.top5, other.top5, strict=True):
            if [t for t, _ in a] != [t for t, _ in b]:
                return float("inf")
            worst = max(worst, *(abs(x - y) for (_, x), (_, y) in zip(a, b)))
        return worst


@dataclass
class VllmEngine:
    """One `LLM` in a driver subprocess; `generate` sends requests and waits for the answer."""

    proc: subprocess.Popen
    workdir: Path
    lines: list[str] = field(default_factory=list)
    _answers: list[str] = field(default_factory=list)
    _cond: threading.Condition = field(default_factory=threading.Condition)
    _jobs: int = 0

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
        threading.Thread(target=engine._read, daemon=True).start()
        engine._wait(lambda: any("vllm-driver: ready" in x for x in engine.lines), START_TIMEOUT_S)
        return engine

    def _read(self) -> None:
        for line in self.proc.stdout:
            with self._cond:
                if line.startswith(("[", "{")):
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
                tail = "".join(self.lines[-40:])
                why = "exited" if ok else "timed out"
                raise RuntimeError(f"vLLM driver {why}:\n{tail}")

    def generate(self, requests: list[dict[str, Any]], tokens: int = NEW_TOKENS) -> Any:
        """Results in request order, or {"error": ...} when vLLM refused the batch."""
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
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
