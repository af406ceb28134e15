"""One scheduler for preprocessing: whole items on threads, largest first, within a thread bound.

The batch API (batch.py: one call's items, on threads the call starts) and the service's pool
(item_pool.py: many requests' items, on long-lived threads) both queue their items here, so
they share every rule:
- order: callers first come, first served (`group`, lower first), a caller's items largest
  first (`item_bytes`; unknown sizes, usually videos or files not read yet, before all), so
  a caller's last item to finish is a small one and no core idles behind a large one;
- threads: `threads` in all, held by the running items. An item starts only when one is
  free and takes `threads // (items not yet finished)` of them (at least one, at most those
  free) for its own resize and gather. An item keeps its share until it ends, and a newcomer
  waits for a free thread, so the threads running at once never exceed `threads`, also when
  items arrive while others run (handing out shares without counting what running items
  hold let a 4-thread pool run 7: [4, 1, 1, 1]);
- inside a job, torch's intra-op count is 1 and `alongside` is off (`no_extra_thread`): the
  job sizes its own parallel work from its share (threads.py), any other torch op runs on
  the job's thread alone, and a long-lived thread that ran one OpenMP team of `share` threads
  does not keep it for every later op;
- memory: a running item asks the host buffer cache to keep its own bytes
  (`buffers.ensure_host_cache`; concurrent asks add up), so the items in flight reuse pages
  rather than evict each other's.
"""

from __future__ import annotations

import heapq
import io
import itertools
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from PIL import Image

from mmferry.config import ProcessorConfig
from mmferry.items import Layout
from mmferry.preprocess.buffers import ensure_host_cache
from mmferry.preprocess.resize import smart_resize
from mmferry.preprocess.threads import intra_op_threads, no_extra_thread

T = TypeVar("T")


def header_size(source: Any) -> tuple[int, int] | None:
    """(height, width) of an image source, from its header where it has one; None if unknown
    (a file-like object is not read twice; a bad source fails later, when it runs)."""
    try:
        if isinstance(source, Image.Image):
            return source.height, source.width
        if isinstance(source, (bytes, bytearray, memoryview)):
            with Image.open(io.BytesIO(source)) as im:
                return im.height, im.width
        if isinstance(source, (str, os.PathLike)):
            with Image.open(source) as im:
                return im.height, im.width
        shape = getattr(source, "shape", None)
        if shape is not None and len(shape) == 3:
            # HWC arrays, CHW tensors
            return (shape[0], shape[1]) if not hasattr(source, "permute") else tuple(shape[1:])
    except Exception:  # noqa: BLE001 - any unreadable source is reported when it is processed
        return None
    return None


def image_bytes(
    height: int, width: int, cfg: ProcessorConfig, layout: Layout, max_pixels: int | None = None
) -> int | None:
    """Host buffer bytes an image of this size holds while it runs (decode, resize, rows);
    None past `max_pixels` (default: `cfg.max_decoded_pixels`) or for a size the resize
    refuses.

    NOTE: the limit applies before the size is used: a header that claims more pixels than
    will ever be decoded must not raise the buffer cache to its size."""
    limit = cfg.max_decoded_pixels if max_pixels is None else max_pixels
    if height * width > limit:
        return None
    try:
        rh, rw = smart_resize(
            height,
            width,
            factor=cfg.factor,
            min_pixels=cfg.image_min_pixels,
            max_pixels=cfg.image_max_pixels,
        )
    except ValueError:
        return None
    row_bytes = 4 * cfg.temporal_patch_size * 3 if layout == "hf" else 3
    # Decoded pixels (4 bytes each for a JPEG), resized pixels (4 bytes), then the rows.
    return 4 * height * width + 4 * rh * rw + row_bytes * rh * rw


def source_bytes(
    source: Any, cfg: ProcessorConfig, layout: Layout, max_pixels: int | None = None
) -> int | None:
    """`image_bytes` of an image source, from its header; None if unknown or over the limit."""
    size = header_size(source)
    return None if size is None else image_bytes(*size, cfg, layout, max_pixels)


@dataclass(order=True)
class _Queued:
    group: int
    rank: int  # minus the size: largest first
    seq: int  # then in the order put
    job: Callable[[int], Any] = field(compare=False)
    size: int = field(compare=False)
    tag: Any = field(compare=False)


@dataclass(frozen=True)
class Started(Generic[T]):
    """An item taken to run: its job, the threads it holds, its bytes and the caller's tag."""

    job: Callable[[int], T]
    share: int
    size: int
    tag: Any


class Scheduler:
    """Queued items, started in order within `threads` threads (see the module docstring).

    The caller owns the worker threads: each loops `take`, `run`, `done` until `take` returns
    None (closed and nothing queued)."""

    def __init__(self, threads: int) -> None:
        if threads < 1:
            raise ValueError(f"threads must be at least 1, got {threads}")
        self.threads = threads
        self._cond = threading.Condition()
        self._queue: list[_Queued] = []
        self._seq = itertools.count()
        self._free = threads
        self._running = 0
        self._closed = False

    def put(self, job: Callable[[int], Any], *, group: int, size: int | None, tag: Any) -> None:
        """Queue `job` (`job(threads) -> result`); `size`: host bytes it holds, None if
        unknown (then first in its group)."""
        rank = -(1 << 62) if size is None else -size
        with self._cond:
            if self._closed:
                raise RuntimeError("the scheduler is closed")
            heapq.heappush(self._queue, _Queued(group, rank, next(self._seq), job, size or 0, tag))
            self._cond.notify()

    def close(self) -> None:
        """Nothing more is put; `take` returns None once the queue is empty."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def stop(self) -> list[Any]:
        """Nothing more starts: the queue is dropped (returns the tags) and closed."""
        with self._cond:
            dropped = [q.tag for q in self._queue]
            self._queue.clear()
            self._closed = True
            self._cond.notify_all()
        return dropped

    def take(self) -> Started[Any] | None:
        """The next item with its share, once one is queued and a thread is free; None once
        closed and empty."""
        with self._cond:
            while not (self._queue and self._free) and not (self._closed and not self._queue):
                self._cond.wait()
            if not self._queue:
                return None
            unfinished = self._running + len(self._queue)
            # NOTE: at most the threads free: running items keep theirs until they end.
            share = max(1, min(self._free, self.threads // unfinished))
            queued = heapq.heappop(self._queue)
            self._free -= share
            self._running += 1
        return Started(queued.job, share, queued.size, queued.tag)

    def done(self, started: Started[Any]) -> None:
        """`started` ended (or was skipped): its threads are free again."""
        with self._cond:
            self._free += started.share
            self._running -= 1
            self._cond.notify_all()

    @staticmethod
    def run(started: Started[T]) -> T:
        """The job on this thread with its share, under the rules every job runs by."""
        with intra_op_threads(1), no_extra_thread(), ensure_host_cache(started.size):
            return started.job(started.share)
