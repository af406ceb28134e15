"""The service's preprocessing pool: items of many callers, first come first served, a
caller's largest first, within one thread bound."""

from __future__ import annotations

import threading
from concurrent.futures import CancelledError

import pytest
import torch
from PIL import Image

import mmferry as mf
from mmferry.preprocess import buffers
from mmferry.preprocess.item_pool import ItemPool

from .conftest import encode, gradient
from .running import RunningThreads

PROC = mf.Processor.for_model("qwen3-vl")


def _held(pool: ItemPool) -> threading.Event:
    """Occupy every thread of `pool` until the returned event is set."""
    release, started = threading.Event(), threading.Barrier(pool.threads + 1)

    def hold(_threads: int) -> None:
        started.wait(10)
        release.wait(10)

    for _ in range(pool.threads):
        pool.submit(hold, group=-1, size=None)
    started.wait(10)
    return release


def test_items_of_concurrent_callers_equal_the_per_item_path():
    jpegs = [
        encode(Image.fromarray(gradient(h, w, seed=i)), "JPEG", quality=90)
        for i, (h, w) in enumerate([(900, 700), (48, 64), (333, 517), (640, 480), (70, 90)])
    ]
    pool = ItemPool(2)
    try:
        futures = [
            pool.submit(
                lambda t, d=data: PROC.image(d, "compact-u8", threads=t), group=g, size=None
            )
            for g, data in enumerate(jpegs)
        ]
        for future, data in zip(futures, jpegs):
            got, want = future.result(60), PROC.image(data, "compact-u8")
            assert got.hash == want.hash and got.grid_thw == want.grid_thw
            assert torch.equal(got.feature, want.feature)
    finally:
        pool.shutdown()


def test_callers_first_come_first_served_and_largest_first():
    pool = ItemPool(1)
    ran: list[str] = []
    release = _held(pool)
    jobs = [
        ("late small", 2, 10),
        ("early small", 1, 10),
        ("early big", 1, 99),
        ("late ?", 2, None),
    ]
    futures = [
        pool.submit(lambda _t, n=name: ran.append(n), group=g, size=size) for name, g, size in jobs
    ]
    release.set()
    for f in futures:
        f.result(10)
    pool.shutdown()
    # Unknown sizes go first in their group: usually videos or files not read yet.
    assert ran == ["early big", "early small", "late ?", "late small"]


def test_threads_running_at_once_stay_within_the_pool_when_items_arrive():
    """A lone item gets every thread; items arriving while it runs must not add threads of
    their own on top (a 4-thread pool ran 7: shares [4, 1, 1, 1])."""
    pool = ItemPool(4)
    running = RunningThreads()
    lone_started, others_started = threading.Event(), threading.Event()
    started: list[int] = []

    def lone(share: int) -> tuple[int, int]:
        lone_started.set()
        intra_op = torch.get_num_threads()
        # Holds its threads until the later items run beside it (or 1.5 s).
        running.job(share, others_started, 1.5)
        return share, intra_op

    def later(share: int) -> int:
        with running.lock:
            started.append(share)
            if len(started) == 3:
                others_started.set()
        return running.job(share, threading.Event(), 0.05)

    try:
        alone = pool.submit(lone, group=0, size=None)
        assert lone_started.wait(10)
        queued = [pool.submit(later, group=1, size=None) for _ in range(3)]
        # A lone item is given every thread to split its own work; torch ops it does not size
        # itself run on one.
        assert alone.result(10) == (4, 1)
        shares = [f.result(10) for f in queued]
    finally:
        pool.shutdown()
    assert min(shares) >= 1
    assert running.peak <= 4, f"{running.peak} threads ran at once on a 4-thread pool"


def test_a_cancelled_item_never_runs_and_a_failed_one_keeps_the_pool():
    pool = ItemPool(1)
    ran: list[int] = []
    release = _held(pool)
    cancelled = pool.submit(lambda t: ran.append(1), group=0, size=None)
    failing = pool.submit(lambda t: 1 / 0, group=0, size=None)
    after = pool.submit(lambda t: ran.append(2) or "ok", group=0, size=None)
    assert cancelled.cancel()
    release.set()
    with pytest.raises(ZeroDivisionError):
        failing.result(10)
    assert after.result(10) == "ok" and ran == [2]
    with pytest.raises(CancelledError):
        cancelled.result(0)
    pool.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        pool.submit(lambda t: None, group=0, size=None)


def test_a_running_item_asks_the_cache_for_its_bytes(monkeypatch):
    cache = buffers.host_cache()
    monkeypatch.setattr(cache, "limit_bytes", 1 << 20)
    pool = ItemPool(2)
    try:
        seen = pool.submit(lambda t: cache.limit_bytes, group=0, size=64 << 20).result(10)
    finally:
        pool.shutdown()
    assert seen >= 64 << 20
    assert cache.limit_bytes == 1 << 20  # back to its own limit once the item ended


def test_shutdown_runs_what_is_queued_and_ends_the_threads():
    pool = ItemPool(2, name="mmferry-pool-test")
    release = _held(pool)
    queued = [pool.submit(lambda t, k=k: k, group=0, size=None) for k in range(5)]
    release.set()
    pool.shutdown()
    assert [f.result(0) for f in queued] == list(range(5))
    assert not [t for t in threading.enumerate() if t.name.startswith("mmferry-pool-test")]
