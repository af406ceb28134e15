"""Recycled host buffers: a mapping is handed out again only once every tensor on it is gone
(also after `share_memory_` moved the tensor out of it), freeing a tensor never waits on a lock,
a tensor's storage is exactly its own bytes, the cache stays within its byte limit and idle
time, and the setting is read and checked."""

from __future__ import annotations

import faulthandler
import gc
import io
import json
import multiprocessing as mp
import os
import pickle
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import mmferry as mf
from mmferry.env import Env
from mmferry.models import preset
from mmferry.preprocess import buffers
from mmferry.preprocess.buffers import HostBufferCache, empty_host, host_cache
from mmferry.preprocess.image import process_image

from .conftest import gradient

MIB = 1 << 20
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def cache(monkeypatch):
    """A fresh cache of 64 MiB in place of the process's."""
    fresh = HostBufferCache(64 * MIB, idle_seconds=60)
    monkeypatch.setattr(buffers, "_cache", fresh)
    yield fresh
    fresh.release()


def _ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _storage_bytes(t: torch.Tensor) -> int:
    # An int, so that a failed assert does not print the storage.
    return t.untyped_storage().nbytes()


def test_a_freed_buffer_is_reused_with_its_pages(cache):
    a = empty_host((8 * MIB,), torch.uint8)
    a.fill_(7)
    where = _ptr(a)
    del a
    gc.collect()
    assert cache.cached_bytes > 0
    b = empty_host((8 * MIB,), torch.uint8)
    assert _ptr(b) == where and cache.hits == 1
    assert b.is_contiguous() and b.data_ptr() % (2 * MIB) == 0


def test_a_live_view_keeps_its_buffer_out_of_the_cache(cache):
    a = empty_host((8 * MIB,), torch.uint8)
    tail = a[-16:]  # a view: shares the storage
    arr = tail.numpy()  # and numpy on top of it
    tail.fill_(3)
    del a, tail
    gc.collect()
    assert cache.cached_bytes == 0
    b = empty_host((8 * MIB,), torch.uint8)
    b.fill_(9)
    assert (arr == 3).all(), "a buffer still in use was handed out again"
    del arr
    gc.collect()
    assert cache.cached_bytes > 0


def test_sizes_must_fit(cache):
    big = empty_host((32 * MIB,), torch.uint8)
    del big
    gc.collect()
    small = empty_host((8 * MIB,), torch.uint8)  # would leave 3/4 of the pages idle
    assert cache.hits == 0 and cache.misses == 2
    assert small.numel() == 8 * MIB


def test_the_cache_keeps_to_its_limit(cache):
    held = [empty_host((20 * MIB,), torch.uint8) for _ in range(4)]
    del held
    gc.collect()
    assert 0 < cache.cached_bytes <= 64 * MIB


def test_a_buffer_over_the_limit_is_not_kept(cache):
    huge = empty_host((80 * MIB,), torch.uint8)
    del huge
    gc.collect()
    assert cache.cached_bytes == 0


def _lazy_free_kib() -> int:
    # The process's pages given MADV_FREE that the kernel has not taken back yet.
    text = Path("/proc/self/smaps_rollup").read_text()
    return next(int(line.split()[1]) for line in text.splitlines() if line.startswith("LazyFree:"))


def _wait_for(condition, seconds: float = 5.0) -> bool:
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.05)
    return condition()


def test_idle_buffers_are_released(cache):
    cache.idle_seconds = 0.3
    cache.keep_seconds = 0.8
    a = empty_host((8 * MIB,), torch.uint8)
    del a  # freed at once: nothing else refers to it
    assert cache.cached_bytes > 0
    assert _wait_for(lambda: cache.cached_bytes == 0)


