"""ShmArena safety: single-use leases, private copy-on-write views, unmapping, threads, failed
constructors."""

from __future__ import annotations

import gc
import multiprocessing as mp
import threading

import pytest
import torch
from shm_helpers import children, mapped, mapping_of, own_segments, wait_until

from mmferry.transport.shm import ShmArena, open_shared

CTX = mp.get_context("spawn")


def test_reopen_after_the_views_died_is_refused_and_cannot_see_new_bytes():
    with ShmArena(1 << 16) as arena:
        h = arena.put(torch.ones(64))
        v = open_shared(h)
        del v
        gc.collect()
        with pytest.raises(ValueError, match="once per reader"):
            open_shared(h)  # the lease ended with the view: the handle is spent
        assert arena.reclaim() == 1
        sevens = arena.put(torch.full((64,), 7.0))
        with pytest.raises(ValueError, match="expired"):
            open_shared(h)  # the slot and range are someone else's now
        assert torch.equal(open_shared(sevens), torch.full((64,), 7.0))


def test_reclaimed_but_not_reused_slot_refuses_its_old_handle():
    with ShmArena(1 << 16) as arena:
        h = arena.put(torch.ones(64))
        del_view = open_shared(h)
        del del_view
        gc.collect()
        assert arena.reclaim() == 1 and arena.live_slots == 0
        with pytest.raises(ValueError, match="expired"):
            open_shared(h)
        assert arena.reclaim() == 0 and arena.used_bytes == 0


def test_a_view_held_while_reopened_keeps_the_slot_from_reuse():
    with ShmArena(1 << 15, on_full="inline") as arena:
        h = arena.put(torch.ones(6000))  # 24000 of 32768 bytes: a second one fits only in its place
        a = open_shared(h)
        b = open_shared(h)  # same process, same reader, lease still open: the same lease
        del a
        gc.collect()
        assert arena.reclaim() == 0
        with pytest.warns(RuntimeWarning, match="inline"):
            other = arena.put(torch.full((6000,), 7.0))
        assert other.inline is not None  # the slot under `b` was not handed out again
        assert torch.equal(b, torch.ones(6000))


