"""Reader liveness as byte-range locks: held while a lease is open, dropped by the kernel at exit.

Open-file-description locks (`F_OFD_*`) belong to one open of the file, not to a process id, so
they mean the same thing in every PID namespace, conflict between two opens in one process, and
vanish when the holder dies however it dies. The byte offsets name lease records, not data.
"""

from __future__ import annotations

import errno
import fcntl
import os
import struct

# struct flock: l_type, l_whence, l_start, l_len, l_pid (native layout, padded).
_FLOCK = struct.Struct("@hhqqi4x")


def _flock(kind: int, index: int) -> bytes:
    return _FLOCK.pack(kind, os.SEEK_SET, index, 1, 0)


def try_lock(fd: int, index: int) -> bool:
    """Take the exclusive lock on byte `index`; False when another open of the file holds it."""
    try:
        fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _flock(fcntl.F_WRLCK, index))
    except OSError as e:
        if e.errno in (errno.EAGAIN, errno.EACCES):
            return False
        raise
    return True


def unlock(fd: int, index: int) -> None:
    """Drop this open's lock on byte `index`."""
    fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _flock(fcntl.F_UNLCK, index))


def is_locked(fd: int, index: int) -> bool:
    """True while some other open of the file holds a lock on byte `index` (a live reader)."""
    got = fcntl.fcntl(fd, fcntl.F_OFD_GETLK, _flock(fcntl.F_WRLCK, index))
    return _FLOCK.unpack(got)[0] != fcntl.F_UNLCK
