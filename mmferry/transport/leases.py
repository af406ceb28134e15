"""`LeaseTable`: per-slot reader records in shared memory, plus one liveness lock per reader.

Every word has exactly one writer: the producer writes a slot's generation, reader count, cancel
mark and byte range; reader `r` of a slot writes only its own `(opened_gen, released_gen)`. A
reader holds the lock on its record's byte (see `locks.py`) from before it marks the record open
until after it marks it released, so "opened, not released, not locked" means the reader died.
The producer alone decides when a slot is free, so no cross-process atomics are needed: every
decision that races a reader is ordered by the lock calls, which the kernel serialises.
"""

from __future__ import annotations

import numpy as np

from mmferry.transport import locks

MAGIC = 0x6D6D666572727932  # "mmferry2"
HEADER_WORDS = 8  # magic, max_slots, max_readers, data_offset, data_bytes, (reserved x3)
SLOT_WORDS = 5  # gen, readers, cancelled_gen, offset, nbytes
READER_WORDS = 2  # opened_gen, released_gen
MAX_SLOTS = 1 << 20
MAX_READERS = 1 << 10


def table_bytes(max_slots: int, max_readers: int) -> int:
    words = HEADER_WORDS + max_slots * (SLOT_WORDS + READER_WORDS * max_readers)
    return words * 8


def check_shape(max_slots: object, max_readers: object) -> None:
    """Refuse table sizes that cannot be laid out (before any segment is created)."""
    for name, v, hi in (
        ("max_slots", max_slots, MAX_SLOTS),
        ("max_readers", max_readers, MAX_READERS),
    ):
        if type(v) is not int or not 1 <= v <= hi:
            raise ValueError(f"{name} must be an int in 1..{hi}, got {v!r}")


class LeaseExpired(ValueError):
    """The lease a handle names is gone: cancelled, reclaimed, or already used by this reader."""


class LeaseTable:
    """Shared lease words over `buf`; liveness locks taken through the descriptor `fd`."""

    def __init__(
        self,
        buf: memoryview,
        fd: int,
        *,
        create: bool,
        max_slots: int = 0,
        max_readers: int = 0,
        data_offset: int = 0,
        data_bytes: int = 0,
    ) -> None:
        head = np.frombuffer(buf, dtype=np.int64, count=HEADER_WORDS)
        if create:
            check_shape(max_slots, max_readers)
            head[:] = (MAGIC, max_slots, max_readers, data_offset, data_bytes, 0, 0, 0)
        self.max_slots, self.max_readers, self.data_offset, self.data_bytes = check_header(
            head, len(buf)
        )
        self.fd = fd
        stride = SLOT_WORDS + READER_WORDS * self.max_readers
        words = np.frombuffer(
            buf, dtype=np.int64, count=self.max_slots * stride, offset=HEADER_WORDS * 8
        )
        self._slots = words.reshape(self.max_slots, stride)  # [slots, 5 + 2*readers]
        if create:
            self._slots[:] = 0

    def _lock_index(self, slot: int, reader: int) -> int:
        return slot * self.max_readers + reader

    # -- producer side -------------------------------------------------------------------------
    def grant(self, slot: int, gen: int, readers: int, offset: int, nbytes: int) -> None:
        if not 1 <= readers <= self.max_readers:
            raise ValueError(f"readers must be in 1..{self.max_readers}, got {readers}")
        row = self._slots[slot]
        # NOTE: reader records are compared with the generation, never reset: a record left by
        # an older generation reads as "not opened" for this one.
        row[1] = readers
        row[3] = offset
        row[4] = nbytes
        row[0] = gen  # written last; a reader checks it (under its lock) before trusting the rest

    def cancel(self, slot: int, gen: int) -> None:
        """Readers that have not opened the slot will never need it."""
        self._slots[slot, 2] = gen

    def reclaimable(self, slot: int, gen: int) -> bool:
        """True when every reader released, died, or (after a cancel) never opened."""
        row = self._slots[slot]
        cancelled = int(row[2]) == gen
        for r in range(int(row[1])):
            base = SLOT_WORDS + READER_WORDS * r
            if int(row[base + 1]) == gen:
                continue  # released
            # NOTE: read "opened" before probing the lock. A reader that locks after the probe
            # sees the cancel mark (stored before the probe) or this generation's records and
            # refuses; one that locked before it is seen as live.
            opened = int(row[base]) == gen
            if locks.is_locked(self.fd, self._lock_index(slot, r)):
                return False
            if opened or cancelled:
                continue  # died while reading, or will never read
            return False
        return True

    # -- consumer side -------------------------------------------------------------------------
    def acquire(self, slot: int, gen: int, reader: int, offset: int, nbytes: int) -> None:
        """Open reader `reader`'s lease on `slot` (once), or raise; the caller then maps it."""
        if not (0 <= slot < self.max_slots and 0 <= reader < self.max_readers):
            raise ValueError(
                f"slot {slot} / reader {reader} outside this table "
                f"({self.max_slots} slots, {self.max_readers} readers)"
            )
        index = self._lock_index(slot, reader)
        if not locks.try_lock(self.fd, index):
            raise LeaseExpired(
                f"reader {reader} of slot {slot} is open elsewhere: a handle opens once per reader"
            )
        try:
            row = self._slots[slot]
            base = SLOT_WORDS + READER_WORDS * reader
            if int(row[base]) == gen or int(row[base + 1]) == gen:
                raise LeaseExpired(
                    f"lease for slot {slot} generation {gen} has expired: reader {reader} already "
                    "opened and released it (a handle opens once per reader)"
                )
            if int(row[0]) != gen or int(row[2]) == gen:
                raise LeaseExpired(
                    f"lease for slot {slot} generation {gen} has expired (cancelled or reclaimed)"
                )
            if (int(row[3]), int(row[4])) != (offset, nbytes) or reader >= int(row[1]):
                raise ValueError(
                    f"handle for slot {slot} does not match the producer's record "
                    f"(offset {offset}, {nbytes} bytes, reader {reader}): refusing to map it"
                )
            row[base] = gen
        except BaseException:
            locks.unlock(self.fd, index)
            raise

    def release(self, slot: int, gen: int, reader: int) -> None:
        """Close an acquired lease: marked released, then the liveness lock dropped."""
        self._slots[slot, SLOT_WORDS + READER_WORDS * reader + 1] = gen
        locks.unlock(self.fd, self._lock_index(slot, reader))


def check_header(head: np.ndarray, table_len: int) -> tuple[int, int, int, int]:
    """(max_slots, max_readers, data_offset, data_bytes) from a header, checked, or ValueError."""
    if int(head[0]) != MAGIC:
        raise ValueError("shared-memory segment does not hold an mmferry lease table")
    max_slots, max_readers, data_offset, data_bytes = (int(x) for x in head[1:5])
    check_shape(max_slots, max_readers)
    if table_bytes(max_slots, max_readers) > table_len or data_offset < 0 or data_bytes < 0:
        raise ValueError("mmferry lease table header does not match its segment")
    return max_slots, max_readers, data_offset, data_bytes