def test_views_are_private_mappings_of_their_own_pages_without_the_lease_table():
    with ShmArena(1 << 16) as arena:
        h = arena.put(torch.arange(16.0))
        v = open_shared(h)
        line = mapping_of(v.data_ptr())
        lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
        perms, offset = line.split()[1], int(line.split()[2], 16)
        assert perms == "rw-p", line  # copy-on-write: writable, and no write reaches the segment
        assert offset == h.offset - (h.offset % 4096) and offset > 0, line  # not the table pages
        assert hi - lo == 4096, line  # only the pages of this slot
        assert v.untyped_storage().nbytes() == h.nbytes
        with pytest.raises(RuntimeError):
            torch.as_strided(v, (h.offset // 4 + 16,), (1,), 0).sum()  # beyond its storage


def test_readers_in_one_process_keep_their_writes_apart_from_each_other_and_the_producer():
    x = torch.arange(1024.0)
    with ShmArena(1 << 16) as arena:
        h = arena.put(x, readers=2)
        a, b = open_shared(h.for_reader(0)), open_shared(h.for_reader(1))
        a.mul_(-1)
        assert torch.equal(a, -x) and torch.equal(b, x)
        assert torch.equal(open_shared(h.for_reader(0)), -x)  # the same lease: the same view
        slot = torch.frombuffer(arena._segment.mm, dtype=x.dtype, count=x.numel(), offset=h.offset)
        assert torch.equal(slot, x)
        del a, b, slot
        gc.collect()
        assert arena.reclaim() == 1


def test_written_pages_die_with_their_view_and_never_show_in_a_later_slot():
    with ShmArena(1 << 16) as arena:
        first = arena.put(torch.zeros(100))  # 400 bytes: the page's other bytes go to the next slot
        v = open_shared(first)
        v.fill_(9.0)  # copies the whole page privately, the next slot's bytes included
        after = torch.arange(200.0)
        h = arena.put(after)  # written by the producer after the reader's copy was taken
        assert h.offset // 4096 == first.offset // 4096  # shares the written page
        neighbour = open_shared(h)
        assert torch.equal(neighbour, after)
        del v
        gc.collect()
        assert arena.reclaim() == 1
        again = arena.put(torch.full((100,), 5.0))  # the freed slot, reused
        assert again.offset == first.offset
        assert torch.equal(open_shared(again), torch.full((100,), 5.0))


def _write_in_place(handle, conn) -> None:
    v = open_shared(handle)
    conn.send("opened")
    v.add_(1)
    conn.send(v.tolist())


def test_a_reader_writing_in_place_lives_and_others_see_the_original():
    with ShmArena(1 << 16) as arena:
        h = arena.put(torch.arange(16.0), readers=2)
        mine = open_shared(h.for_reader(0))
        parent, child = CTX.Pipe()
        p = CTX.Process(target=_write_in_place, args=(h.for_reader(1), child), daemon=True)
        p.start()
        child.close()
        assert parent.poll(60) and parent.recv() == "opened"
        assert parent.poll(60) and parent.recv() == (torch.arange(16.0) + 1).tolist()
        p.join(60)
        assert p.exitcode == 0
        assert torch.equal(mine, torch.arange(16.0))
        del mine
        gc.collect()
        assert arena.reclaim() == 1  # the writer's lease ended with its view


def _produce_and_exit(conn) -> None:
    arena = ShmArena(1 << 20)
    conn.send(arena.put(torch.arange(8.0)))
    conn.recv()  # the consumer has opened its view; exit (the reaper unlinks the name)


def test_a_dead_producers_mapping_goes_when_the_last_view_dies():
    parent, child = CTX.Pipe()
    p = CTX.Process(target=_produce_and_exit, args=(child,), daemon=True)
    p.start()
    child.close()
    assert parent.poll(60)
    h = parent.recv()
    v = open_shared(h)
    row = v[2:4]
    parent.send("opened")
    p.join(60)
    assert p.exitcode == 0
    assert mapped(h.segment)  # the consumer's mapping holds the memory while views live
    del v
    gc.collect()
    assert mapped(h.segment) and row.tolist() == [2.0, 3.0]
    del row
    gc.collect()
    assert not mapped(h.segment)  # nothing of the exited producer stays in this process


def test_threads_put_read_and_reclaim_concurrently():
    errors: list[BaseException] = []
    stop = threading.Event()
    with ShmArena(1 << 20, max_slots=64, timeout_s=30) as arena:

        def worker(seed: int) -> None:
            g = torch.Generator().manual_seed(seed)
            try:
                for i in range(150):
                    n = int(torch.randint(1, 2000, (1,), generator=g))
                    x = torch.randn(n, generator=g)
                    h = arena.put(x)
                    v = open_shared(h)
                    assert torch.equal(v, x), (seed, i)
                    del v
                    if i % 7 == 0:
                        arena.reclaim()
            except BaseException as e:
                errors.append(e)

        def reclaimer() -> None:
            try:
                while not stop.is_set():
                    arena.reclaim()
            except BaseException as e:
                errors.append(e)

        threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
        threads += [threading.Thread(target=reclaimer) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads[:4]:
            t.join(120)
        stop.set()
        for t in threads[4:]:
            t.join(30)
        assert not errors, errors[:3]
        gc.collect()
        arena.reclaim()
        assert arena.live_slots == 0 and arena.used_bytes == 0
        assert arena._book.alloc._free == [(0, arena.capacity_bytes)]
        assert arena.stats.puts == 600 and arena.stats.inline_puts == 0


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_slots": -1},
        {"max_readers": 0},
        {"max_slots": 1 << 40},
        {"timeout_s": "soon"},
        {"on_full": "drop"},
    ],
)
def test_a_failed_constructor_leaves_no_segment_and_no_reaper(kwargs):
    before_segments, before_children = own_segments(), children()
    with pytest.raises(ValueError):
        ShmArena(1 << 16, **kwargs)
    gc.collect()
    assert own_segments() == before_segments
    assert wait_until(lambda: children() <= before_children)


def test_bad_capacity_is_refused_before_anything_is_created():
    before = own_segments()
    for cap in (0, -4096, 1.5):
        with pytest.raises(ValueError, match="capacity_bytes"):
            ShmArena(cap)
    assert own_segments() == before


def _try_open(handle, conn) -> None:
    try:
        v = open_shared(handle)
        conn.send(("opened", float(v.sum())))
    except ValueError as e:
        conn.send(("refused", str(e)))


def test_one_readers_handle_cannot_be_open_in_two_processes():
    with ShmArena(1 << 16) as arena:
        h = arena.put(torch.ones(16))
        mine = open_shared(h)
        parent, child = CTX.Pipe()
        p = CTX.Process(target=_try_open, args=(h, child), daemon=True)
        p.start()
        child.close()
        assert parent.poll(60)
        kind, detail = parent.recv()
        p.join(60)
        assert kind == "refused" and "open elsewhere" in detail, detail
        assert torch.equal(mine, torch.ones(16))
        assert arena.reclaim() == 0  # still leased to this process's view
        del mine
        gc.collect()
        assert arena.reclaim() == 1


def test_a_mapping_the_kernel_refuses_raises_and_leaves_no_lease(monkeypatch):
    import errno

    import mmferry.transport.shm as shm

    def refuse(*_: object) -> None:
        raise OSError(errno.ENOMEM, "too many mappings (vm.max_map_count)")

    with ShmArena(1 << 16) as arena:
        h = arena.put(torch.ones(64))
        monkeypatch.setattr(shm, "PrivatePages", refuse)
        with pytest.raises(OSError, match="max_map_count"):
            open_shared(h)
        assert arena.reclaim() == 1 and arena.used_bytes == 0  # the slot went back at once
