"""Shared-memory transport: a producer's bounded arena, small handles, zero-copy leased views.

Producer: `arena.put(tensor) -> ShmHandle` copies the bytes once into a slot of one POSIX
segment. Consumer (any process): `open_shared(handle)` maps the segment and returns a tensor
viewing the slot. The slot comes back to the producer only when every reader's views, every
tensor aliasing them, and every pending copy out of them are gone (or the reader died).
"""

from __future__ import annotations

import dataclasses
import functools
import time
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch

from mmferry.transport.leases import LeaseTable, table_bytes
from mmferry.transport.segment import Segment
from mmferry.transport.slots import SlotBook

OnFull = Literal["wait", "inline"]


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


def _dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} in handle")
    return dtype


def _as_bytes_view(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


class ShmArena:
    """A bounded shared-memory arena owned by one producer process."""

    def __init__(
        self,
        capacity_bytes: int,
        *,
        max_slots: int = 1024,
        max_readers: int = 8,
        on_full: OnFull = "wait",
        timeout_s: float = 10.0,
    ) -> None:
        if on_full not in ("wait", "inline"):
            raise ValueError(f"on_full must be 'wait' or 'inline', got {on_full!r}")
        header = -(-table_bytes(max_slots, max_readers) // 4096) * 4096
        self._segment = Segment.create(header + capacity_bytes)
        table = LeaseTable(
            memoryview(self._segment.mm)[:header],
            create=True,
            max_slots=max_slots,
            max_readers=max_readers,
        )
        self._data_offset = header
        self._book = SlotBook(capacity_bytes, table)
        self.on_full = on_full
        self.timeout_s = timeout_s
        self.stats = ArenaStats()
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
        return self._book.alloc.used_bytes

    @property
    def live_slots(self) -> int:
        return self._book.live_slots

    def put(self, tensor: torch.Tensor, *, readers: int = 1) -> ShmHandle:
        """Copy `tensor` into a slot for `readers` consumers; inline when it cannot fit."""
        self._book.check_put(tensor, readers)
        if not self._finalizer.alive:
            raise ValueError("arena is closed")
        nbytes = tensor.numel() * tensor.element_size()
        meta = {"shape": tuple(tensor.shape), "dtype": str(tensor.dtype), "nbytes": nbytes}
        self.stats.puts += 1
        if nbytes == 0 or not self._book.alloc.fits_ever(nbytes):
            return self._inline(tensor, meta, readers)
        placed = self._place(nbytes)
        if placed is None:
            return self._inline(tensor, meta, readers)
        slot, offset = placed
        try:
            dst = torch.frombuffer(
                self._segment.mm, dtype=torch.uint8, count=nbytes, offset=self._data_offset + offset
            )
            # NOTE: the producer's only copy: source bytes straight into the slot.
            dst.view(tensor.dtype).view(tensor.shape).copy_(tensor.detach())
        except BaseException:
            self._book.untake(slot, offset)  # nobody holds a handle to it yet
            raise
        gen = self._book.grant(slot, offset, readers)
        return ShmHandle(
            segment=self.name,
            offset=self._data_offset + offset,
            slot=slot,
            gen=gen,
            readers=readers,
            **meta,
        )

    def _place(self, nbytes: int) -> tuple[int, int] | None:
        deadline = time.monotonic() + self.timeout_s
        delay = 0.0005
        start = time.monotonic()
        while True:
            placed = self._book.take(nbytes)
            if placed is not None:
                return placed
            if self.reclaim():
                continue
            if self.on_full == "inline":
                return None
            now = time.monotonic()
            if now >= deadline:
                self.stats.wait_s += now - start
                raise ArenaFullError(
                    f"shared-memory arena ({self.capacity_bytes} bytes, {self.live_slots} live "
                    f"slots) stayed full for {self.timeout_s}s; release views, raise "
                    "capacity_bytes, or use on_full='inline'"
                )
            time.sleep(delay)
            delay = min(delay * 2, 0.02)

    def _inline(self, tensor: torch.Tensor, meta: dict, readers: int) -> ShmHandle:
        self.stats.inline_puts += 1
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
        self.stats.reclaimed += freed
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


@dataclass
class _Attachment:
    segment: Segment
    table: LeaseTable
    views: weakref.WeakValueDictionary = field(default_factory=weakref.WeakValueDictionary)
    pinned: bool = False

    def pin(self) -> None:
        if self.pinned:
            return
        # Page-locking the whole mapping once lets host->device copies read slots directly.
        ptr = np.frombuffer(self.segment.mm, dtype=np.uint8).ctypes.data
        err = torch.cuda.cudart().cudaHostRegister(ptr, self.segment.size, 0)
        if int(err) != 0:
            raise RuntimeError(f"cudaHostRegister failed for {self.segment.name}: error {err}")
        self.pinned = True


@functools.lru_cache(maxsize=32)
def _attachment(name: str) -> _Attachment:
    segment = Segment.attach(name)
    head = np.frombuffer(segment.mm, dtype=np.int64, count=4)
    header_bytes = table_bytes(int(head[1]), int(head[2]))
    return _Attachment(segment, LeaseTable(memoryview(segment.mm)[:header_bytes], create=False))


def open_shared(handle: ShmHandle, *, pin: bool = False) -> torch.Tensor:
    """A tensor for `handle`: a zero-copy view of the slot, leased until it and aliases die."""
    if not isinstance(handle, ShmHandle):
        raise ValueError(f"open_shared expects a ShmHandle, got {type(handle).__name__}")
    dtype = _dtype_from_name(handle.dtype)
    if handle.inline is not None:
        if handle.nbytes == 0:
            return torch.empty(handle.shape, dtype=dtype)
        return torch.frombuffer(bytearray(handle.inline), dtype=dtype).view(handle.shape)
    att = _attachment(handle.segment)
    key = (handle.slot, handle.gen, handle.reader)
    arr = att.views.get(key)
    if arr is None:
        att.table.mark_open(handle.slot, handle.gen, handle.reader)
        arr = np.frombuffer(
            att.segment.mm, dtype=np.uint8, count=handle.nbytes, offset=handle.offset
        )
        att.views[key] = arr
        # NOTE: the lease ends when this array dies, which is when the last tensor sharing its
        # storage dies (from_numpy keeps it alive), including those held by pending copies.
        weakref.finalize(arr, att.table.mark_released, handle.slot, handle.gen, handle.reader)
    if pin and torch.cuda.is_available():
        att.pin()
    return torch.from_numpy(arr).view(dtype).view(handle.shape)
