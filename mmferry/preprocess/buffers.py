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
- in time: buffers idle for `IDLE_SECONDS` are released, by a timer while any are held.
The cache can add at most its limit to the process's peak memory, and only buffers that were
already in use a moment before.
`release_host_cache()` empties it at once. The tensor holds its mapping alive; only when the
last view of it is gone can the mapping be handed out again.
"""

from __future__ import annotations

import math
import mmap
import os
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
# A cached buffer serves requests down to 1/FIT of its size: a looser fit would hold pages
# that the tensor never uses.
_FIT = 1.25


@dataclass
class _Idle:
    mapping: mmap.mmap
    since: float


class HostBufferCache:
    """Mappings whose tensors are gone, kept for reuse (see the module docstring)."""

    def __init__(self, limit_bytes: int, idle_seconds: float = IDLE_SECONDS) -> None:
        self.limit_bytes = limit_bytes
        self.idle_seconds = idle_seconds
        self._lock = threading.Lock()
        self._idle: list[_Idle] = []  # least recently freed first
        self._timer: threading.Timer | None = None
        self.hits = 0
        self.misses = 0

    @property
    def cached_bytes(self) -> int:
        with self._lock:
            return sum(len(i.mapping) for i in self._idle)

    def take(self, size: int) -> mmap.mmap | None:
        """A cached mapping of `size` to `size * FIT` bytes (the smallest), or None."""
        with self._lock:
            fits = [i for i in self._idle if size <= len(i.mapping) <= size * _FIT]
            if not fits:
                self.misses += 1
                return None
            best = min(fits, key=lambda i: len(i.mapping))
            self._idle.remove(best)
            self.hits += 1
            return best.mapping

    def give(self, mapping: mmap.mmap) -> None:
        """Keep a mapping whose tensors are gone, or release it when over the limit."""
        if len(mapping) > self.limit_bytes:
            _close([mapping])
            return
        with self._lock:
            self._idle.append(_Idle(mapping, time.monotonic()))
            dropped = []
            total = sum(len(i.mapping) for i in self._idle)
            while total > self.limit_bytes:
                idle = self._idle.pop(0)
                dropped.append(idle.mapping)
                total -= len(idle.mapping)
            self._arm_timer()
        _close(dropped)

    def release(self, older_than: float = 0.0) -> int:
        """Release mappings idle for at least `older_than` seconds; returns the bytes freed."""
        cutoff = time.monotonic() - older_than
        with self._lock:
            dropped = [i.mapping for i in self._idle if i.since <= cutoff]
            self._idle = [i for i in self._idle if i.since > cutoff]
            self._arm_timer()
        freed = sum(len(m) for m in dropped)
        _close(dropped)
        return freed

    def _arm_timer(self) -> None:
        # Called with the lock held: one daemon timer while anything is cached.
        if not self._idle or self._timer is not None:
            return
        self._timer = threading.Timer(self.idle_seconds, self._expire)
        self._timer.daemon = True
        self._timer.start()

    def _expire(self) -> None:
        with self._lock:
            self._timer = None
        self.release(self.idle_seconds)

    def _after_fork(self) -> None:
        # The child has no timer thread and must not share a lock state with the parent.
        self._lock = threading.Lock()
        self._timer = None
        self._idle = []


def _close(mappings: list[mmap.mmap]) -> None:
    for m in mappings:
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
    if nbytes < _HUGE_MIN_BYTES or not _CAN_ADVISE:
        return torch.empty(shape, dtype=dtype)
    # Room to start on a 2 MiB boundary, rounded to whole huge pages.
    size = -(-(nbytes + _HUGE_PAGE) // _HUGE_PAGE) * _HUGE_PAGE
    mm = _cache.take(size) if _cache.limit_bytes else None
    if mm is None:
        mm = _new_mapping(size)
        if mm is None:
            return torch.empty(shape, dtype=dtype)
    view = memoryview(mm)
    if _cache.limit_bytes:
        # The tensor's storage holds `view`; when the last tensor on it is freed, so is
        # `view`, and only then does the mapping go back to the cache.
        # Not at exit: the process is going away with its mappings.
        weakref.finalize(view, _cache.give, mm).atexit = False
    raw = torch.frombuffer(view, dtype=torch.uint8)
    # Start on a 2 MiB boundary so every full huge page of the tensor can be backed by one.
    start = -raw.data_ptr() % _HUGE_PAGE
    return raw[start : start + nbytes].view(dtype).view(shape)


# -- sizing for items in flight together (preprocess/batch.py) ---------------------------------


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
