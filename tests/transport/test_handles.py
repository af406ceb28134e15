"""Forged and corrupt handles: every field is checked before anything is mapped or leased."""

from __future__ import annotations

import dataclasses
import gc

import pytest
import torch

from mmferry.transport.pool import FeaturePool, HostBacking, ack, open_feature
from mmferry.transport.shm import ShmArena, ShmHandle, open_shared


@pytest.fixture
def two_features():
    with ShmArena(1 << 16) as arena:
        a = arena.put(torch.ones(256))
        b = arena.put(torch.full((256,), 7.0))
        yield arena, a, b


def _forged(a: ShmHandle, b: ShmHandle) -> list[tuple[ShmHandle, str]]:
    r = dataclasses.replace
    return [
        (r(a, nbytes=-1), "bytes"),
        (r(a, nbytes=a.nbytes * 2, shape=(512,)), "does not match the producer"),
        (r(a, offset=0), "outside the segment's data region"),
        (r(a, offset=b.offset), "does not match the producer"),  # b's bytes under a's lease
        (r(a, offset=a.offset + 64), "does not match the producer"),
        (r(a, offset=1 << 40), "outside"),
        (r(a, slot=-1), "invalid slot"),
        (r(a, slot=1 << 30), "outside this table"),
        (r(a, gen=0), "invalid slot"),
        (r(a, gen=a.gen + 100), "expired"),
        (r(a, reader=3), "invalid reader"),
        (r(a, readers=100, reader=50), "outside this table|does not match"),
        (r(a, dtype="float32"), "unknown dtype"),
        (r(a, dtype="torch.Tensor"), "unknown dtype"),
        (r(a, shape=(-256,)), "ints >= 0"),
        (r(a, shape=(256.0,)), "ints >= 0"),
        (r(a, segment="/etc/passwd"), "segment name"),
        (r(a, segment="/mmferry-1-../../etc"), "segment name"),
        (ShmHandle(shape=(1 << 20, 1 << 20), dtype="torch.float32", nbytes=0, inline=b""), "bytes"),
        (ShmHandle(shape=(2,), dtype="torch.float32", nbytes=8, inline=b"x" * 3), "inline"),
        (ShmHandle(shape=(0, 1 << 70), dtype="torch.float32", nbytes=0, inline=b""), "2\\^48"),
    ]


def test_forged_handles_raise_and_leave_every_lease_intact(two_features):
    arena, a, b = two_features
    for bad, match in _forged(a, b):
        with pytest.raises(ValueError, match=match):
            open_shared(bad)
    # Nothing above took a's lease or mapped b's bytes for a: both still open once, correctly.
    va, vb = open_shared(a), open_shared(b)
    assert torch.equal(va, torch.ones(256)) and torch.equal(vb, torch.full((256,), 7.0))
    del va, vb
    gc.collect()
    assert arena.reclaim() == 2


def test_a_failed_open_does_not_pin_the_lease(two_features):
    arena, a, _ = two_features
    with pytest.raises(ValueError):
        open_shared(dataclasses.replace(a, offset=a.offset + 256))
    arena.cancel(a)  # the only reader never opened it: it is free now
    assert arena.live_slots == 1


def test_zero_byte_slot_handle_is_refused(two_features):
    _, a, _ = two_features
    with pytest.raises(ValueError, match="zero-byte|outside|match"):
        open_shared(dataclasses.replace(a, shape=(0,), nbytes=0))


def test_forged_pool_handles():
    with FeaturePool(HostBacking(1 << 20)) as pool:
        x = torch.arange(1024.0)
        h = pool.put(x)
        r = dataclasses.replace
        for bad, match in [
            (r(h, nbytes=-4, shape=(-1,)), "ints >= 0"),
            (r(h, offset=(1 << 20) - 16), "outside|match"),
            (r(h, offset=-256), "outside"),
            (r(h, slot=-1), "invalid slot"),
            (r(h, control="/tmp/x"), "segment name"),
            (r(h, store=("disk", "/x")), "unknown pool store"),
            (r(h, dtype="torch.float128"), "unknown dtype"),
        ]:
            with pytest.raises(ValueError, match=match):
                open_feature(bad)
        assert torch.equal(open_feature(h), x)
        ack(h)
        assert pool.reclaim() == 1
