"""`Worker`: one daemon thread running calls in turn, for store calls that may never return.

A Mooncake call to a store cut off mid-call neither answers nor fails for minutes, and a
`ThreadPoolExecutor`'s threads are joined when the interpreter exits: one such call would
keep a drained process alive. A `Worker` is an `Executor` (so `loop.run_in_executor` takes
it) whose thread is a daemon and whose `shutdown` waits at most a deadline.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any

_STOP = None  # queued last by shutdown: the thread ends when it takes it


class Worker(Executor):
    """Calls run one at a time, in order, on one daemon thread named `name`."""

    def __init__(self, name: str) -> None:
        self._queue: queue.SimpleQueue[tuple[Future, Callable, tuple, dict] | None] = (
            queue.SimpleQueue()
        )
        self._lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future:
        with self._lock:
            if self._closed:
                raise RuntimeError("the worker is shut down")
            f: Future = Future()
            self._queue.put((f, fn, args, kwargs))
        return f

    def _run(self) -> None:
        while (job := self._queue.get()) is not _STOP:
            f, fn, args, kwargs = job
            if not f.set_running_or_notify_cancel():
                continue
            try:
                result = fn(*args, **kwargs)
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                f.set_exception(e)
            else:
                f.set_result(result)

    def shutdown(
        self, wait: bool = True, *, cancel_futures: bool = False, timeout: float | None = None
    ) -> bool:
        """Take no more calls (cancelling those not started with `cancel_futures`); with
        `wait`, wait for the thread to finish the rest, at most `timeout` seconds. Whether
        the thread has finished: a call still running past the timeout is left to it."""
        with self._lock:
            self._closed = True
            if cancel_futures:
                self._cancel_queued()
            self._queue.put(_STOP)
        if wait:
            self._thread.join(timeout)
        return not self._thread.is_alive()

    def cancel_pending(self) -> int:
        """Cancel the calls not started yet; how many were."""
        with self._lock:
            return self._cancel_queued()

    def _cancel_queued(self) -> int:
        """(under the lock) Cancel the queued calls, keeping a queued stop; how many were."""
        cancelled = 0
        stops = 0
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                break
            if job is _STOP:
                stops += 1
            elif job[0].cancel():
                cancelled += 1
        for _ in range(stops):
            self._queue.put(_STOP)
        return cancelled
