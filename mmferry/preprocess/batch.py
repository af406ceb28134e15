"""Many items at once: images and videos preprocessed in parallel, returned in input order.

Each item runs whole on one worker thread: decode (Pillow releases the GIL while it decodes),
resize (a torch op), patch rows (the compiled kernel, called through ctypes) and the key
(blake3) all run without the GIL, so items on different threads run on different cores, and
a descheduled thread delays only its own item (no barrier to spin at, unlike intra-op threads,
see threads.py).

Scheduling is the service's too (scheduler.py): items start largest first (their size read
from the header, videos first), so the last to finish is a small item; an item takes
`threads // (items not yet finished)` of the free threads when it starts (at least one), so a
batch of fewer items than threads splits each item's own resize and gather, as a single
`proc.image(..., threads=n)` does, and the threads running at once never exceed `threads`; the
key is hashed on the item's own thread (no `alongside` thread); each running item asks the host
buffer cache for its own bytes, so parallel items reuse recycled pages instead of faulting
fresh ones.

Errors name the item's index (`ItemError`). By default the first failure stops the batch:
items not yet started are skipped, running ones finish, and the error of the lowest failed
index among the items that ran is raised. With `partial=True` every item runs and a failed
one's place holds its `ItemError`, so one bad item does not lose the others.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial as partial_fn
from typing import Any, Literal, TypeVar, overload

from mmferry.config import ProcessorConfig
from mmferry.env import Env
from mmferry.items import Layout, MultimodalItem
from mmferry.preprocess.image import check_layout, process_image
from mmferry.preprocess.scheduler import Scheduler, source_bytes
from mmferry.preprocess.threads import preprocess_threads
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


def item_bytes(part: Part, cfg: ProcessorConfig, layout: Layout) -> int | None:
    """Host buffer bytes an image item holds while it runs (scheduler.py); None for videos,
    unknown sizes and sizes over the decode limit."""
    if not isinstance(part, ImagePart):
        return None
    return source_bytes(part.source, cfg, layout)


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


def run_jobs(
    jobs: Sequence[Callable[[int], T]],
    sizes: Sequence[int | None],
    threads: int,
    *,
    stop_on_error: bool,
) -> list[T | BaseException | None]:
    """`jobs[i](its threads)` for every i, whole jobs on up to `threads` threads, largest
    `sizes` first (None: before all), by the scheduler's rules; each place holds the job's
    result or the exception it raised (None: not started, after an error with
    `stop_on_error`)."""
    results: list[T | BaseException | None] = [None] * len(jobs)
    if not jobs:
        return results
    schedule = Scheduler(threads)
    for i, job in enumerate(jobs):
        schedule.put(job, group=0, size=sizes[i], tag=i)
    schedule.close()
    fatal: list[BaseException] = []

    def worker() -> None:
        while (started := schedule.take()) is not None:
            failed = True
            try:
                results[started.tag] = schedule.run(started)
                failed = False
            except Exception as e:  # noqa: BLE001 - the job's own failure, kept at its index
                results[started.tag] = e
            except BaseException as e:  # KeyboardInterrupt, SystemExit: the whole batch stops
                fatal.append(e)
                schedule.stop()
            finally:
                schedule.done(started)
                if failed and stop_on_error:
                    schedule.stop()

    _run_workers(worker, min(threads, len(jobs)), schedule.stop)
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


def _run_workers(worker: Callable[[], None], count: int, stop: Callable[[], object]) -> None:
    """`worker` on `count` threads, the calling thread one of them; returns once every thread
    started has returned from `worker`.

    An interrupt (Ctrl-C) in the calling thread, wherever it lands (while the threads start
    too), calls `stop` and is raised only once no worker is inside a job: the running items
    finish, nothing more starts. NOTE: a thread still in native code (a torch op, a decode)
    when the interpreter exits is torn down mid-call: CPython ends a daemon thread that wants
    the GIL back once finalization began, and inside a torch call (its GIL guard's destructor)
    that aborts the process ("terminate called without an active exception")."""
    idle = threading.Condition()
    working = entered = started = 0  # threads inside `worker`; that entered it; started

    def run() -> None:
        nonlocal working, entered
        with idle:
            working += 1
            entered += 1
        try:
            worker()
        finally:
            with idle:
                working -= 1
                idle.notify_all()

    interrupt: BaseException | None = None
    try:
        # NOTE: inside the try: an interrupt between two starts must still wait for the
        # threads already started. One started but not counted (the interrupt landed as its
        # start returned) finds the schedule stopped and takes no job, and one that took a job
        # is counted in `working`, so waiting for `working` alone is enough then.
        for k in range(count - 1):
            threading.Thread(target=run, name=f"mmferry-batch-{k}", daemon=True).start()
            started += 1
        worker()
    except BaseException as e:  # noqa: BLE001 - raised below, once no worker is in a job
        interrupt = e
    # NOTE: a Condition, not Thread.join: a join interrupted by a signal marks the thread
    # ended while it still runs (CPython 3.11 releases the thread's lock on the way out), and
    # the next join returns at once. A Condition can be waited on again.
    while True:
        try:
            if interrupt is not None:
                stop()
            with idle:
                while working or entered < started:
                    idle.wait()
            break
        except BaseException as e:  # noqa: BLE001 - a signal during the wait: stop, wait on
            interrupt = interrupt or e
    if interrupt is not None:
        raise interrupt
