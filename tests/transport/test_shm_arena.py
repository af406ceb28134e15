"""ShmArena in one process: bytes, leases, aliasing, readers, cancel, full arena, bad input."""

from __future__ import annotations

import gc
import os
import pickle
import time

import pytest
import torch

from mmferry.transport.shm import ArenaFullError, ShmArena, ShmHandle, open_shared


def _drop(*_: object) -> None:
    gc.collect()


def test_put_open_roundtrip_every_dtype():
    g = torch.Generator().manual_seed(0)
    with ShmArena(1 << 20) as arena:
        for t in (
            torch.randn(5, 7, generator=g),
            torch.randn(3, 4, generator=g).to(torch.bfloat16),
            torch.randint(0, 256, (9, 12), generator=g, dtype=torch.uint8),
            torch.randn(4, 6, generator=g).t(),  # non-contiguous source
        ):
            h = arena.put(t)
            assert h.inline is None
            v = open_shared(h)
            assert v.dtype == t.dtype and torch.equal(v, t)
            assert len(pickle.dumps(h)) < 400  # a small handle, not the bytes


def test_lease_held_while_any_alias_lives():
    with ShmArena(1 << 20) as arena:
        h = arena.put(torch.arange(64, dtype=torch.float32).view(8, 8))
        view = open_shared(h)
        row = view[3]  # a view of a view
        as_int = view.view(torch.int32)  # a reinterpreting alias
        del view
        _drop()
        assert arena.reclaim() == 0 and arena.live_slots == 1
        del as_int
        _drop()
        assert arena.reclaim() == 0
        assert row[0].item() == 24.0
        del row
        _drop()
        assert arena.reclaim() == 1 and arena.used_bytes == 0


def test_reopen_shares_one_lease_and_copy_releases():
    with ShmArena(1 << 20) as arena:
        h = arena.put(torch.ones(4, 4))
        a, b = open_shared(h), open_shared(h)
        assert a.data_ptr() == b.data_ptr()
        c = a.clone()  # an independent copy does not hold the lease
        del a
        _drop()
        assert arena.reclaim() == 0
        del b
        _drop()
        assert arena.reclaim() == 1 and torch.equal(c, torch.ones(4, 4))


def test_every_reader_must_release():
    with ShmArena(1 << 20) as arena:
        h = arena.put(torch.ones(3), readers=2)
        v0 = open_shared(h.for_reader(0))
        del v0
        _drop()
        assert arena.reclaim() == 0  # reader 1 has not even opened it yet
        v1 = open_shared(h.for_reader(1))
        del v1
        _drop()
        assert arena.reclaim() == 1
        with pytest.raises(ValueError, match="reader"):
            h.for_reader(2)


def test_cancel_frees_unopened_and_expires_handle():
    with ShmArena(1 << 20) as arena:
        h = arena.put(torch.ones(16), readers=2)
        v = open_shared(h.for_reader(0))
        arena.cancel(h)
        assert arena.live_slots == 1  # reader 0 still reads
        with pytest.raises(ValueError, match="expired"):
            open_shared(h.for_reader(1))
        del v
        _drop()
        assert arena.reclaim() == 1


def test_full_arena_waits_then_raises_and_recovers():
    with ShmArena(4096, timeout_s=0.2) as arena:
        x = torch.randn(1000)  # 4000 bytes
        keep = open_shared(arena.put(x))
        t0 = time.monotonic()
        with pytest.raises(ArenaFullError, match="stayed full"):
            arena.put(x)
        assert 0.15 < time.monotonic() - t0 < 5
        del keep
        _drop()
        h = arena.put(x)  # space came back: no inline fallback
        assert h.inline is None and torch.equal(open_shared(h), x)


def test_full_arena_inline_fallback_delivers_identical_bytes():
    with ShmArena(4096, on_full="inline") as arena:
        x = torch.randn(1000)
        keep = open_shared(arena.put(x))
        y = torch.randn(1000).to(torch.bfloat16)
        with pytest.warns(RuntimeWarning, match="inline"):
            h = arena.put(y)
        assert h.inline is not None and arena.stats.inline_puts == 1
        assert torch.equal(open_shared(pickle.loads(pickle.dumps(h))), y)
        big = torch.randn(5000)  # larger than the whole arena: inline, never stuck
        assert torch.equal(open_shared(arena.put(big)), big)
        assert torch.equal(keep, x)


def test_close_unlinks_and_open_views_survive():
    arena = ShmArena(1 << 16)
    path = "/dev/shm" + arena.name
    assert os.path.exists(path)
    v = open_shared(arena.put(torch.arange(10.0)))
    arena.close()
    assert not os.path.exists(path)
    assert torch.equal(v, torch.arange(10.0))
    with pytest.raises(ValueError, match="closed"):
        arena.put(torch.ones(1))


def test_bad_input():
    with ShmArena(1 << 16) as arena:
        with pytest.raises(ValueError, match="torch.Tensor"):
            arena.put([1, 2, 3])
        with pytest.raises(ValueError, match="readers"):
            arena.put(torch.ones(2), readers=0)
        with pytest.raises(ValueError, match="ShmHandle"):
            open_shared("not a handle")
    with pytest.raises(ValueError, match="on_full"):
        ShmArena(1 << 16, on_full="drop")
    gone = ShmHandle(
        shape=(1,),
        dtype="torch.float32",
        nbytes=4,
        segment="/mmferry-1-000000000000",
        slot=0,
        gen=1,
    )
    with pytest.raises(FileNotFoundError, match="gone"):
        open_shared(gone)
    with pytest.raises(ValueError, match="not an mmferry shared-memory segment name"):
        open_shared(ShmHandle(shape=(1,), dtype="torch.float32", nbytes=4, segment="/mmferry-x"))


def test_failed_copy_gives_the_slot_back():
    # A put whose copy raises (here: a meta tensor has no data) must not keep its range.
    with ShmArena(4096, timeout_s=0.2) as arena:
        for _ in range(3):
            with pytest.raises(NotImplementedError):
                arena.put(torch.empty(1000, device="meta"))
        assert arena.used_bytes == 0 and arena.live_slots == 0
        x = torch.randn(1000)  # 4000 bytes: needs the whole arena
        h = arena.put(x)
        assert h.inline is None and torch.equal(open_shared(h), x)
