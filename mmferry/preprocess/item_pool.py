"""A long-lived pool that preprocesses whole items for many callers at once (the service).

The batch API (batch.py) runs one call's items on threads it starts; a service receives many
requests, each a small batch, and its threads must stay within one bound across all of them.
`ItemPool` keeps `threads` worker threads on one `Scheduler` (scheduler.py), the batch API's
own: requests first come, first served (`group`, a number that grows per request), a request's
items largest first, each item holding `threads // (items not yet finished)` of the free
threads until it ends (so an item arriving while a lone item holds every thread waits for
one), torch ops on one intra-op thread inside a job, and each running item asking the host
buffer cache for its own bytes.
A job is `job(threads) -> result`, its future a `concurrent.futures.Future` (asyncio callers
wrap it); a future cancelled before its item starts is skipped.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

from mmferry.preprocess.scheduler import Scheduler

T = TypeVar("T")


class ItemPool:
    """`threads` worker threads running submitted items (see the module docstring)."""

    def __init__(self, threads: int, name: str = "mmferry-preprocess") -> None:
        self._schedule = Scheduler(threads)
        self.threads = threads
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
        try:
            self._schedule.put(job, group=group, size=size, tag=future)
        except RuntimeError:
            raise RuntimeError("the preprocessing pool is shut down") from None
        return future

    def shutdown(self) -> None:
        """Run what is queued, then stop the threads and wait for them."""
        self._schedule.close()
        for t in self._workers:
            t.join()

    def _work(self) -> None:
        while (started := self._schedule.take()) is not None:
            future: Future = started.tag
            try:
                if future.set_running_or_notify_cancel():
                    try:
                        result = self._schedule.run(started)
                    except BaseException as e:  # noqa: BLE001 - the caller's to handle
                        future.set_exception(e)
                    else:
                        future.set_result(result)
            finally:
                self._schedule.done(started)
