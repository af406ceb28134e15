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
from collections.abc import Iterator
from dataclasses import dataclass, field
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


SHM = Path("/dev/shm")
# What SGLang's processes leave in /dev/shm when their group is killed: its load-report files
# and the semaphores of Python's multiprocessing (named under the spawn start method, and
# unlinked by a resource tracker that dies in the same group).
LEFTOVERS = ("sglang_loads_", "sem.mp-")
# vLLM's: its shared-memory broadcast segments (Python's `shared_memory`) and semaphores.
VLLM_LEFTOVERS = ("psm_", "sem.mp-")


def _processes() -> Iterator[tuple[int, list[str]]]:
    """(pid, the fields of /proc/pid/stat after the command name) of every live process."""
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        # NOTE: the command name may hold spaces and parentheses; the fields follow its last ")".
        yield int(d.name), stat[stat.rindex(")") + 2 :].split()


def group_pids(pgid: int) -> list[int]:
    """The live processes of process group `pgid`."""
    return [pid for pid, fields in _processes() if int(fields[2]) == pgid]


def descendants(pid: int) -> list[int]:
    """`pid` and its live descendants (a process tree that shares its parent's group)."""
    children: dict[int, list[int]] = {}
    for child, fields in _processes():
        children.setdefault(int(fields[1]), []).append(child)
    found, todo = [], [pid] if Path(f"/proc/{pid}").exists() else []
    while todo:
        p = todo.pop()
        found.append(p)
        todo += children.get(p, [])
    return found


def held_shm(pids: list[int], kinds: tuple[str, ...] = LEFTOVERS) -> set[str]:
    """The names in /dev/shm of `kinds` (name prefixes; SGLang's by default) whose files
    `pids` map or hold open. Matched by inode: glibc's `sem_open` maps a temporary file it then
    links under the semaphore's name, so a mapping's path need not be the name."""
    inodes: set[int] = set()
    for pid in pids:
        try:
            maps = Path(f"/proc/{pid}/maps").read_text().splitlines()
            fds = list(Path(f"/proc/{pid}/fd").iterdir())
        except OSError:  # gone, or not ours to read
            continue
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].startswith(f"{SHM}/"):
                inodes.add(int(fields[4]))
        for fd in fds:
            with contextlib.suppress(OSError):
                if os.readlink(fd).startswith(f"{SHM}/"):
                    inodes.add(fd.stat().st_ino)
    names = set()
    for entry in os.scandir(SHM):
        with contextlib.suppress(OSError):
            if entry.name.startswith(kinds) and entry.inode() in inodes:
                names.add(entry.name)
    return names


def shm_names() -> set[str]:
    return set(os.listdir(SHM))


@dataclass
class ShmLeftovers:
    """What an engine's process group made in /dev/shm, to remove once it is stopped: the
    names its processes hold (`note`, while they run) that were not there before it started
    (`before`): another engine's, or another program's, are never touched."""

    pgid: int
    before: set[str]
    made: set[str] = field(default_factory=set)
    kinds: tuple[str, ...] = LEFTOVERS  # vLLM's: VLLM_LEFTOVERS
    # The processes are `pgid`'s descendants rather than its group (a server left in its
    # parent's group: vLLM's EPD servers ran several times slower in a session of their own).
    tree: bool = False

    def note(self) -> None:
        pids = descendants(self.pgid) if self.tree else group_pids(self.pgid)
        self.made |= held_shm(pids, self.kinds) - self.before

    def left(self) -> set[str]:
        """What is still in /dev/shm of what the group made: what it was seen holding, and any
        SGLang load-report file new since it started (no other program makes those)."""
        now = shm_names()
        new = {n for n in now - self.before if n.startswith(LEFTOVERS[0])}
        return (self.made & now) | new

    def remove(self) -> list[str]:
        """Unlink what the group made and left (call once it has stopped); the names removed."""
        removed = []
        for name in sorted(self.made):
            with contextlib.suppress(FileNotFoundError):
                (SHM / name).unlink()
                removed.append(name)
        return removed


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
    shm: ShmLeftovers | None = None

    @classmethod
    def start(cls, model: Path, workdir: Path, env: dict[str, str] | None = None, **options):
        opts = {**ENGINE_OPTIONS, **options}
        before = shm_names()
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
        engine = cls(proc, workdir, shm=ShmLeftovers(proc.pid, before))
        engine._follow()
        try:
            engine._wait(lambda: engine._ready() is not None, START_TIMEOUT_S)
        except BaseException:
            engine.stop()
            raise
        engine.start_s = engine._ready()
        engine.shm.note()
        return engine

    def _ready(self) -> float | None:
        for line in self.lines:
            m = re.search(r"sglang-driver: ready in ([0-9.]+) s", line)
            if m:
                return float(m.group(1))
        return None

    def stop(self) -> None:
        """Close the driver's stdin (it shuts the engine down), then end its process group and
        remove what it left in /dev/shm."""
        self.shm.note()
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
        self.shm.remove()
