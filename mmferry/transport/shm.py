"""Shared-memory transport: a producer's bounded arena, small handles, zero-copy leased views.

Producer: `arena.put(tensor) -> ShmHandle` copies the bytes once into a slot of one POSIX
segment. Consumer (any process): `open_shared(handle)` maps the slot's pages copy-on-write and
returns a tensor viewing them: no copy is made, and a reader that writes into its view changes
only its own pages. The slot comes back to the producer only when every reader's views, every
tensor aliasing them, and every pending copy out of them are gone (or the reader died).
"""

from __future__ import annotations

import dataclasses
import mmap
import threading
import time
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

from mmferry.transport import attach
from mmferry.transport.handles import check_layout, check_lease, check_range
from mmferry.transport.leases import LeaseTable, check_shape, table_bytes
from mmferry.transport.private import PrivatePages, pages_of
from mmferry.transport.segment import SHM_DIR, Segment, ShmSpaceError, check_name
from mmferry.transport.slots import Grant, SlotBook

OnFull = Literal["wait", "inline"]
__all__ = ["ArenaFullError", "ShmArena", "ShmHandle", "ShmSpaceError", "open_shared"]


class ArenaFullError(TimeoutError):
    """The arena stayed full for the whole wait; the caller still holds the data."""


@dataclass(frozen=True)
class ShmHandle:
    """A picklable reference to a tensor in an arena slot (or its bytes inline)."""

    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    segment: str = ""
    offset: int = 0
    slot: int = -1
    gen: int = 0
    reader: int = 0
    readers: int = 1
    inline: bytes | None = None

    def for_reader(self, reader: int) -> ShmHandle:
        """The same lease as seen by reader `reader` (each reader opens its own handle)."""
        if not 0 <= reader < self.readers:
            raise ValueError(f"reader must be in 0..{self.readers - 1}, got {reader}")
        return dataclasses.replace(self, reader=reader)


@dataclass
class ArenaStats:
    puts: int = 0
    inline_puts: int = 0
    reclaimed: int = 0
    wait_s: float = 0.0