@pytest.mark.skipif(
    not Path("/proc/self/smaps_rollup").exists(), reason="LazyFree is read from Linux's smaps"
)
def test_an_idle_buffer_gives_its_pages_to_the_kernel_and_is_reused_after(cache):
    """Idle for `idle_seconds`, a buffer's pages go to the kernel (MADV_FREE: reclaimable,
    LazyFree in smaps) but the mapping stays in the cache, so a caller that paused longer
    than that gets it back instead of faulting fresh pages, and what it writes there stays."""
    cache.idle_seconds = 0.2
    before = _lazy_free_kib()
    a = empty_host((16 * MIB,), torch.uint8)
    a.fill_(5)
    where = _ptr(a)
    del a
    gc.collect()
    assert _wait_for(lambda: cache.lazy_bytes > 0), "the idle buffer was not given MADV_FREE"
    assert cache.cached_bytes >= 16 * MIB, "the idle buffer was unmapped"
    # The kernel may take these pages back any time it needs memory; within this second, on
    # a host with memory to spare, it has not.
    assert _lazy_free_kib() - before >= 16 * 1024
    b = empty_host((16 * MIB,), torch.uint8)
    assert _ptr(b) == where and cache.hits == 1 and cache.lazy_bytes == 0
    b.fill_(9)  # written again: the kernel must keep these pages now
    assert cache.release(0.0) == 0  # b holds its mapping: nothing to release
    assert bool((b == 9).all())
    # NOTE: no idle reaping from here on: a loaded host can take longer than 0.2 s between the
    # free and the check, and the reaper would then give the buffer MADV_FREE again (CI saw it).
    cache.idle_seconds = 60.0
    del b
    gc.collect()
    assert cache.cached_bytes >= 16 * MIB and cache.lazy_bytes == 0


def test_a_release_while_pages_are_being_freed_unmaps_them_too(cache, monkeypatch):
    """`release_host_cache()` made while the reaper gives a mapping MADV_FREE (the mapping is
    out of the cache meanwhile) still unmaps it, instead of the reaper putting it back."""
    real = buffers._free_lazily

    def released_meanwhile(mappings):
        failed = real(mappings)
        assert buffers.release_host_cache() == 0  # nothing in the cache right now
        return failed

    monkeypatch.setattr(buffers, "_free_lazily", released_meanwhile)
    a = empty_host((8 * MIB,), torch.uint8)
    del a
    gc.collect()
    assert cache.cached_bytes > 0
    cache._settle(lazy_after=0.0)  # the reaper's lazy step, with a release during madvise
    assert cache.cached_bytes == 0


def test_release_now(cache):
    a = empty_host((8 * MIB,), torch.uint8)
    del a
    gc.collect()
    assert buffers.release_host_cache() >= 8 * MIB
    assert cache.cached_bytes == 0


def test_disabled_cache_keeps_nothing(monkeypatch):
    off = HostBufferCache(0)
    monkeypatch.setattr(buffers, "_cache", off)
    a = empty_host((8 * MIB,), torch.uint8)
    del a
    gc.collect()
    assert off.cached_bytes == 0 and off.hits == off.misses == 0


def test_setting():
    assert Env.read({}).host_cache_mb == 2048
    assert Env.read({"MMFERRY_HOST_CACHE_MB": "0"}).host_cache_mb == 0
    assert Env.read({"MMFERRY_HOST_CACHE_MB": "256"}).host_cache_mb == 256
    for bad in ("-1", "lots", "1.5"):
        with pytest.raises(ValueError, match="MMFERRY_HOST_CACHE_MB"):
            Env.read({"MMFERRY_HOST_CACHE_MB": bad})


def test_items_reuse_buffers_and_stay_correct(monkeypatch):
    """An item built in buffers that held another image equals one built in fresh pages:
    every byte of a recycled buffer is written."""
    cfg = preset("qwen3-vl")
    first, second = gradient(1200, 1600, 1), gradient(1200, 1600, 2)
    for layout in ("hf", "compact-u8"):
        monkeypatch.setattr(buffers, "_cache", HostBufferCache(0))
        fresh = process_image(second, cfg, layout=layout).feature
        recycling = HostBufferCache(1024 * MIB)
        monkeypatch.setattr(buffers, "_cache", recycling)
        process_image(first, cfg, layout=layout)  # its buffers are freed at once
        gc.collect()
        reused = process_image(second, cfg, layout=layout)
        assert recycling.hits >= 2  # the resize output and the feature rows at least
        assert torch.equal(reused.feature, fresh)
        recycling.release()


