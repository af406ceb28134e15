"""Recycled host buffers: a mapping is handed out again only once every tensor on it is gone,
the cache stays within its byte limit and idle time, and the setting is read and checked."""

from __future__ import annotations

import gc
import multiprocessing as mp
import time

import pytest
import torch

from mmferry.env import Env
from mmferry.models import preset
from mmferry.preprocess import buffers
from mmferry.preprocess.buffers import HostBufferCache, empty_host, host_cache
from mmferry.preprocess.image import process_image

from .conftest import gradient

MIB = 1 << 20


@pytest.fixture
def cache(monkeypatch):
    """A fresh cache of 64 MiB in place of the process's."""
    fresh = HostBufferCache(64 * MIB, idle_seconds=60)
    monkeypatch.setattr(buffers, "_cache", fresh)
    yield fresh
    fresh.release()


def _ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


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


def test_idle_buffers_are_released(cache):
    cache.idle_seconds = 0.5
    a = empty_host((8 * MIB,), torch.uint8)
    del a  # freed at once: nothing else refers to it
    assert cache.cached_bytes > 0
    deadline = time.monotonic() + 5
    while cache.cached_bytes and time.monotonic() < deadline:
        time.sleep(0.05)
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
