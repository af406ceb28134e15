"""Many items at once: images and videos preprocessed in parallel, returned in input order.

Each item runs whole on one worker thread: decode (Pillow releases the GIL while it decodes),
resize (a torch op), patch rows (the compiled kernel, called through ctypes) and the key
(blake3) all run without the GIL, so items on different threads run on different cores, and
a descheduled thread delays only its own item (no barrier to spin at, unlike intra-op threads,
see threads.py).

Scheduling, within `threads` threads in all:
- items start largest first (their size read from the header, videos first), so the last to
  finish is a small item and no core idles behind one large one at the end;
- an item gets `threads // (items not yet finished)` threads when it starts (at least one): a
  batch of fewer items than threads splits each item's own resize and gather, as a single
  `proc.image(..., threads=n)` does, and the sum over running items never exceeds `threads`;
- the key is hashed on the item's own thread (no `alongside` thread): the other items keep the
  cores busy, and the thread count stays within `threads`.
The host buffer cache is sized for the items in flight (`buffers.ensure_host_cache`), so
parallel items reuse recycled pages instead of faulting fresh ones.

Errors name the item's index (`ItemError`). By default the first failure stops the batch:
items not yet started are skipped, running ones finish, and the error of the lowest failed
index among the items that ran is raised. With `partial=True` every item runs and a failed
one's place holds its `ItemError`, so one bad item does not lose the others.
"""

from __future__ import annotations

import io
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial as partial_fn
from typing import Any, Literal, TypeVar, overload

from PIL import Image

from mmferry.config import ProcessorConfig
from mmferry.env import Env
from mmferry.items import Layout, MultimodalItem
from mmferry.preprocess.buffers import ensure_host_cache
from mmferry.preprocess.image import check_layout, process_image
from mmferry.preprocess.resize import smart_resize
from mmferry.preprocess.threads import intra_op_threads, no_extra_thread, preprocess_threads
from mmferry.preprocess.video import process_video


@dataclass(frozen=True)
class ImagePart:
    """One image of a mixed batch (any source `proc.image` takes)."""

    source: Any


@dataclass(frozen=True)
class VideoPart:
    """One video of a mixed batch, with `proc.video`'s per-video options."""

    source: Any
    fps: float | None = None
    num_frames: int | None = None
    source_fps: float | None = None


Part = ImagePart | VideoPart
T = TypeVar("T")


class ItemError(ValueError):
    """Item `index` of a batch could not be preprocessed; `error` is what it raised."""

    def __init__(self, index: int, error: BaseException) -> None:
        super().__init__(f"item {index}: {error}")
        self.index = index
        self.error = error

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.index, self.error))


def batch_threads(threads: int | None) -> int:
    """Threads a batch uses: the argument, `MMFERRY_PREPROCESS_THREADS`, or the cores this
    process may run on.

    NOTE: not the per-item default of one (threads.py): whole items on threads are coarse
    work with no barrier, so a core taken by another tenant slows one item, not all."""
    if threads is not None or Env.read().preprocess_threads:
        return preprocess_threads(threads)
    cores = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    return max(1, len(cores) if cores else os.cpu_count() or 1)


def _header_size(source: Any) -> tuple[int, int] | None:
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


def item_bytes(part: Part, cfg: ProcessorConfig, layout: Layout) -> int | None:
    """Host buffer bytes an image item holds while it runs (decode, resize, rows); None for
    videos and unknown sizes."""
    if not isinstance(part, ImagePart):
        return None
    size = _header_size(part.source)
    if size is None:
        return None
    h, w = size
    try:
        rh, rw = smart_resize(
            h,
            w,
            factor=cfg.factor,
            min_pixels=cfg.image_min_pixels,
            max_pixels=cfg.image_max_pixels,
        )
    except ValueError:
        return None
    row_bytes = 4 * cfg.temporal_patch_size * 3 if layout == "hf" else 3
    # Decoded pixels (4 bytes each for a JPEG), resized pixels (4 bytes), then the rows.
    return 4 * h * w + 4 * rh * rw + row_bytes * rh * rw


def _run_part(part: Part, cfg: ProcessorConfig, layout: Layout, threads: int) -> MultimodalItem:
    if isinstance(part, VideoPart):
        return process_video(
            part.source,
            cfg,
            layout=layout,
            fps=part.fps,
            num_frames=part.num_frames,
            source_fps=part.source_fps,
            threads=threads,
        )
    return process_image(part.source, cfg, layout=layout, threads=threads)


