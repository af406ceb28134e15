"""FeaturePool: accounting, acks, cancel, dead readers, full-pool fallback; host and CUDA."""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import pickle
import signal
import warnings

import pytest
import torch
from shm_helpers import mapping_of

from mmferry.transport.pool import (
    CudaBacking,
    FeaturePool,
    HostBacking,
    PoolHandle,
    ack,
    open_feature,
)
from mmferry.transport.shm import ShmHandle

CTX = mp.get_context("spawn")
MiB = 1 << 20


def _feature(nbytes: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(nbytes // 4, generator=torch.Generator().manual_seed(seed)).view(-1, 64)


def test_put_open_ack_accounting_returns_to_zero():
    with FeaturePool(HostBacking(MiB)) as pool:
        x = _feature(4096 * 4)
        h = pool.put(x, readers=2)
        assert isinstance(h, PoolHandle) and pool.used_bytes == x.numel() * 4
        h = pickle.loads(pickle.dumps(h))
        for r in range(2):
            assert torch.equal(open_feature(h.for_reader(r)), x)
        ack(h.for_reader(0))
        assert pool.reclaim() == 0 and pool.live_slots == 1
        ack(h.for_reader(1))
        assert pool.reclaim() == 1
        assert pool.used_bytes == 0 and pool.live_slots == 0


def test_cancel_frees_unopened_slice():
    with FeaturePool(HostBacking(MiB)) as pool:
        h = pool.put(_feature(4096))
        pool.cancel(h)
        assert pool.live_slots == 0 and pool.used_bytes == 0
        with pytest.raises(ValueError, match="expired"):
            open_feature(h)


def test_full_pool_falls_back_to_shm_with_identical_bytes_and_one_warning():
    with FeaturePool(HostBacking(MiB)) as pool:
        big = _feature(2 * MiB, seed=1)  # larger than the whole pool
        with pytest.warns(RuntimeWarning, match="feature pool full"):
            h = pool.put(big)
        assert isinstance(h, ShmHandle) and pool.stats.fallbacks == 1
        assert torch.equal(open_feature(pickle.loads(pickle.dumps(h))), big)
        small = _feature(MiB - 4096, seed=2)
        hs = pool.put(small)
        assert isinstance(hs, PoolHandle)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a second fallback does not warn again
            h2 = pool.put(_feature(64 * 1024, seed=3))
        assert isinstance(h2, ShmHandle) and pool.stats.fallbacks == 2
        assert torch.equal(open_feature(h2), _feature(64 * 1024, seed=3))
        ack(hs)
        assert isinstance(pool.put(_feature(64 * 1024)), PoolHandle)  # space reclaimed on put


def _reader_child(handle, do_ack: bool, conn) -> None:
    view = open_feature(handle)
    conn.send(float(view.double().sum()))
    if do_ack:
        ack(handle)
        conn.send("acked")
        return
    import time

    time.sleep(600)


def test_reader_processes_ack_or_die_and_nothing_leaks():
    pool = FeaturePool(HostBacking(MiB))
    names = [pool.backing.export()[1], pool._control.name, pool.fallback.name]
    assert all(os.path.exists("/dev/shm" + n) for n in names)
    x = _feature(8192, seed=4)
    h = pool.put(x, readers=2)
    procs = []
    for r, do_ack in ((0, True), (1, False)):
        parent, child = CTX.Pipe()
        p = CTX.Process(target=_reader_child, args=(h.for_reader(r), do_ack, child), daemon=True)
        p.start()
        child.close()
        assert parent.poll(60), "reader did not start in time"
        assert parent.recv() == pytest.approx(float(x.double().sum()), rel=1e-9)
        procs.append((p, parent))
    assert procs[0][1].poll(60) and procs[0][1].recv() == "acked"
    procs[0][0].join(60)
    assert pool.reclaim() == 0  # reader 1 still holds it
    os.kill(procs[1][0].pid, signal.SIGKILL)
    procs[1][0].join(60)
    assert pool.reclaim() == 1 and pool.used_bytes == 0
    pool.close()
    gc.collect()
    assert not any(os.path.exists("/dev/shm" + n) for n in names)


def test_bad_input():
    with FeaturePool(HostBacking(MiB)) as pool:
        with pytest.raises(ValueError, match="torch.Tensor"):
            pool.put("x")
        with pytest.raises(ValueError, match="readers"):
            pool.put(torch.ones(4), readers=99)
    with pytest.raises(ValueError, match="PoolHandle"):
        open_feature(123)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_pool_ipc_roundtrip_and_fallback():
    with FeaturePool(CudaBacking(MiB)) as pool:
        x = torch.randn(1024, 64, device="cuda")
        h = pool.put(x)
        assert isinstance(h, PoolHandle)
        parent, child = CTX.Pipe()
        p = CTX.Process(target=_reader_child, args=(h, True, child), daemon=True)
        p.start()
        child.close()
        assert parent.poll(120)
        assert parent.recv() == pytest.approx(float(x.double().sum().cpu()), rel=1e-6)
        assert parent.poll(60) and parent.recv() == "acked"
        p.join(60)
        assert pool.reclaim() == 1
        big = torch.randn(2 * MiB // 4, device="cuda")
        with pytest.warns(RuntimeWarning):
            hb = pool.put(big)
        assert isinstance(hb, ShmHandle) and torch.equal(open_feature(hb), big.cpu())


def test_failed_copy_gives_the_slice_back():
    with FeaturePool(HostBacking(MiB)) as pool:
        with pytest.raises(NotImplementedError):
            pool.put(torch.empty(MiB // 4, device="meta"))
        assert pool.used_bytes == 0 and pool.live_slots == 0
        x = _feature(MiB)  # the whole pool: only fits if the failed put gave its slice back
        h = pool.put(x)
        assert isinstance(h, PoolHandle) and torch.equal(open_feature(h), x)
        ack(h)


def test_reopen_after_ack_is_refused_and_never_sees_the_next_feature():
    with FeaturePool(HostBacking(MiB)) as pool:
        x = torch.ones(4096)
        h = pool.put(x)
        v = open_feature(h)
        again = open_feature(h)  # before the ack: the same lease
        assert torch.equal(again, x)
        ack(h)
        with pytest.raises(ValueError, match="once per reader"):
            open_feature(h)
        assert pool.reclaim() == 1
        h7 = pool.put(torch.full((4096,), 7.0))
        with pytest.raises(ValueError, match="expired|once per reader"):
            open_feature(h)
        assert torch.equal(open_feature(h7), torch.full((4096,), 7.0))
        ack(h7)
        del v, again


def test_ack_without_open_declines_and_double_ack_is_refused():
    with FeaturePool(HostBacking(MiB)) as pool:
        h = pool.put(torch.ones(64), readers=2)
        ack(h.for_reader(1))  # reader 1 declines
        v = open_feature(h.for_reader(0))
        ack(h.for_reader(0))
        assert pool.reclaim() == 1
        with pytest.raises(ValueError, match="once per reader|expired"):
            ack(h.for_reader(0))
        del v


def _write_feature_child(handle, conn) -> None:
    view = open_feature(handle)
    view.add_(1)  # a reader changing its feature in place
    conn.send(view.cpu().numpy())  # by value: torch would share the storage with this process
    conn.recv()  # keep the written view until the parent has looked
    ack(handle)
    conn.send("acked")


def _read_feature_child(handle, conn) -> None:
    view = open_feature(handle)
    conn.send(view.cpu().numpy())
    ack(handle)


def _writer_and_reader(pool: FeaturePool, x: torch.Tensor) -> None:
    h = pool.put(x, readers=3)
    mine = open_feature(h.for_reader(0))
    procs = []
    try:
        for r, target in ((1, _write_feature_child), (2, _read_feature_child)):
            parent, child = CTX.Pipe()
            p = CTX.Process(target=target, args=(h.for_reader(r), child), daemon=True)
            p.start()
            child.close()
            procs.append((p, parent))
            assert parent.poll(120), "reader did not answer in time"
            got = torch.from_numpy(parent.recv())  # EOFError here: the reader crashed
            assert torch.equal(got, x.cpu() + 1 if r == 1 else x.cpu())
        assert torch.equal(mine.cpu(), x.cpu())  # opened before the write: unchanged
        procs[0][1].send("done")
        assert procs[0][1].poll(60) and procs[0][1].recv() == "acked"
    finally:
        for p, _ in procs:
            p.join(60)
    assert [p.exitcode for p, _ in procs] == [0, 0]
    ack(h.for_reader(0))
    assert pool.reclaim() == 1


def test_host_pool_reader_writing_in_place_keeps_its_change_to_itself():
    with FeaturePool(HostBacking(MiB)) as pool:
        x = _feature(8192, seed=5)
        _writer_and_reader(pool, x)
        h = pool.put(x)
        v = open_feature(h)
        line = mapping_of(v.data_ptr())
        assert line.split()[1] == "rw-p", line  # private copy-on-write, never the store itself
        v.zero_()
        assert torch.equal(pool._store[h.offset : h.offset + h.nbytes].view(x.dtype), x.view(-1))
        ack(h)
        del v


def test_pool_fallback_views_keep_a_readers_writes_to_itself():
    with FeaturePool(HostBacking(MiB)) as pool:
        big = _feature(2 * MiB, seed=6)
        with pytest.warns(RuntimeWarning, match="feature pool full"):
            h = pool.put(big, readers=2)
        assert isinstance(h, ShmHandle)
        a, b = open_feature(h.for_reader(0)), open_feature(h.for_reader(1))
        a.add_(1)
        assert torch.equal(a, big + 1) and torch.equal(b, big)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_pool_reader_writing_in_place_keeps_its_change_to_itself():
    with FeaturePool(CudaBacking(MiB)) as pool:
        x = torch.randn(1024, 64, device="cuda")
        _writer_and_reader(pool, x)
        h = pool.put(x)
        assert torch.equal(pool._store[h.offset : h.offset + h.nbytes].view(x.dtype), x.view(-1))


def _cuda_reader_child(handle, conn) -> None:
    from mmferry.transport.pool import settle_acks

    view = open_feature(handle)
    view.double().sum().cpu()  # NOTE: loads the kernels now: a lazy load waits for the device
    torch.cuda._sleep(1 << 30)  # the reads below queue behind about half a second of work
    total = view.double().sum()
    ack(handle)  # no host wait: the lease ends when the reads have completed
    conn.send("acked")
    conn.recv()
    torch.cuda.synchronize()
    settle_acks()
    conn.send(float(total.cpu()))
    conn.recv()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_pool_ack_ends_the_lease_only_after_the_readers_kernels():
    with FeaturePool(CudaBacking(MiB)) as pool:
        x = torch.randn(1024, 64, device="cuda")
        h = pool.put(x)
        ready = pool._book._live[h.slot][2]
        assert isinstance(ready, torch.cuda.Event)  # kept with the slot until it is reclaimed
        parent, child = CTX.Pipe()
        p = CTX.Process(target=_cuda_reader_child, args=(h, child), daemon=True)
        p.start()
        child.close()
        try:
            assert parent.poll(120) and parent.recv() == "acked"
            assert pool.reclaim() == 0  # acked, but the reader's kernels may still read
            parent.send("settle")
            assert parent.poll(60)
            assert parent.recv() == pytest.approx(float(x.double().sum().cpu()), rel=1e-6)
            assert pool.reclaim() == 1 and h.slot not in pool._book._live
        finally:
            parent.send("exit")
            p.join(60)
