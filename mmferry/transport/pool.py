"""`FeaturePool`: a bounded feature pool (device memory, or host memory) with a host fallback.

The producer copies a feature into a slice of one fixed-size store and sends a `PoolHandle`;
consumers open a view of the slice and `ack` when done. A slice is freed when every reader
acknowledged, died, or the request was cancelled. When no slice fits, the feature goes through
the shared-memory arena instead (counted in `stats.fallbacks`, warned once): nothing is lost and
nothing waits. The allocator and lease logic are the same for every backing store, so the CUDA
IPC store (`CudaBacking`) and the host store (`HostBacking`) share one code path.

On a CUDA store every hand-over is stream-ordered, never a host wait: the producer's copy into a
slice records an event that lives with the slice until it is reclaimed, consumers wait on it on
their stream, and `ack` ends a reader's lease only once its completion event has fired.
"""

from __future__ import annotations

import threading
import warnings
import weakref
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from mmferry.transport import attach
from mmferry.transport.handles import check_layout, check_lease, check_range
from mmferry.transport.leases import LeaseTable, check_shape, table_bytes
from mmferry.transport.segment import Segment, check_name
from mmferry.transport.shm import ShmArena, ShmHandle, open_shared
from mmferry.transport.slots import SlotBook
from mmferry.transport.store import (
    DeviceStore,
    keep_local,
    keep_local_event,
    open_store,
    ready_event,
)


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
        keep_local(self._export, self._store)

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
        check_shape(max_slots, max_readers)
        self.backing = backing
        self._store = backing.store()
        self._control = Segment.create(table_bytes(max_slots, max_readers))
        try:
            table = LeaseTable(
                memoryview(self._control.mm),
                self._control.fd,
                create=True,
                max_slots=max_slots,
                max_readers=max_readers,
                data_bytes=backing.capacity,
            )
        except BaseException:
            self._control.unlink()
            raise
        self._book = SlotBook(backing.capacity, table)
        self._own_fallback = fallback is None
        self._fallback = fallback
        self._lock = threading.Lock()
        self._warned = False
        self.stats = PoolStats()

    @property
    def fallback(self) -> ShmArena:
        """The arena that takes features the pool has no room for (made on first need)."""
        with self._lock:
            if self._fallback is None:
                self._fallback = ShmArena(
                    max(2 * self.backing.capacity, 64 << 20), on_full="inline"
                )
            return self._fallback

    @property
    def used_bytes(self) -> int:
        return self._book.used_bytes

    @property
    def live_slots(self) -> int:
        return self._book.live_slots

    def put(self, tensor: torch.Tensor, *, readers: int = 1) -> PoolHandle | ShmHandle:
        """Place `tensor` in the pool for `readers` consumers, or send it through shared memory."""
        self._book.check_put(tensor, readers)
        with self._lock:
            self.stats.puts += 1
        nbytes = tensor.numel() * tensor.element_size()
        ready: list[bytes] = []

        def fill(offset: int) -> torch.cuda.Event | None:
            dst = self._store[offset : offset + nbytes].view(tensor.dtype).view(tensor.shape)
            if not dst.is_cuda:
                dst.copy_(tensor.detach())
                return None
            # NOTE: the copy and its event go on the store device's current stream; the event
            # is kept with the slot (returned to the book) until the slot is reclaimed, so
            # every consumer that imports it finds it alive.
            with torch.cuda.device(dst.device):
                stream = torch.cuda.current_stream(dst.device)
                dst.copy_(tensor.detach(), non_blocking=True)
                event = torch.cuda.Event(interprocess=True)
                event.record(stream)
            ready.append(event.ipc_handle())
            keep_local_event(ready[-1], event)
            return event

        grant = self._book.put(nbytes, readers, fill) if nbytes else None
        if grant is None and nbytes and self.reclaim():
            grant = self._book.put(nbytes, readers, fill)
        if grant is None:
            return self._fall_back(tensor, readers)
        return PoolHandle(
            store=self.backing.export(),
            control=self._control.name,
            offset=grant.offset,
            nbytes=nbytes,
            shape=tuple(tensor.shape),
            dtype=str(tensor.dtype),
            slot=grant.slot,
            gen=grant.gen,
            readers=readers,
            ready=ready[0] if ready else None,
        )

    def _fall_back(self, tensor: torch.Tensor, readers: int) -> ShmHandle:
        with self._lock:
            self.stats.fallbacks += 1
            warn, self._warned = not self._warned, True
        if warn:
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
        if freed:
            with self._lock:
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
        if self._own_fallback and self._fallback is not None:
            self._fallback.close()
        close = getattr(self.backing, "close", None)
        if close is not None:
            close()

    def __enter__(self) -> FeaturePool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# -- consumer side -----------------------------------------------------------------------------


