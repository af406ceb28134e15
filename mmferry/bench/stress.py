"""Stress: producer and consumer processes, random sizes and dtypes, random consumer SIGKILLs.

Every delivery is checked against the producer's checksum; every feature a killed consumer
took but never confirmed is cancelled; at the end every producer must have reclaimed every slot,
and no producer's segment may remain. The test suite runs a short version
(`tests/transport/test_stress.py`).

Run: python -m mmferry.bench.stress [--items N] [--producers P] [--consumers C] [--kill-rate R]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import random
import signal
import time
from collections import deque
from dataclasses import dataclass, field
from multiprocessing import connection

import torch

from mmferry.transport.shm import ArenaFullError, ShmArena, open_shared

IN_FLIGHT = 4
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.uint8, torch.int64)


def _digest(t: torch.Tensor) -> str:
    return hashlib.blake2b(t.contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()


def _producer(index: int, items: int, seed: int, capacity: int, conn) -> None:
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    arena = ShmArena(capacity, max_slots=256, timeout_s=0.2)
    handles = {}

    def serve_cancels() -> None:
        while conn.poll():
            _, item = conn.recv()
            arena.cancel(handles.pop(item))

    for item in range(items):
        dtype = rng.choice(DTYPES)
        n = rng.randint(1, 32 * 1024)
        x = (torch.randn(n, generator=g) * 100).to(dtype)
        while True:
            serve_cancels()
            try:
                h = arena.put(x)
                break
            except ArenaFullError:
                continue  # consumers are busy or were killed: cancellations free space
        handles[item] = h
        conn.send(("item", index, item, h, _digest(x)))
    conn.send(("produced", index))
    while True:
        msg = conn.recv()
        if msg[0] == "cancel":
            arena.cancel(handles.pop(msg[1]))
        elif msg[0] == "finish":
            for item in msg[1]:
                handles.pop(item, None)
            for h in handles.values():  # routed to a consumer that died before confirming
                arena.cancel(h)
            deadline = time.monotonic() + 30
            while arena.live_slots and time.monotonic() < deadline:
                arena.reclaim()
                time.sleep(0.01)
            conn.send(("report", index, arena.name, arena.live_slots, arena.used_bytes))
            arena.close()
            return


def _consumer(conn) -> None:
    while True:
        msg = conn.recv()
        if msg is None:
            return
        producer, item, handle, digest = msg
        view = open_shared(handle)
        ok = _digest(view) == digest and tuple(view.shape) == handle.shape
        del view  # the lease ends here
        conn.send((producer, item, ok))


@dataclass
class StressResult:
    items: int
    delivered: int = 0
    corrupt: int = 0
    kills: int = 0
    cancelled: int = 0
    leaked_slots: int = 0
    leaked_bytes: int = 0
    segments_left: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def line(self) -> str:
        return (
            f"items {self.items} | deliveries {self.delivered} | kills {self.kills} | cancelled "
            f"after a kill {self.cancelled} | corrupt {self.corrupt} | leaked slots "
            f"{self.leaked_slots} ({self.leaked_bytes} bytes), segments left "
            f"{len(self.segments_left)} | {self.seconds:.1f} s"
        )


def run_stress(
    *,
    producers: int = 2,
    consumers: int = 3,
    items: int = 200,
    kill_rate: float = 0.03,
    min_kills: int = 2,
    capacity: int = 2 << 20,
    seed: int = 0,
) -> StressResult:
    """Run one stress round in real processes and return what happened."""
    import multiprocessing as mp

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "mmferry.transport.shm", __name__])
    rng = random.Random(seed)
    t0 = time.monotonic()
    res = StressResult(items=producers * items)
    prod = []
    for i in range(producers):
        a, b = ctx.Pipe()
        p = ctx.Process(target=_producer, args=(i, items, seed * 100 + i, capacity, b))
        p.start()
        b.close()
        prod.append((p, a))
    cons: dict[object, tuple[object, dict]] = {}  # conn -> (process, outstanding items)

    def start_consumer() -> None:
        a, b = ctx.Pipe()
        p = ctx.Process(target=_consumer, args=(b,), daemon=True)
        p.start()
        b.close()
        cons[a] = (p, {})

    def kill(conn) -> None:
        p, outstanding = cons.pop(conn)
        os.kill(p.pid, signal.SIGKILL)
        p.join(30)
        res.kills += 1
        for producer, item in outstanding:
            prod[producer][1].send(("cancel", item))
            res.cancelled += 1
        start_consumer()

    prod_conns = {c for _, c in prod}
    waiting: deque = deque()
    for _ in range(consumers):
        start_consumer()
    confirmed: list[set[int]] = [set() for _ in range(producers)]
    produced = 0
    done = 0
    # Kill at least `min_kills` times, spread over the run, plus random kills.
    forced = {int(res.items * (k + 1) / (min_kills + 1)) for k in range(min_kills)}
    try:
        while produced < producers or done + res.cancelled < res.items:
            ready = connection.wait([c for _, c in prod] + list(cons), timeout=60)
            if not ready:
                raise TimeoutError("stress run stalled for 60 s")
            for conn in ready:
                if conn not in cons and conn not in prod_conns:
                    continue  # a consumer killed earlier in this batch
                if conn in cons:
                    try:
                        producer, item, ok = conn.recv()
                    except (EOFError, OSError):
                        continue
                    cons[conn][1].pop((producer, item), None)
                    confirmed[producer].add(item)
                    done += 1
                    res.delivered += ok
                    res.corrupt += not ok
                    if done in forced or rng.random() < kill_rate:
                        kill(rng.choice(list(cons)))
                    continue
                msg = conn.recv()
                if msg[0] == "produced":
                    produced += 1
                    continue
                waiting.append(msg[1:])
            # NOTE: at most IN_FLIGHT items per consumer, so a kill loses a few, as in a server
            # with bounded queues; the rest wait here while the arenas apply backpressure.
            free = [c for c, (_, out) in cons.items() if len(out) < IN_FLIGHT]
            while waiting and free:
                producer, item, handle, digest = waiting.popleft()
                target = rng.choice(free)
                cons[target][1][(producer, item)] = True
                target.send((producer, item, handle, digest))
                if len(cons[target][1]) >= IN_FLIGHT:
                    free.remove(target)
        for conn, (p, _) in list(cons.items()):
            conn.send(None)
            p.join(30)
        for i, (p, conn) in enumerate(prod):
            conn.send(("finish", sorted(confirmed[i])))
            _, _, name, live, used = conn.recv()
            p.join(60)
            res.leaked_slots += live
            res.leaked_bytes += used
            deadline = time.monotonic() + 10
            while os.path.exists("/dev/shm" + name) and time.monotonic() < deadline:
                time.sleep(0.02)
            if os.path.exists("/dev/shm" + name):
                res.segments_left.append(name)
    finally:
        for p, _ in prod:
            if p.is_alive():
                p.kill()
        for p, _ in cons.values():
            if p.is_alive():
                p.kill()
    res.seconds = time.monotonic() - t0
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mmferry.bench.stress", description=__doc__)
    ap.add_argument("--items", type=int, default=1000, help="features per producer")
    ap.add_argument("--producers", type=int, default=4)
    ap.add_argument("--consumers", type=int, default=4)
    ap.add_argument("--kill-rate", type=float, default=0.01, help="kills per delivery")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    from mmferry.bench.harness import machine

    print(f"machine: {machine()}")
    bad = 0
    for r in range(args.rounds):
        res = run_stress(
            producers=args.producers,
            consumers=args.consumers,
            items=args.items,
            kill_rate=args.kill_rate,
            min_kills=4,
            capacity=8 << 20,
            seed=r,
        )
        print(f"round {r}: {res.line()}", flush=True)
        bad += res.corrupt + res.leaked_slots + len(res.segments_left)
        bad += res.delivered + res.cancelled != res.items
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
