"""`Segment`: one POSIX shared-memory segment, unlinked by a reaper when its creator dies."""

from __future__ import annotations

import _posixshmem
import contextlib
import mmap
import os
import secrets
import subprocess
import sys

PREFIX = "mmferry-"

# The reaper holds the read end of a pipe whose only writer is the creating process. EOF means
# the creator is gone (normal exit, exception, SIGKILL): the reaper unlinks the name, so the
# kernel frees the memory once the last process that mapped it unmaps or dies.
_REAPER = (
    "import sys, _posixshmem\n"
    "sys.stdin.buffer.read()\n"
    "try:\n"
    "    _posixshmem.shm_unlink(sys.argv[1])\n"
    "except FileNotFoundError:\n"
    "    pass\n"
)


class Segment:
    """A mapped POSIX shared-memory segment; the creator owns its name, others only map it."""

    def __init__(self, name: str, mm: mmap.mmap, reaper: subprocess.Popen | None) -> None:
        self.name = name
        self.mm = mm
        self.size = len(mm)
        self._reaper = reaper

    @classmethod
    def create(cls, size: int) -> Segment:
        """A new segment of `size` bytes, guarded by a reaper process."""
        if size <= 0:
            raise ValueError(f"segment size must be positive, got {size}")
        name = f"/{PREFIX}{os.getpid()}-{secrets.token_hex(6)}"
        fd = _posixshmem.shm_open(name, os.O_CREAT | os.O_EXCL | os.O_RDWR, mode=0o600)
        try:
            os.ftruncate(fd, size)
            mm = mmap.mmap(fd, size)
        except BaseException:
            _posixshmem.shm_unlink(name)
            raise
        finally:
            os.close(fd)
        try:
            # NOTE: a new session, so a signal to the creator's process group spares the reaper.
            reaper = subprocess.Popen(
                [sys.executable, "-S", "-c", _REAPER, name],
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
            )
        except BaseException:
            _posixshmem.shm_unlink(name)
            raise
        return cls(name, mm, reaper)

    @classmethod
    def attach(cls, name: str) -> Segment:
        """Map an existing segment by name (no ownership: this process never unlinks it)."""
        try:
            fd = _posixshmem.shm_open(name, os.O_RDWR, mode=0o600)
        except FileNotFoundError:
            raise FileNotFoundError(
                f"shared-memory segment {name!r} is gone: its producer has exited"
            ) from None
        try:
            mm = mmap.mmap(fd, os.fstat(fd).st_size)
        finally:
            os.close(fd)
        return cls(name, mm, None)

    def unlink(self) -> None:
        """Remove the name (the creator's job); mappings stay valid until unmapped."""
        with contextlib.suppress(FileNotFoundError):
            _posixshmem.shm_unlink(self.name)
        reaper, self._reaper = self._reaper, None
        if reaper is not None:
            reaper.stdin.close()
            try:
                reaper.wait(timeout=5)
            except subprocess.TimeoutExpired:
                reaper.kill()
                reaper.wait()
