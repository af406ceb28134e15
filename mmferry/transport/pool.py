"""`FeaturePool`: a bounded feature pool (device memory, or host memory) with a host fallback.

The producer copies a feature into a slice of one fixed-size store and sends a `PoolHandle`;
consumers open a view of the slice and `ack` when done. A slice is freed when every reader
acknowledged, died, or the request was cancelled. When no slice fits, the feature goes through
the shared-memory arena instead (counted in `stats.fallbacks`, warned once): nothing is lost and
nothing waits. The allocator and lease logic are the same for every backing store, so the CUDA
IPC store (`CudaBacking`) and the host store (`HostBacking`) share one code path.
"""

from __future__ import annotations

import functools
import warnings
import weakref
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from mmferry.transport.leases import LeaseTable, table_bytes
from mmferry.transport.segment import Segment
from mmferry.transport.shm import ShmArena, ShmHandle, _dtype_from_name, open_shared
from mmferry.transport.slots import SlotBook


class Backing(Protocol):
    capacity: int

    def store(self) -> torch.Tensor: ...  # flat uint8 [capacity], in this process

    def export(self) -> tuple: ...  # hashable, picklable: lets another process open the store


class HostBacking:
    """A store in a shared-memory segment (CPU pools, and tests of the pool logic)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._segment = Segment.create(capacity)
        self._finalizer = weakref.finalize(self, self._segment.unlink)

    def store(self) -> torch.Tensor:
        return torch.frombuffer(self._segment.mm, dtype=torch.uint8)

    def export(self) -> tuple:
        return ("host", self._segment.name)

    def close(self) -> None:
        self._finalizer()


class CudaBacking:
    """A store in device memory, shared with consumers through a CUDA IPC handle."""

    def __init__(self, capacity: int, device: torch.device | str = "cuda") -> None:
        from torch.multiprocessing.reductions import reduce_tensor

        self.capacity = capacity
        self._store = torch.empty(capacity, dtype=torch.uint8, device=device)
        self._export = ("cuda", *reduce_tensor(self._store))

    def store(self) -> torch.Tensor:
        return self._store

    def export(self) -> tuple:
        return self._export

    def close(self) -> None:
        pass


@dataclass(frozen=True)
class PoolHandle:
    """A picklable reference to a feature in a pool slice, for reader `reader`."""

    store: tuple
    control: str
    offset: int
    nbytes: int
    shape: tuple[int, ...]
    dtype: str
    slot: int
    gen: int
    readers: int = 1
    reader: int = 0
    ready: bytes | None = None  # CUDA IPC event handle: the producer's copy into the slice

    def for_reader(self, reader: int) -> PoolHandle:
        if not 0 <= reader < self.readers:
            raise ValueError(f"reader must be in 0..{self.readers - 1}, got {reader}")
        return PoolHandle(**{**self.__dict__, "reader": reader})


@dataclass
class PoolStats:
    puts: int = 0
    fallbacks: int = 0
    freed: int = 0


class FeaturePool:
    """Producer side of a bounded feature pool over `backing`, falling back to `fallback`."""

    def __init__(
        self,
        backing: Backing,
        *,
        fallback: ShmArena | None = None,
        max_slots: int = 1024,
        max_readers: int = 8,
    ) -> None:
        self.backing = backing
        self._store = backing.store()
        self._control = Segment.create(table_bytes(max_slots, max_readers))
        table = LeaseTable(
            memoryview(self._control.mm), create=True, max_slots=max_slots, max_readers=max_readers
        )
        self._book = SlotBook(backing.capacity, table)
        self._own_fallback = fallback is None
        self.fallback = fallback or ShmArena(max(2 * backing.capacity, 64 << 20), on_full="inline")
        self._warned = False
        self.stats = PoolStats()

    @property
    def used_bytes(self) -> int:
        return self._book.alloc.used_bytes

    @property
    def live_slots(self) -> int:
        return self._book.live_slots

    def put(self, tensor: torch.Tensor, *, readers: int = 1) -> PoolHandle | ShmHandle:
        """Place `tensor` in the pool for `readers` consumers, or send it through shared memory."""
        self._book.check_put(tensor, readers)
        self.stats.puts += 1
        nbytes = tensor.numel() * tensor.element_size()
        placed = self._place(nbytes) if nbytes else None
        if placed is None:
            return self._fall_back(tensor, readers)
        slot, offset = placed
        ready = None
        try:
            dst = self._store[offset : offset + nbytes].view(tensor.dtype).view(tensor.shape)
            if dst.is_cuda:
                dst.copy_(tensor.detach(), non_blocking=True)
                event = torch.cuda.Event(interprocess=True)
                event.record()
                ready = event.ipc_handle()  # consumers wait on this on their stream, not the host
            else:
                dst.copy_(tensor.detach())
        except BaseException:
            self._book.untake(slot, offset)  # nobody holds a handle to it yet
            raise
        gen = self._book.grant(slot, offset, readers)
        return PoolHandle(
            store=self.backing.export(),
            control=self._control.name,
            offset=offset,
            nbytes=nbytes,
            shape=tuple(tensor.shape),
            dtype=str(tensor.dtype),
            slot=slot,
            gen=gen,
            readers=readers,
            ready=ready,
        )

    def _place(self, nbytes: int) -> tuple[int, int] | None:
        placed = self._book.take(nbytes)
        if placed is None and self.reclaim():
            placed = self._book.take(nbytes)
        return placed

    def _fall_back(self, tensor: torch.Tensor, readers: int) -> ShmHandle:
        self.stats.fallbacks += 1
        if not self._warned:
            self._warned = True
            warnings.warn(
                f"feature pool full ({self.used_bytes}/{self.backing.capacity} bytes used); "
                "sending features through shared memory instead (see stats.fallbacks)",
                RuntimeWarning,
                stacklevel=3,
            )
        # NOTE: a device tensor is copied straight into the shared-memory slot (no .cpu() first).
        return self.fallback.put(tensor, readers=readers)

    def reclaim(self) -> int:
        """Free slices whose readers all acknowledged, died, or were cancelled; the count."""
        freed = self._book.reclaim()
        self.stats.freed += freed
        return freed

    def cancel(self, handle: PoolHandle | ShmHandle) -> None:
        """The request was dropped: readers that never opened the feature release it."""
        if isinstance(handle, ShmHandle):
            self.fallback.cancel(handle)
        elif self._book.cancel(handle.slot, handle.gen):
            self.reclaim()

    def close(self) -> None:
        self._control.unlink()
        if self._own_fallback:
            self.fallback.close()
        close = getattr(self.backing, "close", None)
        if close is not None:
            close()

    def __enter__(self) -> FeaturePool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@functools.lru_cache(maxsize=16)
def _open_pool(store: tuple, control: str) -> tuple[torch.Tensor, LeaseTable]:
    # Opened once per pool per consumer process: the IPC mapping is costly, slices are cheap.
    if store[0] == "host":
        seg = Segment.attach(store[1])
        flat = torch.frombuffer(seg.mm, dtype=torch.uint8)
    elif store[0] == "cuda":
        rebuild, args = store[1], store[2]
        flat = rebuild(*args)
    else:
        raise ValueError(f"unknown pool store kind {store[0]!r}")
    ctl = Segment.attach(control)
    return flat, LeaseTable(memoryview(ctl.mm), create=False)


def open_feature(handle: PoolHandle | ShmHandle) -> torch.Tensor:
    """A view of the feature; a `PoolHandle` reader must `ack` once done with it."""
    if isinstance(handle, ShmHandle):
        return open_shared(handle)
    if not isinstance(handle, PoolHandle):
        raise ValueError(f"expected a PoolHandle or ShmHandle, got {type(handle).__name__}")
    flat, table = _open_pool(handle.store, handle.control)
    table.mark_open(handle.slot, handle.gen, handle.reader)
    view = flat[handle.offset : handle.offset + handle.nbytes]
    if handle.ready is not None:
        ready = torch.cuda.Event.from_ipc_handle(flat.device, handle.ready)
        torch.cuda.current_stream(flat.device).wait_event(ready)
    return view.view(_dtype_from_name(handle.dtype)).view(handle.shape)


def ack(handle: PoolHandle | ShmHandle, *, after: Any = None) -> None:
    """Reader done: the slice may be reused (`after`: a CUDA event ending the reads, waited)."""
    if isinstance(handle, ShmHandle):
        return  # shared-memory leases end when the views die
    if after is not None:
        after.synchronize()
    _, table = _open_pool(handle.store, handle.control)
    table.mark_released(handle.slot, handle.gen, handle.reader)
