"""`RangeAllocator`: best-fit byte ranges in a fixed-capacity region, free ranges merged."""

from __future__ import annotations

import bisect


class RangeAllocator:
    """Hands out aligned `[offset, offset + size)` ranges of a region of `capacity` bytes."""

    def __init__(self, capacity: int, *, align: int = 256) -> None:
        if capacity <= 0 or align <= 0 or align & (align - 1):
            raise ValueError(
                f"capacity must be > 0 and align a power of two, got {capacity}, {align}"
            )
        self.capacity = capacity
        self.align = align
        # NOTE: free ranges are sorted by offset, disjoint and never adjacent (merged on free).
        self._free: list[tuple[int, int]] = [(0, capacity)]
        self._used: dict[int, int] = {}

    def _round(self, nbytes: int) -> int:
        return max(self.align, (nbytes + self.align - 1) // self.align * self.align)

    def alloc(self, nbytes: int) -> int | None:
        """Offset of a new range of at least `nbytes`, or None when no free range fits."""
        size = self._round(nbytes)
        best = None
        for i, (_off, length) in enumerate(self._free):
            if length >= size and (best is None or length < self._free[best][1]):
                best = i
        if best is None:
            return None
        off, length = self._free[best]
        if length == size:
            del self._free[best]
        else:
            self._free[best] = (off + size, length - size)
        self._used[off] = size
        return off

    def free(self, offset: int) -> None:
        """Return the range starting at `offset`; neighbours are merged."""
        size = self._used.pop(offset, None)
        if size is None:
            raise ValueError(f"offset {offset} is not an allocated range")
        i = bisect.bisect_left(self._free, (offset, 0))
        self._free.insert(i, (offset, size))
        if i + 1 < len(self._free) and offset + size == self._free[i + 1][0]:
            self._free[i] = (offset, size + self._free[i + 1][1])
            del self._free[i + 1]
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == offset:
            prev_off, prev_len = self._free[i - 1]
            self._free[i - 1] = (prev_off, prev_len + self._free[i][1])
            del self._free[i]

    def fits_ever(self, nbytes: int) -> bool:
        return self._round(nbytes) <= self.capacity

    @property
    def used_bytes(self) -> int:
        return sum(self._used.values())