def _child(q) -> None:
    q.put((host_cache().cached_bytes, empty_host((8 * MIB,), torch.uint8).numel()))


def test_a_forked_child_starts_with_an_empty_cache():
    keep = empty_host((8 * MIB,), torch.uint8)
    del keep
    gc.collect()
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_child, args=(q,))
    p.start()
    cached, numel = q.get(timeout=60)
    p.join(60)
    assert p.exitcode == 0
    assert cached == 0 and numel == 8 * MIB


def test_freeing_a_buffer_inside_a_gc_pass_never_deadlocks():
    """The finalizer that hands a mapping back can run inside a collection started by an
    allocation the cache makes while its thread holds the cache's lock. Each threshold moves
    the collection to another allocation; the child must finish every one."""
    script = textwrap.dedent(
        """
        import faulthandler, gc, sys, torch
        from mmferry.preprocess.buffers import empty_host

        faulthandler.dump_traceback_later(20, exit=True)  # a hang fails with its stacks
        gc.freeze()  # what is alive now is never garbage: keeps each collection short
        MIB = 1 << 20
        for threshold in range(1, 201):
            idle = empty_host((8 * MIB,), torch.uint8)
            del idle  # one buffer idle in the cache
            cycle = [empty_host((8 * MIB,), torch.uint8)]
            cycle.append(cycle)
            del cycle  # garbage until the next collection, which frees its buffer
            gc.set_threshold(threshold)
            t = empty_host((8 * MIB,), torch.uint8)
            gc.set_threshold(700)
            del t
            gc.collect()
        print("done")
        """
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MMFERRY_HOST_CACHE_MB": "64"}
    try:
        p = subprocess.run(
            [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60
        )
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"freeing a buffer deadlocked: {e.stderr}")
    assert p.returncode == 0 and p.stdout.strip() == "done", p.stderr


def test_a_saved_feature_holds_only_its_own_bytes(cache):
    """A smaller item in a recycled buffer: saving, pickling or sharing its feature carries
    its own bytes and none of the larger item that used the buffer before."""
    cfg = preset("qwen3-vl")
    first = process_image(gradient(1024, 1024, 3), cfg, layout="hf").feature
    tail = first[-8:].numpy().tobytes()  # past the end of the next, smaller feature
    del first
    gc.collect()
    hits = cache.hits
    item = process_image(np.zeros((896, 1024, 3), np.uint8), cfg, layout="hf")
    assert cache.hits > hits  # the feature did land in the first one's buffer
    feature = item.feature
    own = feature.numel() * feature.element_size()
    assert _storage_bytes(feature) == own
    saved = io.BytesIO()
    torch.save(feature, saved)
    pickled = pickle.dumps(item)
    for data in (saved.getvalue(), pickled, pickle.dumps(feature)):
        assert own < len(data) < own + 64 * 1024
        assert tail not in data, "another item's rows were written out"
    assert _storage_bytes(torch.load(io.BytesIO(saved.getvalue()))) == own
    assert _storage_bytes(pickle.loads(pickled).feature) == own
    feature.share_memory_()
    assert _storage_bytes(feature) == own
    assert torch.equal(feature, pickle.loads(pickled).feature)


def test_share_memory_after_numpy_keeps_the_pages_for_the_array(cache):
    """`share_memory_` moves the tensor into new memory; an array taken before still reads
    the old pages, so they stay out of the cache until the array is gone."""
    a = empty_host((8 * MIB,), torch.uint8)
    a.fill_(3)
    arr = a[MIB:].numpy()
    a.share_memory_()
    assert a.is_shared()
    del a
    gc.collect()
    assert cache.cached_bytes == 0, "pages an array still reads went back to the cache"
    b = empty_host((8 * MIB,), torch.uint8)
    b.fill_(9)
    assert (arr == 3).all()
    del arr
    gc.collect()
    assert cache.cached_bytes > 0


def test_share_memory_after_numpy_never_frees_a_small_buffer():
    """Under the huge-page size buffers come from torch's allocator, whose share_memory_
    frees the old memory under the array (a crash): in a child, so that one fails the test."""
    script = textwrap.dedent(
        """
        import torch
        from mmferry.preprocess.buffers import empty_host

        a = empty_host((1 << 20,), torch.uint8).fill_(3)
        arr = a.numpy()
        a.share_memory_()
        others = [empty_host((1 << 20,), torch.uint8).fill_(9) for _ in range(8)]
        print("ok" if (arr == 3).all() else "changed")
        """
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    p = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )
    assert p.returncode == 0 and p.stdout.strip() == "ok", (p.returncode, p.stdout, p.stderr)


STRESS_SECONDS = 30.0


@pytest.mark.slow
def test_preprocessing_under_stress_never_hangs_and_stays_exact():
    """Images and videos on three threads (each item split over two more) beside a thread of
    bare buffers, tensors dying in reference cycles, some after `.numpy()` and `share_memory_`,
    collections every few allocations, idle buffers expiring, for 30 s: every feature equals
    one built in fresh pages (the cache off) and holds only its own bytes, and every array
    still reads its feature when dropped. A hang fails the child by its watchdog, with every
    thread's stack."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MMFERRY_HOST_CACHE_MB": "512"}
    code = f"from tests.preprocess.test_buffers import _stress; _stress({STRESS_SECONDS})"
    try:
        p = subprocess.run(
            [sys.executable, "-c", code],
            env=env,
            capture_output=True,
            text=True,
            timeout=STRESS_SECONDS + 120,
        )
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the stress run hung: {e.stderr}")
    assert p.returncode == 0, p.stderr[-8000:]
    summary = json.loads(p.stdout.strip().splitlines()[-1])
    assert not summary["errors"], summary
    assert summary["items"] >= 30 and summary["videos"] >= 5, summary
    assert summary["hits"] >= 20, summary  # the buffers were recycled, not only fresh


def _stress_workload(folder: str) -> list[tuple[str, object, str]]:
    """(kind, source, layout): images as arrays and JPEG bytes, videos as MPEG-4 files, of
    sizes that recycle one another's buffers (a smaller item in a larger one's mapping)."""
    import av
    from PIL import Image

    work: list[tuple[str, object, str]] = []
    sizes = [(1024, 1024), (896, 1024), (768, 1024), (1200, 1600), (640, 1536), (1088, 832)]
    for i, (h, w) in enumerate(sizes):
        pixels = gradient(h, w, seed=10 + i)
        work.append(("image", pixels, "hf" if i % 2 else "compact-u8"))
        jpeg = io.BytesIO()
        Image.fromarray(pixels).save(jpeg, "JPEG", quality=90)
        work.append(("image", jpeg.getvalue(), "compact-u8" if i % 2 else "hf"))
    for i, (n, h, w) in enumerate([(24, 480, 640), (30, 448, 576), (20, 512, 704)]):
        path = os.path.join(folder, f"clip{i}.mp4")
        with av.open(path, "w") as out:
            stream = out.add_stream("mpeg4", rate=10)
            stream.width, stream.height, stream.pix_fmt = w, h, "yuv420p"
            for k in range(n):
                frame = np.roll(gradient(h, w, seed=20 + i), 8 * k, axis=1)
                for pkt in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                    out.mux(pkt)
            for pkt in stream.encode():
                out.mux(pkt)
        for layout in ("hf", "compact-u8"):
            work.append(("video", path, layout))
    return work


def _stress(seconds: float) -> None:
    """The stress test's child: prints a JSON summary as its last line."""
    faulthandler.dump_traceback_later(seconds + 60, exit=True)
    proc = mf.Processor.for_model("qwen3-vl")

    def run(kind: str, source: object, layout: str) -> mf.MultimodalItem:
        if kind == "image":
            return proc.image(source, layout=layout, threads=2)
        return proc.video(source, layout=layout, threads=2)

    with tempfile.TemporaryDirectory() as folder:
        work = _stress_workload(folder)
        recycling = buffers._cache
        buffers._cache = HostBufferCache(0)  # the references: fresh pages, nothing recycled
        refs = [run(*w).feature for w in work]
        buffers._cache = recycling
        # Idle buffers go lazy and expire while the threads run, too.
        recycling.idle_seconds = 0.5
        recycling.keep_seconds = 1.5
        gc.collect()
        gc.freeze()  # what lives now is never garbage: keeps the frequent collections short
        errors: list[str] = []
        # items, videos: per worker; bare buffers for the churn thread
        done: list[list[int]] = [[0, 0] for _ in range(4)]
        deadline = time.monotonic() + seconds

        def one(i: int, rng: np.random.Generator) -> list:
            item = run(*work[i])
            feature = item.feature
            if not torch.equal(feature, refs[i]):
                errors.append(f"workload {i}: the feature differs from fresh pages")
            if feature.untyped_storage().nbytes() != feature.nbytes:
                errors.append(f"workload {i}: the storage holds more than the feature")
            # An array of the feature, which must keep its pages also if the tensor moves
            # to shared memory; checked when dropped.
            held: list = [i, feature.numpy() if rng.random() < 0.5 else None, item]
            if rng.random() < 0.2:
                feature.share_memory_()
            held.append(held)  # a cycle: freed by a collection, in whichever thread runs it
            return held

        def drop(held: list) -> None:
            i, array = held[0], held[1]
            if array is not None and not np.array_equal(array, refs[i].numpy()):
                errors.append(f"workload {i}: an array of the feature changed under it")

        def worker(seed: int) -> None:
            rng = np.random.default_rng(seed)
            recent: list[list] = []
            while time.monotonic() < deadline and not errors:
                i = int(rng.integers(len(work)))
                # Collections land at another allocation each time (any thread's).
                gc.set_threshold(int(rng.integers(5, 60)), 3, 3)
                try:
                    recent.append(one(i, rng))
                except Exception as e:  # noqa: BLE001 - reported in the summary
                    errors.append(f"workload {i}: {e!r}")
                # Cycles kept through a few collections reach the older generations, so that
                # their buffers are freed by whatever later collection, wherever it starts.
                while len(recent) > rng.integers(3):
                    drop(recent.pop(0))
                done[seed][0] += 1
                done[seed][1] += work[i][0] == "video"

        def churn() -> None:
            # Bare buffers of mixed sizes, many a second, each dying in a cycle: the cache's
            # lock is taken and released all the time while garbage holding buffers waits.
            rng = np.random.default_rng(99)
            recent: list[list] = []
            while time.monotonic() < deadline and not errors:
                t = empty_host((int(rng.integers(4 * MIB, 12 * MIB)),), torch.uint8)
                t[-1] = 1
                cycle: list = [t]
                cycle.append(cycle)
                recent.append(cycle)
                del t, cycle
                while len(recent) > rng.integers(4):
                    recent.pop(0)
                done[3][0] += 1

        threads = [threading.Thread(target=worker, args=(k,)) for k in range(3)]
        threads.append(threading.Thread(target=churn))
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        gc.set_threshold(700, 10, 10)
        gc.unfreeze()
    summary = {
        "items": sum(d[0] for d in done[:3]),
        "videos": sum(d[1] for d in done[:3]),
        "buffers": done[3][0],
        "errors": errors[:5],
        "hits": recycling.hits,
    }
    print(json.dumps(summary), flush=True)
