"""A long-lived pool that preprocesses whole items for many callers at once (the service).

The batch API (batch.py) schedules one call's items; a service receives many requests, each a
small batch, and its threads must stay within one bound across all of them. `ItemPool` keeps
`threads` worker threads and one queue:
- requests are served first come, first served (`group`, a number that grows per request), and
  a request's items largest first, so its last item to finish is a small one;
- an item gets `threads // (items not yet finished, queued ones included)` threads when it
  starts (at least one), passed to the job: a lone large item on an idle pool splits its own
  resize and gather, and under load every item runs on one thread, so the sum stays within
  `threads`;
- each running item asks the host buffer cache to keep its own buffers
  (`buffers.ensure_host_cache`; concurrent asks add up), so items in flight reuse pages rather
  than evict each other's.
A job is `job(threads) -> result`, its future a `concurrent.futures.Future` (asyncio callers
wrap it); a future cancelled before its item starts is skipped.
"""

from __future__ import annotations

import heapq
import itertools
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

from mmferry.preprocess.buffers import ensure_host_cache
from mmferry.preprocess.threads import intra_op_threads, no_extra_thread

T = TypeVar("T")


class ItemPool:
    """`threads` worker threads running submitted items (see the module docstring)."""

    def __init__(self, threads: int, name: str = "mmferry-preprocess") -> None:
        if threads < 1:
            raise ValueError(f"threads must be at least 1, got {threads}")
        self.threads = threads
        self._cond = threading.Condition()
        self._queue: list[tuple[int, int, int, Callable[[int], Any], int, Future]] = []
        self._order = itertools.count()
        self._unfinished = 0
        self._closed = False
        self._workers = [
            threading.Thread(target=self._work, name=f"{name}-{k}", daemon=True)
            for k in range(threads)
        ]
        for t in self._workers:
            t.start()

    def submit(self, job: Callable[[int], T], *, group: int, size: int | None) -> Future[T]:
        """Queue `job`; `group` orders callers (lower first), `size` (host bytes the item
        holds, None if unknown: first) orders a group's items, largest first."""
        future: Future[T] = Future()
        with self._cond:
            if self._closed:
                raise RuntimeError("the preprocessing pool is shut down")
            rank = -(1 << 62) if size is None else -size
            entry = (group, rank, next(self._order), job, size or 0, future)
            heapq.heappush(self._queue, entry)
            self._unfinished += 1
            self._cond.notify()
        return future

    def shutdown(self) -> None:
        """Run what is queued, then stop the threads and wait for them."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        for t in self._workers:
            t.join()

    def _work(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:
                    return
                *_, job, size, future = heapq.heappop(self._queue)
                share = max(1, self.threads // self._unfinished)
            try:
                if future.set_running_or_notify_cancel():
                    try:
                        # NOTE: torch ops the job does not size itself run on one thread: a
                        # pool thread that runs an OpenMP team keeps that team's threads (and
                        # their memory) for its life. The job sizes its resize and gather.
                        with intra_op_threads(1), no_extra_thread(), ensure_host_cache(size):
                            result = job(share)
                    except BaseException as e:  # noqa: BLE001 - the caller's to handle
                        future.set_exception(e)
                    else:
                        future.set_result(result)
            finally:
                with self._cond:
                    self._unfinished -= 1
