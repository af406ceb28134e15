"""`LeaseTable`: per-slot reader records in shared memory, written without locks.

Every word has exactly one writer: the producer writes a slot's generation, reader count and
cancel mark; reader `r` of a slot writes only its own record `(pid, opened_gen, released_gen)`.
The producer alone decides when a slot is free, so no cross-process atomics are needed.
"""

from __future__ import annotations

import os

import numpy as np

MAGIC = 0x6D6D666572727931  # "mmferry1"
HEADER_WORDS = 4
SLOT_WORDS = 3  # gen, readers, cancelled_gen
READER_WORDS = 3  # pid, opened_gen, released_gen


def table_bytes(max_slots: int, max_readers: int) -> int:
    words = HEADER_WORDS + max_slots * (SLOT_WORDS + READER_WORDS * max_readers)
    return words * 8


def pid_alive(pid: int) -> bool:
    """False for a process that has exited, including an unreaped zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
        return state not in (b"Z", b"X")
    except FileNotFoundError:
        return False
    except OSError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class LeaseTable:
    """Shared lease words over `buf`: `max_slots` slots of up to `max_readers` readers each."""

    def __init__(self, buf: memoryview, *, create: bool, max_slots: int = 0, max_readers: int = 0):
        head = np.frombuffer(buf, dtype=np.int64, count=HEADER_WORDS)
        if create:
            head[:] = (MAGIC, max_slots, max_readers, 0)
        elif int(head[0]) != MAGIC:
            raise ValueError("shared-memory segment does not hold an mmferry lease table")
        self.max_slots = int(head[1])
        self.max_readers = int(head[2])
        stride = SLOT_WORDS + READER_WORDS * self.max_readers
        words = np.frombuffer(
            buf, dtype=np.int64, count=self.max_slots * stride, offset=HEADER_WORDS * 8
        )
        self._slots = words.reshape(self.max_slots, stride)  # [slots, 3 + 3*readers]
        if create:
            self._slots[:] = 0

    # -- producer side -------------------------------------------------------------------------
    def grant(self, slot: int, gen: int, readers: int) -> None:
        if not 1 <= readers <= self.max_readers:
            raise ValueError(f"readers must be in 1..{self.max_readers}, got {readers}")
        row = self._slots[slot]
        row[SLOT_WORDS:] = 0
        row[1] = readers
        row[2] = 0
        row[0] = gen  # NOTE: written last; a consumer checks it before trusting the slot

    def cancel(self, slot: int, gen: int) -> None:
        """Readers that have not opened the slot will never need it."""
        self._slots[slot, 2] = gen

    def reclaimable(self, slot: int, gen: int) -> bool:
        """True when every reader released, died, or (after a cancel) never opened."""
        row = self._slots[slot]
        cancelled = int(row[2]) == gen
        for r in range(int(row[1])):
            pid, opened, released = (
                int(x) for x in row[SLOT_WORDS + 3 * r : SLOT_WORDS + 3 * r + 3]
            )
            if released == gen:
                continue
            if opened == gen:
                if pid_alive(pid):
                    return False
                continue
            if not cancelled:
                return False
        return True

    # -- consumer side -------------------------------------------------------------------------
    def mark_open(self, slot: int, gen: int, reader: int) -> None:
        row = self._slots[slot]
        if not 0 <= reader < int(row[1]):
            raise ValueError(f"reader {reader} out of range for a slot of {int(row[1])} readers")
        base = SLOT_WORDS + 3 * reader
        row[base] = os.getpid()
        row[base + 1] = gen
        # NOTE: re-checked after marking, so a slot cancelled or reused meanwhile is refused.
        if int(row[0]) != gen or int(row[2]) == gen:
            row[base + 1] = 0
            raise ValueError(
                f"lease for slot {slot} generation {gen} has expired (cancelled or reclaimed)"
            )

    def mark_released(self, slot: int, gen: int, reader: int) -> None:
        self._slots[slot, SLOT_WORDS + 3 * reader + 2] = gen
