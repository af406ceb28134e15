"""What the vLLM and SGLang harnesses share: an engine in a driver subprocess of its own
environment, fed job files (`torch.save`) on stdin, answering one JSON line per job."""

from __future__ import annotations

import json
import subprocess
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch

STEP_TIMEOUT_S = 300
NEW_TOKENS = 16
# An answer is a JSON list of results or an error object; every other line is the driver's log.
ANSWER_STARTS = ("[{", "[]", "{")


@dataclass
class Result:
    tokens: list[int]
    top5: list[list[tuple[int, float]]]
    finish: str | None = None  # the engine's finish reason ("error": the request failed alone)

    def max_logprob_diff(self, other: Result) -> float:
        """Largest difference of the top-5 logprobs; inf when the top-5 token ids differ."""
        worst = 0.0
        for a, b in zip(self.top5, other.top5, strict=True):
            if [t for t, _ in a] != [t for t, _ in b]:
                return float("inf")
            worst = max(worst, *(abs(x - y) for (_, x), (_, y) in zip(a, b)))
        return worst


@dataclass
class DriverEngine:
    """The driver process, its log lines and its answers; subclasses start it."""

    name: ClassVar[str] = "engine"
    proc: subprocess.Popen
    workdir: Path
    lines: list[str] = field(default_factory=list)
    _answers: list[str] = field(default_factory=list)
    _cond: threading.Condition = field(default_factory=threading.Condition)
    _jobs: int = 0

    def _follow(self) -> None:
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            with self._cond:
                if line.startswith(ANSWER_STARTS):
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
                raise RuntimeError(f"{self.name} driver {why}:\n{tail}")

    def generate(self, requests: list[dict[str, Any]], tokens: int = NEW_TOKENS) -> Any:
        """Results in request order, or the driver's error object ({"error": ...})."""
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
        return [
            Result(a["tokens"], [[tuple(p) for p in s] for s in a["top5"]], a.get("finish"))
            for a in answer
        ]
