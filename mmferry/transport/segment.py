"""`Segment`: one POSIX shared-memory segment, reserved up front, unlinked when its creator dies."""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import re
import secrets
import subprocess
import sys
import weakref

SHM_DIR = "/dev/shm"
PREFIX = "mmferry-"
# NOTE: the only names a consumer will open: a handle cannot point the mapping at another file.
_NAME = re.compile(rf"/{PREFIX}[0-9]+-[0-9a-f]{{12}}")

# The reaper holds the read end of a pipe whose only writer is the creating process. EOF means
# the creator is gone (normal exit, exception, SIGKILL): the reaper unlinks the name, so the
# kernel frees the memory once the last process that mapped it unmaps or dies.
_REAPER = (
    "import os, sys\n"
    "sys.stdin.buffer.read()\n"
    "try:\n"
    "    os.unlink(sys.argv[1])\n"
    "except FileNotFoundError:\n"
    "    pass\n"
)


class ShmSpaceError(OSError):
    """The shared-memory filesystem has no room for a new segment."""


def check_name(name: object) -> str:
    """`name` if it is an mmferry segment name, else a ValueError."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(f"{name!r} is not an mmferry shared-memory segment name")
    return name


def open_segment(name: str, flags: int) -> int:
    """A descriptor of the existing segment `name` (a consumer's way in)."""
    try:
        return os.open(SHM_DIR + check_name(name), flags | os.O_CLOEXEC | os.O_NOFOLLOW)
    except FileNotFoundError:
        raise FileNotFoundError(
            f"shared-memory segment {name!r} is gone: its producer has exited"
        ) from None


def _reserve(fd: int, size: int, directory: str) -> None:
    # A sparse segment "succeeds" on a small /dev/shm and the first write past the free space
    # kills the writer with SIGBUS; reserving every page now turns that into an error here.
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
            raise
        st = os.statvfs(directory)
        raise ShmSpaceError(
            e.errno,
            f"cannot reserve {size} bytes of shared memory in {directory} "
            f"({st.f_bavail * st.f_frsize} bytes free). Give the container more shared memory "
            "(docker run --shm-size=..., or a memory-backed emptyDir on Kubernetes) or use a "
            "smaller capacity_bytes",
        ) from None


class Segment:
    """A producer's segment: mapped read-write, owned (and unlinked) by its creator."""

    def __init__(self, name: str, path: str, fd: int, mm: mmap.mmap, reaper: subprocess.Popen):
        self.name = name
        self.path = path
        self.fd = fd  # NOTE: kept open: the producer probes its readers' locks through it
        self.mm = mm
        self.size = len(mm)
        self._reaper: subprocess.Popen | None = reaper
        weakref.finalize(self, os.close, fd)

    @classmethod
    def create(cls, size: int, *, directory: str = SHM_DIR) -> Segment:
        """A new segment of `size` bytes, all reserved, guarded by a reaper process."""
        if not isinstance(size, int) or size <= 0:
            raise ValueError(f"segment size must be a positive int, got {size!r}")
        name = f"/{PREFIX}{os.getpid()}-{secrets.token_hex(6)}"
        path = directory + name
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_CLOEXEC, 0o600)
        try:
            os.ftruncate(fd, size)
            _reserve(fd, size, directory)
            mm = mmap.mmap(fd, size)
            # NOTE: a new session, so a signal to the creator's process group spares the reaper.
            reaper = subprocess.Popen(
                [sys.executable, "-S", "-c", _REAPER, path],
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
            )
        except BaseException:
            os.close(fd)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            raise
        return cls(name, path, fd, mm, reaper)

    def unlink(self) -> None:
        """Remove the name (the creator's job); mappings stay valid until unmapped."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        reaper, self._reaper = self._reaper, None
        if reaper is not None:
            reaper.stdin.close()
            try:
                reaper.wait(timeout=5)
            except subprocess.TimeoutExpired:
                reaper.kill()
                reaper.wait()
