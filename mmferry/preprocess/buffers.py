"""Large preprocessing buffers: huge-page backed, and reused once their tensors are freed.

A fresh 100+ MB tensor costs more in first-touch page faults than in the arithmetic that fills
it (a 4000x3000 image's hf features are ~290 MB). Private anonymous mappings advised with
MADV_HUGEPAGE fault 2 MiB at a time instead of 4 KiB, which makes filling them several times
faster; on a virtual machine even those faults are slow and vary tenfold from call to call
(BENCHMARKS.md), because the host backs freshly touched guest memory.

So a buffer whose tensors have all been freed goes to a small cache and the next request of a
fitting size gets it back with its pages already present, as jemalloc and tcmalloc keep freed
pages for reuse. The cache is bounded two ways:
- in bytes (`MMFERRY_HOST_CACHE_MB`, default 2048; 0 turns it off): over the limit, the least
  recently freed go first;
- in time, in two steps, by a daemon thread (the reaper) that runs while the cache has buffers
  lent out or held: a buffer idle for `IDLE_SECONDS` has its pages handed to the kernel with
  MADV_FREE, and one idle for `KEEP_SECONDS` is unmapped.
The cache can add at most its limit to the process's peak memory, and only buffers that were
already in use a moment before.

Why MADV_FREE and not unmapping at `IDLE_SECONDS`: on a loaded virtual machine a fresh page
costs far more, and far more erratically, than writing it (290 MiB of fresh huge pages took
51-800 ms of CPU to fill, 4 KiB pages 148-453 ms, a mapping whose pages had been given
MADV_FREE 28-44 ms: docs/benchmarks/preprocess-intel.md), so a caller that pauses longer than
`IDLE_SECONDS` between items paid that every time. Pages given MADV_FREE still count in the
process's resident memory, as `LazyFree` in /proc/self/smaps, but the kernel takes them back
first, without swapping, whenever it needs memory; until it does, writing them again costs no
page fault (jemalloc's "muzzy" pages). A page the kernel took reads as zeros, which the
buffers' users never see: every byte of a buffer is written before it is read.
`release_host_cache()` empties it at once.

A tensor's storage is exactly its own bytes of the mapping (a memoryview slice, starting on a
2 MiB boundary), never the rest: torch.save, pickle and share_memory_ copy whole storages, and
the rest holds whatever an earlier item left there. The storage holds the slice alive, and so
does the storage's Python object, which lives as long as the storage: after share_memory_ has
moved the tensor into shared memory, an array taken earlier with `.numpy()` still reads the
old pages, and they stay lent until it is gone. Buffers under 4 MiB come from torch's
allocator and are held the same way, so share_memory_ cannot free them under an array either
(as it does a plain tensor's). Only when the slice is freed is the mapping handed back, by a
finalizer. A finalizer runs inside whatever allocation started a garbage
collection, also one made while its own thread holds the cache's lock, so it takes no lock and
never blocks: it appends the mapping to a queue, which the next `take` or the reaper drains.
"""

from __future__ import annotations

import collections
import contextlib
import math
import mmap
import os
import queue
import threading
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from mmferry.env import Env

# Below this, torch's allocator is as good (and small blocks are often recycled).
_HUGE_MIN_BYTES = 4 << 20
_HUGE_PAGE = 2 << 20
_CAN_ADVISE = hasattr(mmap, "MADV_HUGEPAGE") and hasattr(mmap, "MAP_PRIVATE")
IDLE_SECONDS = 10.0
# Idle this long, a lazily freed mapping is unmapped: its pages, if the kernel has not taken
# them, and its address space go back.
KEEP_SECONDS = 300.0
_CAN_FREE = hasattr(mmap, "MADV_FREE")
# A cached buffer serves requests down to 1/FIT of its size: a looser fit would hold pages
# that the tensor never uses.
_FIT = 1.25


@dataclass
class _Idle:
    mapping: mmap.mmap
    since: float
    lazy: bool = False  # its pages were given MADV_FREE