@dataclass
class _Lease:
    """A reader's open lease in this process: its bytes, its lease table and its ready event."""

    control: attach.Attachment
    data: torch.Tensor  # flat uint8: this reader's own copy-on-write pages, or a device slice
    ready: Any = None  # the imported ready event, alive until the lease ends
    device_store: torch.Tensor | None = None  # keeps the IPC import for the next lease


_LOCK = threading.Lock()
_HELD: dict[tuple, _Lease] = {}  # (control, slot, gen, reader) -> open lease
_PENDING: list[tuple[Any, tuple, _Lease]] = []  # (completion event, key, lease) after an ack


def _key(handle: PoolHandle) -> tuple:
    return (handle.control, handle.slot, handle.gen, handle.reader)


def _check(handle: PoolHandle) -> torch.dtype:
    if (
        not isinstance(handle.store, tuple)
        or not handle.store
        or handle.store[0]
        not in (
            "host",
            "cuda",
        )
    ):
        raise ValueError(f"unknown pool store {handle.store!r:.80} in handle")
    check_name(handle.control)
    check_lease(handle.slot, handle.gen, handle.reader, handle.readers)
    dtype = check_layout(handle.shape, handle.dtype, handle.nbytes)
    if handle.nbytes == 0:
        raise ValueError("a zero-byte pool handle is never issued: forged handle refused")
    return dtype


def settle_acks() -> int:
    """End the leases of acknowledged reads whose completion events have fired; the count."""
    done = 0
    with _LOCK:
        for item in list(_PENDING):
            event, key, lease = item
            if event.query():
                _PENDING.remove(item)
                lease.control.table.release(*key[1:])
                done += 1
    return done


def open_feature(handle: PoolHandle | ShmHandle) -> torch.Tensor:
    """A view of the feature; a `PoolHandle` reader must `ack` once done with it.

    Opening again before the `ack` returns a view of the same bytes under the same lease; after
    it, it raises. A reader's writes into its view stay its own: host-store and shared-memory
    views are copy-on-write mappings, and a CUDA slice read by several readers is copied for
    each on open (stream-ordered; a single reader gets the slice itself).
    """
    if isinstance(handle, ShmHandle):
        return open_shared(handle)
    if not isinstance(handle, PoolHandle):
        raise ValueError(f"expected a PoolHandle or ShmHandle, got {type(handle).__name__}")
    dtype = _check(handle)
    settle_acks()
    key = _key(handle)
    with _LOCK:
        lease = _HELD.get(key)
        if lease is None:
            control = attach.attachment(handle.control, with_data=False)
            store = open_store(handle.store)
            check_range(handle.offset, handle.nbytes, 0, min(control.data_bytes, store.nbytes))
            control.table.acquire(
                handle.slot, handle.gen, handle.reader, handle.offset, handle.nbytes
            )
            try:
                data = store.range(handle.offset, handle.nbytes)
                ready = None
                if handle.ready is not None:
                    ready = ready_event(data.device, handle.ready)
                    # Device-side ordering after the producer's copy: no host wait.
                    torch.cuda.current_stream(data.device).wait_event(ready)
                if data.is_cuda and handle.readers > 1:
                    # NOTE: device memory has no copy-on-write. Other readers read this slice,
                    # so this reader gets its own copy, queued after the producer's copy and
                    # before any read that `ack`'s completion event covers.
                    data = data.clone()
            except BaseException:
                control.table.release(handle.slot, handle.gen, handle.reader)
                raise
            kept = store.flat if isinstance(store, DeviceStore) else None
            lease = _HELD[key] = _Lease(control, data, ready, kept)
    return lease.data.view(dtype).view(handle.shape)


def ack(handle: PoolHandle | ShmHandle, *, after: Any = None) -> None:
    """Reader done: its lease ends once its reads have completed.

    On a CUDA store the completion is `after` (an event recorded after the reads) or, without
    it, an event recorded now on the current stream; the slice is released when that event has
    fired (checked by `settle_acks`, which every `open_feature` and `ack` call runs), never by
    a host wait. A reader that acks without opening declines its lease.
    """
    if isinstance(handle, ShmHandle):
        return  # shared-memory leases end when the views die
    if not isinstance(handle, PoolHandle):
        raise ValueError(f"expected a PoolHandle or ShmHandle, got {type(handle).__name__}")
    _check(handle)
    key = _key(handle)
    with _LOCK:
        lease = _HELD.pop(key, None)
        if lease is None:
            control = attach.attachment(handle.control, with_data=False)
            control.table.acquire(
                handle.slot, handle.gen, handle.reader, handle.offset, handle.nbytes
            )
            control.table.release(handle.slot, handle.gen, handle.reader)
            return
        if after is None and lease.data.is_cuda:
            after = torch.cuda.Event()
            after.record(torch.cuda.current_stream(lease.data.device))
        if after is None:
            lease.control.table.release(handle.slot, handle.gen, handle.reader)
            return
        _PENDING.append((after, key, lease))
    settle_acks()
