"""`Worker`: the store's one-thread executor, whose stuck call neither outlives its shutdown
deadline nor keeps the process from exiting."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time

from mmferry.store.worker import Worker


def test_calls_run_in_order_and_shutdown_waits_for_them():
    w = Worker("t")
    seen: list[int] = []
    futures = [w.submit(seen.append, i) for i in range(5)]
    assert w.shutdown(timeout=5)
    assert seen == [0, 1, 2, 3, 4] and all(f.done() for f in futures)


def test_a_stuck_call_costs_shutdown_its_timeout_and_the_rest_are_cancelled():
    release = threading.Event()
    w = Worker("t")
    stuck = w.submit(release.wait)
    queued = [w.submit(time.sleep, 0) for _ in range(3)]
    t = time.monotonic()
    assert not w.shutdown(timeout=0.3)
    assert 0.3 <= time.monotonic() - t < 2
    assert w.cancel_pending() == 3 and all(f.cancelled() for f in queued)
    release.set()
    assert stuck.result(5) is True


def test_a_stuck_call_does_not_keep_the_process_alive():
    # A ThreadPoolExecutor's thread would be joined at exit: this would never end.
    code = textwrap.dedent(
        """
        import threading
        from mmferry.store.worker import Worker
        w = Worker("t")
        w.submit(threading.Event().wait)
        print("stopping", w.shutdown(timeout=0.1), flush=True)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and out.stdout.strip() == "stopping False", out