class HostBufferCache:
    """Mappings whose tensors are gone, kept for reuse (see the module docstring)."""

    def __init__(
        self,
        limit_bytes: int,
        idle_seconds: float = IDLE_SECONDS,
        keep_seconds: float = KEEP_SECONDS,
    ) -> None:
        self.limit_bytes = limit_bytes
        self.idle_seconds = idle_seconds
        self.keep_seconds = keep_seconds
        self._lock = threading.Lock()
        self._idle: list[_Idle] = []  # least recently freed first
        # NOTE: filled by finalizers, which may run inside any allocation of any thread, also
        # one holding `_lock`: they only append here and wake the reaper, never lock.
        self._returned: collections.deque[mmap.mmap] = collections.deque()
        self._wake: queue.SimpleQueue[None] = queue.SimpleQueue()
        self._lent = 0  # mappings whose tensors may still be alive
        # Mappings idle since before this are to be unmapped: also those out of `_idle` while
        # madvise runs on them, when a release came meanwhile.
        self._unmap_before = -math.inf
        self._reaper: threading.Thread | None = None
        self.hits = 0
        self.misses = 0

    @property
    def cached_bytes(self) -> int:
        self._settle()
        with self._lock:
            return sum(len(i.mapping) for i in self._idle)

    @property
    def lazy_bytes(self) -> int:
        """The bytes of the held mappings whose pages were given MADV_FREE."""
        self._settle()
        with self._lock:
            return sum(len(i.mapping) for i in self._idle if i.lazy)

    def take(self, size: int) -> mmap.mmap | None:
        """A cached mapping of `size` to `size * FIT` bytes (the smallest), or None."""
        self._settle()
        with self._lock:
            fits = [i for i in self._idle if size <= len(i.mapping) <= size * _FIT]
            if not fits:
                self.misses += 1
                return None
            best = min(fits, key=lambda i: len(i.mapping))
            self._idle.remove(best)
            self.hits += 1
            return best.mapping

    def lend(self, mapping: mmap.mmap, owner: object) -> None:
        """Take `mapping` back once `owner` (the memoryview its tensors hold) is gone."""
        # Not at exit: the process is going away with its mappings.
        weakref.finalize(owner, self.give, mapping).atexit = False
        with self._lock:
            self._lent += 1
            if self._reaper is None:
                self._reaper = threading.Thread(
                    target=self._reap, name="mmferry-host-cache", daemon=True
                )
                self._reaper.start()

    def give(self, mapping: mmap.mmap) -> None:
        """Hand back a mapping whose tensors are gone. Never blocks and takes no lock: it runs
        in finalizers, possibly inside an allocation made while this thread holds `_lock`."""
        self._returned.append(mapping)
        self._wake.put(None)

    def release(self, older_than: float = 0.0) -> int:
        """Unmap mappings idle for at least `older_than` seconds; returns the bytes freed."""
        freed = self._settle(older_than)
        self._wake.put(None)  # the reaper may have nothing left to wait for
        return freed

    def _settle(self, older_than: float | None = None, lazy_after: float | None = None) -> int:
        """Keep the mappings handed back since the last call (the least recently freed are
        closed past the byte limit), unmap those idle for `older_than` seconds and give
        MADV_FREE to the pages of those idle for `lazy_after`; returns the bytes unmapped."""
        dropped = []
        lazy: list[_Idle] = []
        with self._lock:
            now = time.monotonic()
            while self._returned:  # a finalizer may append meanwhile: taken now or next time
                mapping = self._returned.popleft()
                self._lent -= 1
                if len(mapping) > self.limit_bytes:
                    dropped.append(mapping)
                else:
                    self._idle.append(_Idle(mapping, now))
            total = sum(len(i.mapping) for i in self._idle)
            while total > self.limit_bytes:
                idle = self._idle.pop(0)
                dropped.append(idle.mapping)
                total -= len(idle.mapping)
            if older_than is not None:
                cutoff = now - older_than
                self._unmap_before = max(self._unmap_before, cutoff)
                dropped += [i.mapping for i in self._idle if i.since <= cutoff]
                self._idle = [i for i in self._idle if i.since > cutoff]
            if lazy_after is not None:
                cutoff = now - lazy_after
                # Out of the cache while madvise runs (outside the lock: it walks every
                # page): MADV_FREE on a page that a new owner had already written would let
                # the kernel drop what it wrote.
                lazy = [i for i in self._idle if not i.lazy and i.since <= cutoff]
                self._idle = [i for i in self._idle if i.lazy or i.since > cutoff]
        if lazy:
            failed = _free_lazily([i.mapping for i in lazy])
            dropped += failed
            with self._lock:
                for i in lazy:
                    if i.mapping in failed:  # unmapped below, as before
                        continue
                    if i.since <= self._unmap_before:  # a release came while it was out
                        dropped.append(i.mapping)
                    else:
                        i.lazy = True
                        self._idle.append(i)
                self._idle.sort(key=lambda i: i.since)
        freed = sum(len(m) for m in dropped)
        _close(dropped)
        return freed

    def _reap(self) -> None:
        # One daemon thread while the cache has lent or holds anything: it keeps what
        # finalizers hand back and releases what has been idle for `idle_seconds`.
        while True:
            self._settle(self.keep_seconds, lazy_after=self.idle_seconds)
            with self._lock:
                if not self._lent and not self._idle and not self._returned:
                    self._reaper = None
                    return
                due = [
                    i.since + (self.keep_seconds if i.lazy else self.idle_seconds)
                    for i in self._idle
                ]
            wait = min(due) - time.monotonic() if due else None
            with contextlib.suppress(queue.Empty):
                self._wake.get(timeout=None if wait is None else max(wait, 0.0))

    def _after_fork(self) -> None:
        # The child has no reaper thread and must not share a lock state with the parent;
        # tensors it inherited still hand their mappings back to it.
        self._lock = threading.Lock()
        self._wake = queue.SimpleQueue()
        self._reaper = None
        self._lent -= len(self._returned)
        self._returned.clear()
        self._idle = []


