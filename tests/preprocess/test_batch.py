"""The batch API (`proc.images`, `proc.items`): every item equal to its per-item call, in input
order, errors named by index, partial results, and the thread bound."""

from __future__ import annotations

import io
import os
import signal
import threading
import time
from functools import partial
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

import mmferry as mf
from mmferry.items import MultimodalItem
from mmferry.preprocess import batch as batch_mod
from mmferry.preprocess import buffers as buffers_mod
from mmferry.preprocess import image as image_mod
from mmferry.preprocess import scheduler as scheduler_mod
from mmferry.preprocess.batch import ImagePart, ItemError, VideoPart

from . import reference as ref
from .conftest import encode, gradient
from .running import RunningThreads

PROC = mf.Processor.for_model("qwen3-vl")
# All-distinct sizes, from below the minimum pixels (upscaled) to a resized 1.3 MP image.
SIZES = [(1100, 1200), (37, 51), (480, 640), (333, 517), (700, 260), (64, 64), (901, 420)]


def _jpegs() -> list[bytes]:
    return [
        encode(Image.fromarray(gradient(h, w, seed=i)), "JPEG", quality=90)
        for i, (h, w) in enumerate(SIZES)
    ]


def _same(batch_item: MultimodalItem, single: MultimodalItem) -> None:
    assert batch_item.grid_thw == single.grid_thw
    assert batch_item.layout == single.layout
    assert batch_item.hash == single.hash
    assert batch_item.timestamps == single.timestamps
    assert batch_item.second_per_grid_t == single.second_per_grid_t
    assert batch_item.feature.dtype == single.feature.dtype
    assert bool((batch_item.feature == single.feature).all())


@pytest.mark.parametrize("layout", ["hf", "compact-u8"])
@pytest.mark.parametrize("kind", ["jpeg", "pil"])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_images_equal_the_per_item_path_in_order(layout, kind, threads):
    sources: list[Any] = _jpegs()
    if kind == "pil":
        sources = [Image.open(io.BytesIO(d)).convert("RGB") for d in sources]
    out = PROC.images(sources, layout=layout, threads=threads)
    assert len(out) == len(sources)
    for got, src in zip(out, sources):
        _same(got, PROC.image(src, layout=layout))
    assert len({it.grid_thw for it in out}) == len(SIZES)  # distinct, so order is checked


@pytest.mark.parametrize("layout", ["hf", "compact-u8"])
def test_mixed_images_and_videos_equal_the_per_item_path(layout):
    frames = ref.moving_frames(6, 96, 128, seed=4)  # [T, H, W, 3] uint8
    jpegs = _jpegs()
    parts = [
        jpegs[0],  # a bare source is an image
        VideoPart(frames, source_fps=2.0),
        ImagePart(gradient(200, 300, seed=9)),
        VideoPart(mf.sample_video(), fps=1.0),
        ImagePart(jpegs[3]),
        VideoPart(list(frames[:4]), num_frames=2, source_fps=4.0),
    ]
    out = PROC.items(parts, layout=layout, threads=2)
    singles = [
        PROC.image(jpegs[0], layout=layout),
        PROC.video(frames, layout=layout, source_fps=2.0),
        PROC.image(gradient(200, 300, seed=9), layout=layout),
        PROC.video(mf.sample_video(), layout=layout, fps=1.0),
        PROC.image(jpegs[3], layout=layout),
        PROC.video(list(frames[:4]), layout=layout, num_frames=2, source_fps=4.0),
    ]
    assert [it.modality for it in out] == [s.modality for s in singles]
    for got, single in zip(out, singles):
        _same(got, single)


def test_an_error_names_the_item_index():
    sources: list[Any] = _jpegs()
    sources.insert(4, b"not an image")
    with pytest.raises(ItemError, match=r"^item 4: cannot decode image <bytes of length 12>") as e:
        PROC.images(sources, threads=2)
    assert e.value.index == 4 and isinstance(e.value, ValueError)
    assert isinstance(e.value.error, ValueError)
    with pytest.raises(ItemError, match="^item 1: "):
        PROC.items([ImagePart(sources[0]), VideoPart(b"junk")], threads=2)


def test_the_lowest_failed_index_is_raised():
    sources = [b"bad-a", *_jpegs()[:2], b"bad-b"]
    with pytest.raises(ItemError, match="^item 0: "):
        PROC.images(sources, threads=1)


