"""Real spawned processes: hand-off, in-place writes, consumer SIGKILL, producer SIGKILL, normal
exit; /dev/shm."""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import signal
import time

import pytest
import torch

from mmferry.transport.shm import ShmArena, open_shared

CTX = mp.get_context("spawn")
TIMEOUT = 60


def _shm_exists(name: str) -> bool:
    return os.path.exists("/dev/shm" + name)


def _wait_until(cond, timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


def _expected(seed: int) -> torch.Tensor:
    return torch.randn(256, 64, generator=torch.Generator().manual_seed(seed))


# --- child process bodies (spawned children import this module by name) -------------


def _consume_child(handle, hold: bool, conn) -> None:
    view = open_shared(handle)
    conn.send(float(view.double().sum()))
    if hold:
        time.sleep(600)  # keeps the view until killed


def _write_in_place_child(handle, conn) -> None:
    view = open_shared(handle)
    view.add_(1)  # an engine worker scaling its features in place
    conn.send(view.clone())
    conn.recv()  # keep the written view (and its pages) until the parent has looked


def _copy_child(handle, conn) -> None:
    view = open_shared(handle)
    conn.send(view.clone())
    conn.recv()


def _produce_child(seed: int, close: bool, conn) -> None:
    arena = ShmArena(1 << 20)
    conn.send(arena.put(_expected(seed)))
    conn.recv()  # the parent has opened its view
    if close:
        arena.close()
    # otherwise exit normally with the arena still open (finalizer / reaper clean up)


def _produce_and_hang_child(seed: int, conn) -> None:
    arena = ShmArena(1 << 20)
    conn.send(arena.put(_expected(seed)))
    time.sleep(600)
    arena.close()


def _start(target, *args) -> tuple[mp.Process, object]:
    parent, child = CTX.Pipe()
    proc = CTX.Process(target=target, args=(*args, child), daemon=True)
    proc.start()
    child.close()
    return proc, parent


def _recv(conn, proc: mp.Process):
    if not conn.poll(TIMEOUT):
        proc.kill()
        pytest.fail("child process did not answer in time")
    return conn.recv()


# --- tests ----------------------------------------------------------------------------------


def test_consumer_process_reads_and_releases():
    x = _expected(3)
    with ShmArena(1 << 20) as arena:
        h = arena.put(x)
        proc, conn = _start(_consume_child, h, False)
        assert _recv(conn, proc) == pytest.approx(float(x.double().sum()), rel=1e-9)
        proc.join(TIMEOUT)
        assert proc.exitcode == 0
        assert _wait_until(lambda: arena.reclaim() == 1 or arena.live_slots == 0)
        name = arena.name
    assert not _shm_exists(name)


def test_a_reader_writing_in_place_keeps_its_change_and_nobody_else_sees_it():
    x = _expected(7)
    with ShmArena(1 << 20) as arena:
        h = arena.put(x, readers=3)
        mine = open_shared(h.for_reader(0))  # a reader whose view was open before the write
        writer, wconn = _start(_write_in_place_child, h.for_reader(1))
        written = _recv(wconn, writer)
        assert writer.is_alive() and torch.equal(written, x + 1)  # no fault; its own view changed
        reader, rconn = _start(_copy_child, h.for_reader(2))  # opened after the write
        try:
            assert torch.equal(_recv(rconn, reader), x)
            assert torch.equal(mine, x)
            slot = torch.frombuffer(
                arena._segment.mm, dtype=x.dtype, count=x.numel(), offset=h.offset
            )
            assert torch.equal(slot.view(x.shape), x)  # the producer's bytes are untouched
        finally:
            wconn.send("done")
            rconn.send("done")
        for proc in (writer, reader):
            proc.join(TIMEOUT)
            assert proc.exitcode == 0
        del mine, slot
        gc.collect()
        assert _wait_until(lambda: arena.reclaim() == 1 or arena.live_slots == 0)


def test_consumer_killed_with_sigkill_releases_its_slot():
    with ShmArena(1 << 20) as arena:
        h = arena.put(_expected(4))
        proc, conn = _start(_consume_child, h, True)
        _recv(conn, proc)  # the child holds an open view now
        assert arena.reclaim() == 0
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(TIMEOUT)
        assert proc.exitcode == -signal.SIGKILL
        assert arena.reclaim() == 1 and arena.used_bytes == 0
        name = arena.name
        assert _shm_exists(name)  # the producer still lives and owns it
    assert not _shm_exists(name)


@pytest.mark.parametrize("close", [True, False])
def test_producer_normal_exit_leaves_no_segment(close):
    proc, conn = _start(_produce_child, 5, close)
    h = _recv(conn, proc)
    view = open_shared(h)
    conn.send("opened")
    proc.join(TIMEOUT)
    assert proc.exitcode == 0
    assert _wait_until(lambda: not _shm_exists(h.segment))
    assert torch.equal(view, _expected(5))  # our mapping outlives the name


def test_producer_killed_with_sigkill_leaves_no_segment():
    proc, conn = _start(_produce_and_hang_child, 6)
    h = _recv(conn, proc)
    view = open_shared(h)
    assert _shm_exists(h.segment)
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(TIMEOUT)
    assert proc.exitcode == -signal.SIGKILL
    assert _wait_until(lambda: not _shm_exists(h.segment))
    assert torch.equal(view, _expected(6))
    del view
    gc.collect()
