"""Reader liveness across PID namespaces (containers sharing /dev/shm).

A reader in its own PID namespace has a PID that means nothing (or another process) to the
producer; liveness is a lock the reader holds, which the kernel drops when it dies.
"""

from __future__ import annotations

import os
import pickle
import shutil
import signal
import subprocess
import sys

import pytest
import torch
from shm_helpers import wait_until

from mmferry.transport.shm import ShmArena

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
READER = r"""
import os, pickle, sys
from mmferry.transport.shm import open_shared
v = open_shared(pickle.loads(bytes.fromhex(sys.argv[1])))
print("opened", os.getpid(), float(v.double().sum()), flush=True)
if sys.stdin.readline().strip() == "release":
    del v
    import gc; gc.collect()
    print("released", flush=True)
    sys.stdin.readline()
"""


def _unshare_works() -> bool:
    if shutil.which("unshare") is None:
        return False
    r = subprocess.run(
        ["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True, timeout=30
    )
    return r.returncode == 0


UNSHARE = _unshare_works()


def _reader(handle, *, pid_one: bool) -> subprocess.Popen:
    # pid_one: the reader is PID 1 of its namespace (PID 1 is always alive for the producer);
    # otherwise a shell is PID 1 and the reader gets a PID that names some other process (or
    # none) in the producer's namespace.
    py = [sys.executable, "-c", READER, pickle.dumps(handle).hex()]
    inner = py if pid_one else ["sh", "-c", '"$@"; true', "sh", *py]
    return subprocess.Popen(
        ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child", *inner],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": ROOT},
    )


@pytest.mark.skipif(not UNSHARE, reason="unshare --pid --fork --mount-proc is not permitted here")
@pytest.mark.parametrize("pid_one", [True, False])
def test_reader_in_another_pid_namespace_is_live_while_reading_and_dead_when_killed(pid_one):
    x = torch.arange(4096.0)
    with ShmArena(1 << 20) as arena:
        h = arena.put(x)
        proc = _reader(h, pid_one=pid_one)
        try:
            line = proc.stdout.readline().split()
            assert line[:1] == ["opened"] and float(line[2]) == float(x.sum())
            assert (int(line[1]) == 1) == pid_one  # its PID in its own namespace
            for _ in range(3):
                assert arena.reclaim() == 0  # a live reader, whatever its PID means here
            os.kill(proc.pid, signal.SIGKILL)  # --kill-child takes the reader down too
            proc.wait(30)
            assert wait_until(lambda: arena.reclaim() == 1), "a dead reader's slot leaked"
        finally:
            proc.kill()
            proc.wait(30)


@pytest.mark.skipif(not UNSHARE, reason="unshare --pid --fork --mount-proc is not permitted here")
def test_reader_in_another_pid_namespace_releases_normally():
    with ShmArena(1 << 20) as arena:
        h = arena.put(torch.ones(256))
        proc = _reader(h, pid_one=True)
        try:
            assert proc.stdout.readline().startswith("opened")
            assert arena.reclaim() == 0
            proc.stdin.write("release\n")
            proc.stdin.flush()
            assert proc.stdout.readline().strip() == "released"
            assert arena.reclaim() == 1  # released while the reader still lives
        finally:
            proc.kill()
            proc.wait(30)
