"""A consumer's mapping of a producer's segment: lease table read-write, data read-only.

Attachments are cached weakly by segment name: every open view holds its attachment, so the
mapping (and, when pinned, its page-locked registration) goes away with the last view, and a
producer that has exited leaves nothing mapped in its consumers.
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

# cudaHostRegisterReadOnly: the data mapping is PROT_READ, so the registration must say so.
_HOST_REGISTER_READ_ONLY = 8


def _close(fds: tuple[int, ...], pinned: list[int]) -> None:
    # NOTE: runs before the mappings are freed (weakref callbacks precede attribute teardown),
    # so the registration ends while its pages are still mapped.
    if pinned:
        import torch

        torch.cuda.cudart().cudaHostUnregister(pinned.pop())
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


class Attachment:
    """One process's view of one segment: `table` (its leases) and `data` (read-only bytes)."""

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
            self.data: mmap.mmap | None = None
            if with_data:
                # NOTE: a separate read-only open, so the data pages cannot be made writable.
                ro = open_segment(name, os.O_RDONLY)
                self.data = mmap.mmap(
                    ro, data_bytes, prot=mmap.PROT_READ, flags=mmap.MAP_SHARED, offset=data_offset
                )
        except BaseException:
            for fd in (rw, ro):
                if fd >= 0:
                    os.close(fd)
            raise
        del slots, readers
        self.data_offset = data_offset
        self.data_bytes = data_bytes
        self._pinned: list[int] = []
        self.views: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        weakref.finalize(self, _close, (rw, ro) if ro >= 0 else (rw,), self._pinned)

    def pin(self) -> None:
        """Page-lock the data mapping once, so host->device copies can read slots directly."""
        if self._pinned or self.data is None:
            return
        import torch

        ptr = np.frombuffer(self.data, dtype=np.uint8).ctypes.data
        err = torch.cuda.cudart().cudaHostRegister(ptr, len(self.data), _HOST_REGISTER_READ_ONLY)
        if int(err) != 0:
            raise RuntimeError(f"cudaHostRegister failed for {self.name}: error {err}")
        self._pinned.append(ptr)


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
