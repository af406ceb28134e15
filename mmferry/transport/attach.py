"""A consumer's attachment to a producer's segment: the lease table mapped read-write, and a
read-only descriptor of the data, from which each lease maps its own private pages.

Attachments are cached weakly by segment name: every open view holds its attachment, so the
table mapping and the descriptors go away with the last view, and a producer that has exited
leaves nothing mapped in its consumers.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
import weakref

import numpy as np

from mmferry.transport.leases import HEADER_WORDS, LeaseTable, check_header
from mmferry.transport.segment import open_segment


def _close(fds: tuple[int, ...]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


class Attachment:
    """One process's hold on one segment: `table` (its leases) and `data_fd` (read-only)."""

    def __init__(self, name: str, *, with_data: bool) -> None:
        self.name = name
        rw = open_segment(name, os.O_RDWR)  # lease records and liveness locks
        ro = -1
        try:
            size = os.fstat(rw).st_size
            head = np.frombuffer(os.pread(rw, HEADER_WORDS * 8, 0), dtype=np.int64)
            if len(head) < HEADER_WORDS:
                raise ValueError(f"shared-memory segment {name!r} is too small to be mmferry's")
            slots, readers, data_offset, data_bytes = check_header(head, size)
            table_len = data_offset if with_data else size
            if with_data and (
                data_offset % mmap.PAGESIZE or data_offset + data_bytes > size or data_bytes == 0
            ):
                raise ValueError(f"shared-memory segment {name!r} has a malformed header")
            self._table_mm = mmap.mmap(rw, table_len)
            self.table = LeaseTable(memoryview(self._table_mm), rw, create=False)
            if with_data:
                # NOTE: a separate read-only open, so no mapping made from it can ever write the
                # segment: a reader's writes stay in its private copy-on-write pages.
                ro = open_segment(name, os.O_RDONLY)
        except BaseException:
            for fd in (rw, ro):
                if fd >= 0:
                    os.close(fd)
            raise
        del slots, readers
        self.data_fd = ro
        self.data_offset = data_offset
        self.data_bytes = data_bytes
        self.views: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        weakref.finalize(self, _close, (rw, ro) if ro >= 0 else (rw,))


_LOCK = threading.RLock()
_CACHE: weakref.WeakValueDictionary[tuple[str, bool], Attachment] = weakref.WeakValueDictionary()


def attachment(name: str, *, with_data: bool = True) -> Attachment:
    """This process's attachment to segment `name`, mapped while anything holds it."""
    with _LOCK:
        att = _CACHE.get((name, with_data))
        if att is None:
            att = Attachment(name, with_data=with_data)
            _CACHE[(name, with_data)] = att
        return att


def lock() -> threading.RLock:
    """The lock consumers hold while they look up and register views."""
    return _LOCK