def test_partial_keeps_every_good_item():
    jpegs = _jpegs()
    sources: list[Any] = [jpegs[0], b"", jpegs[1], np.zeros((4, 4), np.uint8), jpegs[2]]
    out = PROC.images(sources, layout="compact-u8", threads=2, partial=True)
    assert [type(r).__name__ for r in out] == [
        "MultimodalItem",
        "ItemError",
        "MultimodalItem",
        "ItemError",
        "MultimodalItem",
    ]
    assert out[1].index == 1 and "empty" in str(out[1])
    assert out[3].index == 3 and str(out[3]).startswith("item 3: image <ndarray (4, 4) uint8>")
    for i in (0, 2, 4):
        _same(out[i], PROC.image(sources[i], layout="compact-u8"))


def test_without_partial_no_item_starts_after_a_failure(monkeypatch):
    started: list[int] = []
    real = batch_mod._run_part

    def recording(part: Any, *args: Any) -> MultimodalItem:
        started.append(part.source if isinstance(part.source, int) else -1)
        return real(part, *args)

    monkeypatch.setattr(batch_mod, "_run_part", recording)
    # One thread, largest first: the failing (largest-looking: unknown size) item runs first.
    with pytest.raises(ItemError):
        PROC.items([ImagePart(_jpegs()[1]), ImagePart(object()), ImagePart(_jpegs()[2])], threads=1)
    assert len(started) == 1


