"""What every test of the suite may assume of its process."""

from __future__ import annotations

import signal


def pytest_configure(config: object) -> None:
    # A background job of a non-interactive shell (`make test &` in a script) starts with SIGINT
    # ignored, and Python keeps an inherited SIG_IGN rather than install its own handler; the
    # tests that send SIGINT, and the processes they start (which inherit it), need Python's
    # handler, as a run in the foreground has (tests/test_sigint_inherited.py).
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