class _Schedule:
    """Which item a worker runs next and on how many threads (see the module docstring)."""

    def __init__(self, order: list[int], threads: int, stop_on_error: bool) -> None:
        self._lock = threading.Lock()
        self._order = order
        self._next = 0
        self._running = 0
        self._threads = threads
        self._stop_on_error = stop_on_error
        self.stopped = False

    def take(self) -> tuple[int, int] | None:
        """(item index, its threads), or None when nothing is left to start."""
        with self._lock:
            if self.stopped or self._next == len(self._order):
                return None
            index = self._order[self._next]
            self._next += 1
            self._running += 1
            unfinished = self._running + len(self._order) - self._next
            # NOTE: `unfinished` only falls, so items started earlier hold no more than this
            # share each, and the shares of the running items add up to at most `threads`.
            return index, max(1, self._threads // unfinished)

    def stop(self) -> None:
        """Nothing more starts (an interrupt)."""
        self.stopped = True

    def done(self, failed: bool) -> None:
        with self._lock:
            self._running -= 1
            if failed and self._stop_on_error:
                self.stopped = True


def run_jobs(
    jobs: Sequence[Callable[[int], T]],
    sizes: Sequence[int | None],
    threads: int,
    *,
    stop_on_error: bool,
) -> list[T | BaseException | None]:
    """`jobs[i](its threads)` for every i, whole jobs on up to `threads` threads, largest
    `sizes` first (None: before all); each place holds the job's result or the exception it
    raised (None: not started, after an error with `stop_on_error`)."""
    results: list[T | BaseException | None] = [None] * len(jobs)
    if not jobs:
        return results
    # Largest first; videos and unknown sizes before all: they are usually the longest.
    order = sorted(range(len(jobs)), key=lambda i: -(1 << 62 if sizes[i] is None else sizes[i]))
    schedule = _Schedule(order, threads, stop_on_error)
    fatal: list[BaseException] = []

    def worker() -> None:
        while (job := schedule.take()) is not None:
            index, share = job
            failed = True
            try:
                with intra_op_threads(share), no_extra_thread():
                    results[index] = jobs[index](share)
                failed = False
            except Exception as e:  # noqa: BLE001 - the job's own failure, kept at its index
                results[index] = e
            except BaseException as e:  # KeyboardInterrupt, SystemExit: the whole batch stops
                fatal.append(e)
                schedule.stop()
            finally:
                schedule.done(failed)

    workers = min(threads, len(jobs))
    # The items in flight at once hold their buffers together: the cache keeps that many.
    known = sorted((s for s in sizes if s is not None), reverse=True)
    with ensure_host_cache(sum(known[:workers])):
        _run_workers(worker, workers, schedule.stop)
    if fatal:
        raise fatal[0]
    return results


@overload
def process_batch(
    parts: Sequence[Part],
    cfg: ProcessorConfig,
    *,
    layout: Layout = ...,
    threads: int | None = ...,
    partial: Literal[False] = ...,
) -> list[MultimodalItem]: ...


@overload
def process_batch(
    parts: Sequence[Part],
    cfg: ProcessorConfig,
    *,
    layout: Layout = ...,
    threads: int | None = ...,
    partial: Literal[True],
) -> list[MultimodalItem | ItemError]: ...


def process_batch(
    parts: Sequence[Part],
    cfg: ProcessorConfig,
    *,
    layout: Layout = "hf",
    threads: int | None = None,
    partial: bool = False,
) -> list[MultimodalItem] | list[MultimodalItem | ItemError]:
    """Every part preprocessed, in parallel on up to `threads` threads, in input order."""
    check_layout(layout)
    for i, part in enumerate(parts):
        if not isinstance(part, (ImagePart, VideoPart)):
            raise TypeError(f"item {i}: expected ImagePart or VideoPart, got {type(part).__name__}")
    total = batch_threads(threads)
    jobs = [partial_fn(_run_part, part, cfg, layout) for part in parts]
    sizes = [item_bytes(p, cfg, layout) for p in parts]
    raw = run_jobs(jobs, sizes, total, stop_on_error=not partial)
    results = [ItemError(i, r) if isinstance(r, BaseException) else r for i, r in enumerate(raw)]
    errors = [r for r in results if isinstance(r, ItemError)]
    if errors and not partial:
        first = min(errors, key=lambda e: e.index)
        if isinstance(first.error, ValueError):
            raise first from first.error
        # Not a bad input (a bug, MemoryError): raised as it is, with the index noted.
        if hasattr(first.error, "add_note"):
            first.error.add_note(f"(item {first.index} of the batch)")
        raise first.error
    return results  # type: ignore[return-value]


def _run_workers(worker: Callable[[], None], count: int, stop: Callable[[], None]) -> None:
    """`worker` on `count` threads, the calling thread one of them; returns when all end.

    An interrupt (Ctrl-C) in the calling thread calls `stop` and is raised only once every
    worker has returned: the running items finish, nothing more starts. NOTE: a thread still in
    native code (a torch op, a decode) when the interpreter exits is torn down mid-call, which
    can abort the process."""
    ended = [threading.Event() for _ in range(count - 1)]

    def run(event: threading.Event) -> None:
        try:
            worker()
        finally:
            event.set()

    for k, event in enumerate(ended):
        threading.Thread(target=run, args=(event,), name=f"mmferry-batch-{k}", daemon=True).start()
    interrupt: BaseException | None = None
    try:
        worker()
    except BaseException as e:  # noqa: BLE001 - raised below, once the other workers returned
        interrupt = e
    # NOTE: not Thread.join: a join interrupted by a signal marks the thread ended while it
    # still runs (CPython 3.11 releases the thread's lock on the way out), and the next join
    # returns at once. An Event can be waited on again.
    while ended:
        try:
            while ended:
                ended[-1].wait()
                ended.pop()
        except BaseException as e:  # noqa: BLE001 - a signal during the wait: wait on
            interrupt = interrupt or e
            stop()
    if interrupt is not None:
        raise interrupt