def test_a_non_input_error_is_raised_as_it_is(monkeypatch):
    def broken(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("kernel bug")

    monkeypatch.setattr(batch_mod, "process_image", broken)
    with pytest.raises(RuntimeError, match="kernel bug"):
        PROC.images(_jpegs()[:2], threads=2)
    out = PROC.images(_jpegs()[:2], threads=2, partial=True)
    assert all(isinstance(r, ItemError) and isinstance(r.error, RuntimeError) for r in out)


def _call_threads() -> int:
    # NOTE: not the host buffer cache's reaper: it lives while buffers are lent or held, by
    # design beyond a call, and starts with the first large item's buffer.
    return sum(t.name != "mmferry-host-cache" for t in threading.enumerate())


@pytest.mark.parametrize(("threads", "n_items"), [(1, 5), (2, 7), (3, 7), (4, 2), (3, 1)])
def test_threads_stay_within_the_bound(monkeypatch, threads, n_items):
    lock = threading.Lock()
    held = {"now": 0, "peak": 0}
    shares: list[int] = []
    workers: set[str] = set()
    hash_threads: set[str] = set()
    real_run, real_hash = batch_mod._run_part, image_mod.item_hash

    def run(part: Any, cfg: Any, layout: Any, share: int) -> MultimodalItem:
        with lock:
            held["now"] += share
            held["peak"] = max(held["peak"], held["now"])
            shares.append(share)
            workers.add(threading.current_thread().name)
        try:
            return real_run(part, cfg, layout, share)
        finally:
            with lock:
                held["now"] -= share

    def hashed(*args: Any) -> str:
        hash_threads.add(threading.current_thread().name)
        return real_hash(*args)

    monkeypatch.setattr(batch_mod, "_run_part", run)
    monkeypatch.setattr(image_mod, "item_hash", hashed)
    big = gradient(1500, 2000, seed=1)  # its key reads > 4 MiB: alongside a single call
    sources = [big] + [gradient(40 + 8 * i, 60, seed=i) for i in range(n_items - 1)]
    before = _call_threads()
    out = PROC.images(sources, layout="compact-u8", threads=threads)
    assert len(out) == n_items
    assert held["peak"] <= threads
    assert len(workers) <= min(threads, n_items)
    # Keys are hashed on the workers themselves, never on an extra thread.
    assert hash_threads <= workers
    if n_items < threads:
        # Fewer items than threads: each item splits its own work.
        assert min(shares) >= threads // n_items
    assert _call_threads() == before  # no thread outlives the call


@pytest.mark.parametrize(("threads", "n_items"), [(3, 7), (4, 2), (4, 5)])
def test_threads_running_at_once_stay_within_the_batch(threads, n_items):
    running = RunningThreads()
    seen: list[tuple[int, int]] = []

    def job(share: int) -> int:
        seen.append((share, torch.get_num_threads()))
        return running.job(share, threading.Event(), 0.05)

    out = batch_mod.run_jobs([job] * n_items, [None] * n_items, threads, stop_on_error=True)
    assert len(out) == n_items and running.peak <= threads
    # The job sizes its own parallel work from its share; torch ops it does not size run on
    # one intra-op thread, as on the service's pool (scheduler.py).
    assert {intra_op for _, intra_op in seen} == {1}
    if n_items < threads:
        assert min(share for share, _ in seen) >= threads // n_items


def test_threads_default_to_the_cores(monkeypatch):
    monkeypatch.delenv("MMFERRY_PREPROCESS_THREADS", raising=False)
    cores = len(os.sched_getaffinity(0))
    assert batch_mod.batch_threads(None) == cores
    monkeypatch.setenv("MMFERRY_PREPROCESS_THREADS", "3")
    assert batch_mod.batch_threads(None) == 3
    assert batch_mod.batch_threads(5) == 5
    with pytest.raises(ValueError, match="positive integer"):
        PROC.images([b""], threads=0)


def test_empty_batch_and_bad_part_type():
    assert PROC.images([]) == []
    with pytest.raises(TypeError, match="item 0"):
        batch_mod.process_batch(["x"], PROC.config)  # type: ignore[list-item]


def test_cache_holds_the_items_in_flight():
    cache = buffers_mod.host_cache()
    own = cache.limit_bytes
    with buffers_mod.ensure_host_cache(own + (1 << 30)):
        assert cache.limit_bytes == own + (1 << 30)
        with buffers_mod.ensure_host_cache(1 << 30):  # a concurrent batch adds its own
            assert cache.limit_bytes == own + (2 << 30)
        assert cache.limit_bytes == own + (1 << 30)
    assert cache.limit_bytes == own
    with buffers_mod.ensure_host_cache(1 << 20):  # less than the cache's own: unchanged
        assert cache.limit_bytes == own


def test_each_running_item_asks_the_cache_for_its_own_bytes(monkeypatch):
    asked: list[int] = []
    real = buffers_mod.ensure_host_cache

    def recording(nbytes: int) -> Any:
        asked.append(nbytes)
        return real(nbytes)

    monkeypatch.setattr(scheduler_mod, "ensure_host_cache", recording)
    jpegs = _jpegs()
    PROC.images(jpegs, layout="hf", threads=2)
    cfg = PROC.config
    per_item = []
    for h, w in SIZES:
        rh, rw = mf.smart_resize(
            h,
            w,
            factor=cfg.factor,
            min_pixels=cfg.image_min_pixels,
            max_pixels=cfg.image_max_pixels,
        )
        per_item.append(4 * h * w + 4 * rh * rw + 24 * rh * rw)
    # Each item its own bytes, once (concurrent asks add up in the cache).
    assert sorted(asked) == sorted(per_item)


def test_an_interrupt_while_waiting_is_raised_once_every_item_ended():
    """Ctrl-C while the calling thread waits on the others: the running item finishes, and
    only then is the interrupt raised (a thread left in native code at interpreter exit can
    abort the process)."""
    main = threading.main_thread()
    other_started = threading.Event()
    finished: list[int] = []

    def job(index: int, share: int) -> int:
        if threading.current_thread() is main:
            assert other_started.wait(10)  # the other thread holds the slow item
            threading.Timer(0.3, signal.pthread_kill, (main.ident, signal.SIGINT)).start()
        else:
            other_started.set()
            time.sleep(1.0)  # still running when the interrupt arrives
        finished.append(index)
        return index

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, interrupt)
    try:
        with pytest.raises(KeyboardInterrupt):
            batch_mod.run_jobs(
                [partial(job, i) for i in range(2)], [None] * 2, 2, stop_on_error=False
            )
    finally:
        signal.signal(signal.SIGINT, previous)
    assert sorted(finished) == [0, 1]  # the slow item ended before the interrupt was raised
    for t in threading.enumerate():
        if t.name.startswith("mmferry-batch"):
            t.join(5)  # its worker returned: only the thread's own exit is left
            assert not t.is_alive()


def test_an_interrupt_while_the_threads_start_waits_for_the_started_ones(monkeypatch):
    """Ctrl-C landing between two thread starts (`mmferry encode`'s SIGTERM right after its
    first line): the thread already started finishes its item, nothing more starts, and only
    then is the interrupt raised. Raised at once, it left a worker in a torch op at interpreter
    exit, which aborted the process (exit -6)."""
    in_job = threading.Event()
    running: list[int] = []
    finished: list[int] = []

    def job(index: int, share: int) -> int:
        running.append(index)
        in_job.set()
        time.sleep(0.5)  # still running when the interrupt arrives
        finished.append(index)
        running.remove(index)
        return index

    class Interrupted(threading.Thread):
        def start(self) -> None:
            super().start()
            assert in_job.wait(10)  # the started thread holds an item
            raise KeyboardInterrupt  # as a signal handler raises it, before the next start

    monkeypatch.setattr(batch_mod.threading, "Thread", Interrupted)
    with pytest.raises(KeyboardInterrupt):
        batch_mod.run_jobs([partial(job, i) for i in range(6)], [None] * 6, 3, stop_on_error=False)
    assert running == []  # no item was left running
    assert len(finished) == 1  # the started thread's item; nothing started after the interrupt