def _as_bytes_view(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


class ShmArena:
    """A bounded shared-memory arena owned by one producer process; thread-safe."""

    def __init__(
        self,
        capacity_bytes: int,
        *,
        max_slots: int = 1024,
        max_readers: int = 8,
        on_full: OnFull = "wait",
        timeout_s: float = 10.0,
        _shm_dir: str = SHM_DIR,
    ) -> None:
        # NOTE: every argument is checked before the segment exists, and a failure after it
        # exists unlinks it: a failed constructor leaves no segment and no reaper behind.
        if on_full not in ("wait", "inline"):
            raise ValueError(f"on_full must be 'wait' or 'inline', got {on_full!r}")
        if type(capacity_bytes) is not int or capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be a positive int, got {capacity_bytes!r}")
        if not isinstance(timeout_s, (int, float)) or not timeout_s >= 0:
            raise ValueError(f"timeout_s must be a number >= 0, got {timeout_s!r}")
        check_shape(max_slots, max_readers)
        page = mmap.ALLOCATIONGRANULARITY
        header = -(-table_bytes(max_slots, max_readers) // page) * page
        self._segment = Segment.create(header + capacity_bytes, directory=_shm_dir)
        try:
            table = LeaseTable(
                memoryview(self._segment.mm)[:header],
                self._segment.fd,
                create=True,
                max_slots=max_slots,
                max_readers=max_readers,
                data_offset=header,
                data_bytes=capacity_bytes,
            )
            self._book = SlotBook(capacity_bytes, table)
        except BaseException:
            self._segment.unlink()
            raise
        self._data_offset = header
        self.on_full = on_full
        self.timeout_s = timeout_s
        self.stats = ArenaStats()
        self._stats_lock = threading.Lock()
        self._warned = False
        self._finalizer = weakref.finalize(self, self._segment.unlink)

    @property
    def name(self) -> str:
        return self._segment.name

    @property
    def capacity_bytes(self) -> int:
        return self._book.alloc.capacity

    @property
    def used_bytes(self) -> int:
        return self._book.used_bytes

    @property
    def live_slots(self) -> int:
        return self._book.live_slots

    def _count(self, field: str, value: float = 1) -> None:
        with self._stats_lock:
            setattr(self.stats, field, getattr(self.stats, field) + value)

    def put(self, tensor: torch.Tensor, *, readers: int = 1) -> ShmHandle:
        """Copy `tensor` into a slot for `readers` consumers; inline when it cannot fit."""
        self._book.check_put(tensor, readers)
        if not self._finalizer.alive:
            raise ValueError("arena is closed")
        nbytes = tensor.numel() * tensor.element_size()
        meta = {"shape": tuple(tensor.shape), "dtype": str(tensor.dtype), "nbytes": nbytes}
        self._count("puts")
        if nbytes == 0 or not self._book.alloc.fits_ever(nbytes):
            return self._inline(tensor, meta, readers)

        def fill(offset: int) -> None:
            dst = torch.frombuffer(
                self._segment.mm, dtype=torch.uint8, count=nbytes, offset=self._data_offset + offset
            )
            # NOTE: the producer's only copy: source bytes straight into the slot.
            dst.view(tensor.dtype).view(tensor.shape).copy_(tensor.detach())

        grant = self._place(nbytes, readers, fill)
        if grant is None:
            return self._inline(tensor, meta, readers)
        return ShmHandle(
            segment=self.name,
            offset=self._data_offset + grant.offset,
            slot=grant.slot,
            gen=grant.gen,
            readers=readers,
            **meta,
        )

    def _place(self, nbytes: int, readers: int, fill: Callable[[int], None]) -> Grant | None:
        deadline = time.monotonic() + self.timeout_s
        delay = 0.0005
        start = time.monotonic()
        while True:
            grant = self._book.put(nbytes, readers, fill)
            if grant is not None:
                return grant
            if self.reclaim():
                continue
            if self.on_full == "inline":
                return None
            now = time.monotonic()
            if now >= deadline:
                self._count("wait_s", now - start)
                raise ArenaFullError(
                    f"shared-memory arena ({self.capacity_bytes} bytes, {self.live_slots} live "
                    f"slots) stayed full for {self.timeout_s}s; release views, raise "
                    "capacity_bytes, or use on_full='inline'"
                )
            time.sleep(delay)
            delay = min(delay * 2, 0.02)

    def _inline(self, tensor: torch.Tensor, meta: dict, readers: int) -> ShmHandle:
        self._count("inline_puts")
        if not self._warned and meta["nbytes"]:
            self._warned = True
            warnings.warn(
                f"shared-memory arena {self.name} has no room for {meta['nbytes']} bytes; "
                "sending bytes inline (counted in stats.inline_puts)",
                RuntimeWarning,
                stacklevel=3,
            )
        data = _as_bytes_view(tensor.cpu()).numpy().tobytes()
        return ShmHandle(readers=readers, inline=data, **meta)

    def reclaim(self) -> int:
        """Free every slot whose readers all released, died, or were cancelled; the count."""
        freed = self._book.reclaim()
        if freed:
            self._count("reclaimed", freed)
        return freed

    def cancel(self, handle: ShmHandle) -> None:
        """Readers of `handle` that have not opened it never will (e.g. a dropped request)."""
        if handle.inline is None and self._book.cancel(handle.slot, handle.gen):
            self.reclaim()

    def close(self) -> None:
        """Unlink the segment; views already open stay valid until dropped."""
        self._finalizer()

    def __enter__(self) -> ShmArena:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _open_inline(handle: ShmHandle, dtype: torch.dtype) -> torch.Tensor:
    if not isinstance(handle.inline, bytes) or len(handle.inline) != handle.nbytes:
        raise ValueError("inline handle bytes do not match its nbytes: corrupt handle refused")
    if handle.nbytes == 0:
        return torch.empty(handle.shape, dtype=dtype)
    return torch.frombuffer(bytearray(handle.inline), dtype=dtype).view(handle.shape)


def _release(att: attach.Attachment, slot: int, gen: int, reader: int) -> None:
    att.table.release(slot, gen, reader)


def open_shared(handle: ShmHandle, *, pin: bool = False) -> torch.Tensor:
    """A tensor for `handle`: a zero-copy, copy-on-write view of the slot, leased until it dies.

    Writes into it stay this reader's own (the pages it writes are copied for it alone); the
    producer and other readers keep seeing the original bytes. Each reader opens its handle
    once: opening it again while a view lives returns the same view; after the views died (the
    lease ended) it raises.
    """
    if not isinstance(handle, ShmHandle):
        raise ValueError(f"open_shared expects a ShmHandle, got {type(handle).__name__}")
    dtype = check_layout(handle.shape, handle.dtype, handle.nbytes)
    if handle.inline is not None:
        return _open_inline(handle, dtype)
    check_name(handle.segment)
    check_lease(handle.slot, handle.gen, handle.reader, handle.readers)
    with attach.lock():
        att = attach.attachment(handle.segment)
        check_range(handle.offset, handle.nbytes, att.data_offset, att.data_bytes)
        if handle.nbytes == 0:
            raise ValueError("a zero-byte slot handle is never issued: forged handle refused")
        key = (handle.slot, handle.gen, handle.reader)
        arr = att.views.get(key)
        if arr is None:
            start = handle.offset - att.data_offset
            att.table.acquire(handle.slot, handle.gen, handle.reader, start, handle.nbytes)
            try:
                # NOTE: the range was checked against the segment above, and the lease is
                # taken: only now are its pages mapped, and only its own.
                arr = PrivatePages(att.data_fd, handle.offset, handle.nbytes).array()
                att.views[key] = arr
            except BaseException:
                att.table.release(handle.slot, handle.gen, handle.reader)
                raise
            # NOTE: the lease ends when this array dies, which is when the last tensor sharing
            # its storage dies (from_numpy keeps it alive), including those held by pending
            # copies. The finalizer also holds the attachment, so the lease table outlives it.
            weakref.finalize(arr, _release, att, handle.slot, handle.gen, handle.reader)
        if pin and torch.cuda.is_available():
            pages_of(arr).pin()
    return torch.from_numpy(arr).view(dtype).view(handle.shape)
