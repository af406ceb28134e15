"""Reader liveness across PID namespaces (containers sharing /dev/shm), and /dev/shm too small.

A reader in its own PID namespace has a PID that means nothing (or another process) to the
producer; liveness is a lock the reader holds, which the kernel drops when it dies.
"""

from __future__ import annotations

import gc
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile

import pytest
import torch
from shm_helpers import wait_until

from mmferry.transport.segment import Segment, ShmSpaceError
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


def _small_tmpfs():
    d = tempfile.mkdtemp(prefix="mmferry-tmpfs-")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", d], capture_output=True)
    if r.returncode != 0:
        os.rmdir(d)
        return None
    return d


def test_too_small_shm_is_an_error_naming_shm_size_not_a_sigbus():
    d = _small_tmpfs()
    if d is None:
        # Without a mount of our own, still check the message on the real /dev/shm.
        st = os.statvfs("/dev/shm")
        too_big = st.f_bavail * st.f_frsize + (1 << 30)
        with pytest.raises(ShmSpaceError, match="--shm-size"):
            Segment.create(too_big)
        return
    try:
        with pytest.raises(ShmSpaceError, match="--shm-size"):
            ShmArena(32 << 20, _shm_dir=d)
        assert os.listdir(d) == []  # nothing left behind
        with ShmArena(4 << 20, _shm_dir=d) as arena:
            # All of it reserved now: a put of the whole capacity cannot fault.
            x = torch.ones((4 << 20) // 4 - 2048)
            h = arena.put(x)
            assert h.inline is None
            used = os.statvfs(d)
            assert (used.f_blocks - used.f_bfree) * used.f_frsize >= 4 << 20
        del arena, h
        gc.collect()
        first = ShmArena(6 << 20, _shm_dir=d)  # the space came back with the closed arena
        with pytest.raises(ShmSpaceError, match="--shm-size"):
            ShmArena(6 << 20, _shm_dir=d)
        first.close()
        del first
    finally:
        gc.collect()
        subprocess.run(["umount", "-l", d], check=False)
        os.rmdir(d)