def _free_lazily(mappings: list[mmap.mmap]) -> list[mmap.mmap]:
    """MADV_FREE on each mapping's pages; returns those it could not be given to (a kernel
    before Linux 4.5, another system), to be unmapped as before."""
    failed = []
    for m in mappings:
        try:
            if not _CAN_FREE:
                raise OSError
            m.madvise(mmap.MADV_FREE)
        except (OSError, ValueError):
            failed.append(m)
    return failed


def _close(mappings: list[mmap.mmap]) -> None:
    for m in mappings:
        # A mapping handed back has no buffer left on it; were one left, the mapping goes
        # when it does (dropping ours is enough), and the reaper must not die of it.
        with contextlib.suppress(BufferError):
            m.close()


_cache = HostBufferCache(Env.read().host_cache_mb << 20)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_cache._after_fork)


def host_cache() -> HostBufferCache:
    """The process's cache of freed host buffers."""
    return _cache


def release_host_cache() -> int:
    """Release every cached host buffer now; returns the bytes released."""
    return _cache.release()


def _new_mapping(size: int) -> mmap.mmap | None:
    try:
        # NOTE: MAP_PRIVATE: shared anonymous memory is shmem, which THP usually skips.
        mm = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        mm.madvise(mmap.MADV_HUGEPAGE)
    except (OSError, ValueError):
        return None
    return mm


def empty_host(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised contiguous CPU tensor; huge-page backed (and recycled) when large."""
    numel = math.prod(shape)
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    pages = _huge_pages(nbytes) if nbytes >= _HUGE_MIN_BYTES and _CAN_ADVISE else None
    if pages is None:
        # torch's allocator, wrapped like the mappings (below) so that share_memory_ cannot
        # free it under an array either, as it does a plain tensor's.
        pages = torch.empty(nbytes, dtype=torch.uint8).numpy()
    t = torch.frombuffer(pages, dtype=dtype)
    # NOTE: share_memory_ swaps the storage's memory for a shared copy and lets go of `pages`,
    # while an array from `.numpy()` (holding only the tensor) still points into them. The
    # storage's Python object lives exactly as long as the storage does, so holding `pages`
    # there too keeps them (out of the cache) until no tensor or array is left.
    t.untyped_storage()._mmferry_pages = pages
    return t.view(shape)


def _huge_pages(nbytes: int) -> memoryview | None:
    """`nbytes` of a recycled or new huge-page mapping, from a 2 MiB boundary on; None when
    no mapping can be made."""
    # Room to start on a 2 MiB boundary, rounded to whole huge pages.
    size = -(-(nbytes + _HUGE_PAGE) // _HUGE_PAGE) * _HUGE_PAGE
    mm = _cache.take(size) if _cache.limit_bytes else None
    if mm is None:
        mm = _new_mapping(size)
        if mm is None:
            return None
    # Start on a 2 MiB boundary so every full huge page of the tensor can be backed by one.
    start = -_address(mm) % _HUGE_PAGE
    # NOTE: the storage gets exactly the tensor's bytes, not the whole mapping: torch.save,
    # pickle and share_memory_ copy a whole storage, which would carry the alignment slack and
    # whatever an earlier, larger item left in the rest of the mapping.
    view = memoryview(mm)[start : start + nbytes]
    if _cache.limit_bytes:
        # The storage holds `view`; when the last tensor on it is freed, so is `view`, and
        # only then does the mapping go back to the cache.
        _cache.lend(mm, view)
    return view


def _address(mm: mmap.mmap) -> int:
    # A mapping's address, read through a short-lived buffer export.
    return torch.frombuffer(mm, dtype=torch.uint8, count=1).data_ptr()


# -- sizing for items in flight together (preprocess/scheduler.py) ---------------------------


class _Sizing:
    """The cache's own limit and the byte counts that running batches asked it to keep."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.base: int | None = None
        self.asks: list[int] = []


_sizing = _Sizing()


@contextmanager
def ensure_host_cache(nbytes: int) -> Iterator[None]:
    """While the block runs, the cache keeps at least `nbytes` (when the cache is on).

    Items run in parallel each hold their own buffers at once; a cache smaller than those sets
    makes them evict each other's pages and fault fresh ones (a plain thread pool ran the hf
    layout at 0.58x on 2 threads until the cache held both threads' buffers). Concurrent
    blocks add up. After the last block the limit is the cache's own again, and what it holds
    beyond that goes at the next give over the limit or after `IDLE_SECONDS` idle.
    """
    with _sizing.lock:
        if _sizing.base is None:
            _sizing.base = _cache.limit_bytes
        if not _sizing.base or nbytes <= 0:
            nbytes = 0
        _sizing.asks.append(nbytes)
        _cache.limit_bytes = max(_sizing.base, sum(_sizing.asks))
    try:
        yield
    finally:
        with _sizing.lock:
            _sizing.asks.remove(nbytes)
            _cache.limit_bytes = max(_sizing.base, sum(_sizing.asks))
            if not _sizing.asks:
                _sizing.base = None
