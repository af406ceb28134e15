"""A shared-memory filesystem smaller than the arena: a clear error at creation, never SIGBUS."""

from __future__ import annotations

import gc
import os
import subprocess
import tempfile

import pytest
import torch

from mmferry.transport.segment import Segment, ShmSpaceError
from mmferry.transport.shm import ShmArena


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
