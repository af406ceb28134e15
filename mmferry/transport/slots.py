"""`SlotBook`: the producer's ledger of leased byte ranges in one region (arena or pool).

It pairs a `RangeAllocator` (where the bytes are) with a `LeaseTable` (who still reads them) and
owns the whole life of a range: taken with a free slot, filled, granted to its readers under a
fresh generation, and returned only when the table says every reader released, died, or was
cancelled. Thread-safe: the ledger is changed under one lock; fills run outside it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from mmferry.transport.alloc import RangeAllocator
from mmferry.transport.leases import LeaseTable


@dataclass(frozen=True)
class Grant:
    """Where a put landed: its slot, byte offset in the region, and generation."""

    slot: int
    offset: int
    gen: int


class SlotBook:
    def __init__(self, capacity: int, table: LeaseTable) -> None:
        self.alloc = RangeAllocator(capacity)
        self.table = table
        self._lock = threading.Lock()
        self._free_slots = list(range(table.max_slots - 1, -1, -1))
        # slot -> (gen, offset, keep): `keep` is whatever the fill returned that must live as
        # long as the slot (a device pool's ready event), dropped when the slot is reclaimed.
        self._live: dict[int, tuple[int, int, object]] = {}
        self._gen = 0

    @property
    def live_slots(self) -> int:
        return len(self._live)

    @property
    def used_bytes(self) -> int:
        with self._lock:
            return self.alloc.used_bytes

    def check_put(self, tensor: object, readers: int) -> None:
        """The arguments of a put: a tensor, and a reader count the lease table can record."""
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"put expects a torch.Tensor, got {type(tensor).__name__}")
        if type(readers) is not int or not 1 <= readers <= self.table.max_readers:
            raise ValueError(f"readers must be in 1..{self.table.max_readers}, got {readers!r}")

    def put(self, nbytes: int, readers: int, fill: Callable[[int], object]) -> Grant | None:
        """Take a range of `nbytes`, `fill(offset)` it, grant it; None when there is no room now.

        A fill that raises gives the range back: nobody holds a handle to it yet.
        """
        with self._lock:
            if not self._free_slots:
                return None
            offset = self.alloc.alloc(nbytes)
            if offset is None:
                return None
            slot = self._free_slots.pop()
        try:
            keep = fill(offset)
        except BaseException:
            with self._lock:
                self.alloc.free(offset)
                self._free_slots.append(slot)
            raise
        with self._lock:
            self._gen += 1
            self.table.grant(slot, self._gen, readers, offset, nbytes)
            self._live[slot] = (self._gen, offset, keep)
            return Grant(slot, offset, self._gen)

    def reclaim(self) -> int:
        """Free every range whose readers all released, died, or were cancelled; the count."""
        freed = 0
        with self._lock:
            for slot, (gen, offset, _keep) in list(self._live.items()):
                if self.table.reclaimable(slot, gen):
                    del self._live[slot]
                    self.alloc.free(offset)
                    self._free_slots.append(slot)
                    freed += 1
        return freed

    def cancel(self, slot: int, gen: int) -> bool:
        """Mark a live range's unopened readers as gone; False when it is no longer live."""
        with self._lock:
            if self._live.get(slot, (None,))[0] != gen:
                return False
            self.table.cancel(slot, gen)
            return True
