"""SIGINT and SIGTERM in a command: raised as `Interrupted`, or recorded where a block must
finish.

`Interrupted` is a KeyboardInterrupt, so every `except KeyboardInterrupt` handles it, but of its
own class. NOTE: CPython marks the process as ended by an unhandled Ctrl-C when a plain
KeyboardInterrupt leaves code compiled from a string (`exec`/`eval`: a dataclass or namedtuple
being built during a lazy import), even when a caller handles it afterwards; under `python -m`
the process then kills itself with SIGINT instead of returning the command's status. Only the
exact class KeyboardInterrupt is marked, so a command that raises its own never is.
"""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterator
from contextlib import contextmanager

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM arrived (`signum`)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextmanager
def raised_interrupts() -> Iterator[None]:
    """Inside the block SIGINT and SIGTERM raise `Interrupted` (SIGTERM then runs the same
    cleanup as Ctrl-C). Main thread only (Python's signal handlers live there)."""

    def interrupt(signum: int, frame: object) -> None:
        raise Interrupted(signum)

    with _handlers(interrupt):
        yield


@contextmanager
def recorded_interrupts() -> Iterator[list[int]]:
    """SIGINT and SIGTERM appended to the yielded list instead of acted on, inside the block.
    Main thread only."""
    caught: list[int] = []
    with _handlers(lambda signum, frame: caught.append(signum)):
        yield caught


@contextmanager
def _handlers(handler: Callable[[int, object], None]) -> Iterator[None]:
    previous = [signal.getsignal(s) for s in SIGNALS]
    try:
        for s in SIGNALS:
            signal.signal(s, handler)
        yield
    finally:
        # NOTE: once the first handler is back, its signal can raise before the second is: it
        # is caught, both are put back (again), and only then is it raised. Before the first
        # is back, the new handlers are in place, so nothing stops this block before its `try`.
        interrupted: KeyboardInterrupt | None = None
        while True:
            try:
                for s, h in zip(SIGNALS, previous):
                    if h is not None:  # None: installed outside Python, cannot be put back
                        signal.signal(s, h)
                break
            except KeyboardInterrupt as e:
                interrupted = e
        if interrupted is not None:
            raise interrupted
