"""How many threads preprocessing uses, and running its work on them.

NOTE: on a shared host, torch's intra-op pool hurts small and fine-grained work: its workers
spin at every op's barrier and a descheduled worker stalls the op (a 0.7 ms resize took
20-30 ms with two threads on a loaded 2-core host). So preprocessing runs small items on one
thread, splits large gathers into a few coarse ranges of bands on plain Python threads (torch
ops and the compiled kernel release the GIL), and gives the resize, one large op, the intra-op
threads.

The count is the `threads=` argument of `process_image` / `process_video`, else the
`MMFERRY_PREPROCESS_THREADS` environment variable, else 1. One is the measured default for
shared hosts: on a shared 2-core host, two threads ran the 16-image benchmark at 0.87-1.41x
the speed of one (medians of two runs, BENCHMARKS.md), a gain only while the other tenants
left a core free, and at 0.91-0.95x once the compiled kernel made the gather cheap. On a
dedicated host, set the count to its free cores.

One exception, whatever the count: a large item's hash (`alongside`) runs on one extra thread
beside its resize (when the key does not need the resize) and its patchify gather, then is
joined before the item is returned. It is one coarse
task with no barrier to spin at (blake3 releases the GIL for the whole buffer), so a
descheduled hash thread delays only the join, never the gather; items under
`PARALLEL_MIN_BYTES` are hashed inline, and no thread outlives the call.

A batch (batch.py) and the service's pool (item_pool.py) run whole items on their threads
instead, by one scheduler (scheduler.py): each job runs its own torch ops on one intra-op
thread, with the exception turned off (`no_extra_thread`), and sizes its resize and gather by
the share of threads it holds, so their thread count stays within their `threads`. torch's
intra-op count is per thread under OpenMP (a worker starts at the default, not the caller's),
so each job sets its own.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from contextvars import ContextVar
from typing import TypeVar

import torch

from mmferry.env import Env

T = TypeVar("T")

ENV_THREADS = "MMFERRY_PREPROCESS_THREADS"
DEFAULT_THREADS = 1
# Below this many output bytes an item runs on one thread: waking workers costs more.
PARALLEL_MIN_BYTES = 4 << 20
# False on a batch's worker threads (preprocess/batch.py): `alongside` runs its work inline.
# A ContextVar, so the setting is the thread's own and other callers keep the extra thread.
_EXTRA_THREAD: ContextVar[bool] = ContextVar("mmferry_extra_thread", default=True)


def preprocess_threads(threads: int | None = None) -> int:
    """The thread count for a preprocessing call: the argument, the env variable, or a default."""
    if threads is None:
        return Env.read().preprocess_threads or DEFAULT_THREADS
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ValueError(f"threads must be a positive integer, got {threads!r}")
    return threads


def threads_for(nbytes: int, threads: int) -> int:
    """Threads worth using for work that writes `nbytes`."""
    return 1 if nbytes < PARALLEL_MIN_BYTES else threads


@contextmanager
def intra_op_threads(n: int) -> Iterator[None]:
    """torch's intra-op thread count set to `n` for the block, then restored.

    NOTE: the count is process-wide; concurrent preprocessing calls should pass the same n.
    """
    before = torch.get_num_threads()
    if before == n:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def run_split(n_items: int, threads: int, work: Callable[[int, int], None]) -> None:
    """`work(start, stop)` over `range(n_items)` in up to `threads` contiguous ranges."""
    parts = max(1, min(threads, n_items))
    bounds = [n_items * k // parts for k in range(parts + 1)]
    # NOTE: each range runs torch ops with one intra-op thread; parallelism comes from here.
    if parts == 1:
        with intra_op_threads(1):
            work(0, n_items)
        return
    with intra_op_threads(1), ThreadPoolExecutor(parts - 1) as pool:
        futures = [pool.submit(work, a, b) for a, b in zip(bounds[1:-1], bounds[2:])]
        work(bounds[0], bounds[1])
        for f in futures:
            f.result()


@contextmanager
def no_extra_thread() -> Iterator[None]:
    """Within the block, on this thread, `alongside` runs its work inline: a batch's items
    keep the cores busy, and its thread count stays within its `threads`."""
    token = _EXTRA_THREAD.set(False)
    try:
        yield
    finally:
        _EXTRA_THREAD.reset(token)


@contextmanager
def alongside(fn: Callable[[], T], nbytes: int) -> Iterator[Callable[[], T]]:
    """`fn()` on one extra thread while the block runs; the yielded callable joins and returns
    its result (or raises its error).

    Work reading fewer than `PARALLEL_MIN_BYTES` runs inline before the block: a thread would
    cost more than it hides. Leaving the block, by an error too, waits for `fn` to finish, so
    no work outlives the call and the buffers it reads stay valid while it runs.
    """
    if nbytes < PARALLEL_MIN_BYTES or not _EXTRA_THREAD.get():
        value = fn()
        yield lambda: value
        return
    # NOTE: a pool per call rather than a shared one: concurrent calls never queue behind each
    # other's hashes, and no thread is left alive to be forked or torn down at exit.
    with ThreadPoolExecutor(1, thread_name_prefix="mmferry-alongside") as pool:
        yield pool.submit(fn).result
