"""`SlotBook`: the producer's ledger of leased byte ranges in one region (arena or pool).

It pairs a `RangeAllocator` (where the bytes are) with a `LeaseTable` (who still reads them):
a range is taken with a free slot, granted to its readers under a fresh generation, and returned
only when the table says every reader released, died, or was cancelled.
"""

from __future__ import annotations

import torch

from mmferry.transport.alloc import RangeAllocator
from mmferry.transport.leases import LeaseTable


class SlotBook:
    def __init__(self, capacity: int, table: LeaseTable) -> None:
        self.alloc = RangeAllocator(capacity)
        self.table = table
        self._free_slots = list(range(table.max_slots - 1, -1, -1))
        self._live: dict[int, tuple[int, int]] = {}  # slot -> (gen, offset)
        self._gen = 0

    @property
    def live_slots(self) -> int:
        return len(self._live)

    def check_put(self, tensor: object, readers: int) -> None:
        """The arguments of a put: a tensor, and a reader count the lease table can record."""
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"put expects a torch.Tensor, got {type(tensor).__name__}")
        if not 1 <= readers <= self.table.max_readers:
            raise ValueError(f"readers must be in 1..{self.table.max_readers}, got {readers}")

    def take(self, nbytes: int) -> tuple[int, int] | None:
        """(slot, offset) of a free range of `nbytes`, or None when there is no room now."""
        if not self._free_slots:
            return None
        offset = self.alloc.alloc(nbytes)
        return None if offset is None else (self._free_slots.pop(), offset)

    def untake(self, slot: int, offset: int) -> None:
        """Give back a range taken but never granted (its fill failed)."""
        self.alloc.free(offset)
        self._free_slots.append(slot)

    def grant(self, slot: int, offset: int, readers: int) -> int:
        """Publish a filled range to `readers` consumers; its generation."""
        self._gen += 1
        self.table.grant(slot, self._gen, readers)
        self._live[slot] = (self._gen, offset)
        return self._gen

    def reclaim(self) -> int:
        """Free every range whose readers all released, died, or were cancelled; the count."""
        freed = 0
        for slot, (gen, offset) in list(self._live.items()):
            if self.table.reclaimable(slot, gen):
                del self._live[slot]
                self.alloc.free(offset)
                self._free_slots.append(slot)
                freed += 1
        return freed

    def cancel(self, slot: int, gen: int) -> bool:
        """Mark a live range's unopened readers as gone; False when it is no longer live."""
        if self._live.get(slot, (None,))[0] != gen:
            return False
        self.table.cancel(slot, gen)
        return True
