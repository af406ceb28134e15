"""Benchmark: materialise features (CPU, and GPU when present) and hand them across processes.

Run: python -m mmferry.bench.materialize [--quick]
"""

from __future__ import annotations

import pickle
import statistics
import time
from collections.abc import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mmferry.bench.harness import Report, compare, main_for
from mmferry.feed.materialize import materialize_features
from mmferry.transport.shm import ShmArena, open_shared

MB = 1 << 20


class _NewBytes(TorchDispatchMode):
    """Sums the bytes of every storage an op creates (a count of allocations, not RSS)."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        leaves = torch.utils._pytree.tree_leaves((args, kwargs))
        ins = {a.untyped_storage().data_ptr() for a in leaves if isinstance(a, torch.Tensor)}
        out = func(*args, **kwargs)
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in ins:
                self.bytes += t.untyped_storage().nbytes()
        return out


def _time(fn: Callable[[], object], reps: int, sync: Callable[[], None] = lambda: None) -> float:
    fn()  # warm-up, excluded
    sync()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _line(label: str, base_name: str, base: float, ours: float, unit: str = "ms") -> None:
    scale = 1e3 if unit == "ms" else 1.0
    print(
        f"{label}: {base_name} {base * scale:.2f} {unit} | mmferry {ours * scale:.2f} {unit} "
        f"| {base / ours:.2f}x"
    )


def bench_cpu(rounds: int, report: Report) -> None:
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(4096, 1536, generator=g) for _ in range(8)]
    big = torch.randn(8 * 4096, 1536, generator=g)
    bf = torch.bfloat16

    def floor() -> torch.Tensor:
        out = torch.empty(big.shape, dtype=bf)
        return out.copy_(big)

    def ours() -> torch.Tensor:
        return materialize_features(xs, device="cpu", dtype=bf)

    assert torch.equal(ours(), torch.cat(xs).to(bf))  # outputs equal before timing
    report.section("cpu 8 x [4096, 1536] float32 -> bfloat16")
    report.add(
        compare(
            "time vs torch.cat(xs).to(dtype)",
            {"baseline": lambda: torch.cat(xs).to(bf), "mmferry": ours},
            rounds=rounds,
        )
    )
    report.add(
        compare(
            "time vs floor (one copy_ with cast; 1.00x = at the floor)",
            {"floor": floor, "mmferry": ours},
            rounds=rounds,
        )
    )
    # On a shared, loaded machine every parallel region waits for its slowest thread; one
    # thread isolates the copy work itself from that per-call scheduling cost.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        report.add(
            compare("time vs floor, 1 thread", {"floor": floor, "mmferry": ours}, rounds=rounds)
        )
    finally:
        torch.set_num_threads(threads)
    out_bytes = big.numel() * 2
    counts = []
    for fn in (
        lambda: torch.cat(xs).to(bf),
        lambda: materialize_features(xs, device="cpu", dtype=bf),
    ):
        mode = _NewBytes()
        with mode:
            fn()
        counts.append(mode.bytes / out_bytes)
    print(
        f"  allocated bytes / output bytes: baseline {counts[0]:.2f}x | mmferry "
        f"{counts[1]:.2f}x | {counts[0] / counts[1]:.2f}x"
    )


def _sent(size: int) -> torch.Tensor:
    """The tensor the producer hands over for `size` MB (the consumer rebuilds it to check)."""
    return torch.randn(size * MB // 4, generator=torch.Generator().manual_seed(size))


def _checksum(t: torch.Tensor) -> int:
    """An exact sum over every 4-byte word: the consumer's read of every byte it was sent."""
    return int(t.view(torch.int32).sum(dtype=torch.int64))


def _consumer(conn) -> None:
    while True:
        msg = conn.recv()
        if msg == "stop":
            return
        kind, check_size = msg
        if kind == "handle":
            t = open_shared(conn.recv())
        elif kind == "tensor":
            t = conn.recv()  # torch.multiprocessing: a tensor whose storage is shared memory
        else:
            t = pickle.loads(conn.recv_bytes())
        # NOTE: every variant does the same work on what it received: one pass over all of it.
        total = _checksum(t)
        equal = None if check_size is None else torch.equal(t, _sent(check_size))
        del t  # the lease (or the shared storage) ends here
        conn.send((total, equal))


def _hand_off(conn, kind: str, send: Callable[[], None], want: int, check: int | None) -> None:
    """One hand-off: the consumer reads all of it; its checksum (and, with `check`, a whole-tensor
    comparison against the `check` MB tensor it rebuilds) must match what was sent."""
    conn.send((kind, check))
    send()
    total, equal = conn.recv()
    if total != want or equal is False:
        raise AssertionError(f"{kind} hand-off: the consumer got other bytes than were sent")


def bench_transport(rounds: int, sizes: list[int], report: Report) -> None:
    # Every variant starts from a pageable tensor in the producer and ends with the consumer
    # having read every byte it was sent (a checksum, checked by the producer in every round);
    # the producer's copy into shared memory counts as transport.
    import torch.multiprocessing as tmp  # registers the shared-memory tensor reductions

    ctx = tmp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_consumer, args=(child,), daemon=True)
    proc.start()
    report.section(
        "transport: a pageable tensor handed to another process and read there in full, "
        "producer copy included"
    )
    try:
        with ShmArena(max(sizes) * MB * 2 + MB) as arena:
            for size in sizes:
                x = _sent(size)
                want = _checksum(x)
                # torch.multiprocessing moves a tensor's storage into shared memory when it is
                # sent, so each call gets a fresh pageable copy made outside the timed region.
                fresh = [x.clone() for _ in range(rounds + 2)]
                senders: dict[str, tuple[str, Callable[[], None]]] = {
                    "mmferry": ("handle", lambda x=x: parent.send(arena.put(x))),
                    "pickle+Pipe": ("bytes", lambda x=x: parent.send_bytes(pickle.dumps(x))),
                    # share_memory_() copy, then an fd over the pipe
                    "torch.multiprocessing": ("tensor", lambda f=fresh: parent.send(f.pop())),
                }

                def deliver(name: str, check: int | None = None, want=want, to=senders) -> None:
                    _hand_off(parent, *to[name], want, check)
                    if name == "mmferry":
                        arena.reclaim()  # the producer takes its slot back

                for name in senders:
                    deliver(name, check=size)  # the whole tensor arrives equal, before timing
                for base_name in ("pickle+Pipe", "torch.multiprocessing"):
                    report.add(
                        compare(
                            f"{size:3d} MB hand-off",
                            {
                                base_name: lambda n=base_name: deliver(n),
                                "mmferry": lambda: deliver("mmferry"),
                            },
                            rounds=rounds,
                        )
                    )
                assert arena.live_slots == 0
    finally:
        parent.send("stop")
        proc.join(30)


def bench_gpu(reps: int) -> None:
    dev = torch.device("cuda")
    sync = torch.cuda.synchronize
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(4096, 1536, generator=g) for _ in range(8)]
    u8 = [torch.randint(0, 256, (4096, 1536), generator=g, dtype=torch.uint8) for _ in range(8)]
    pinned = torch.empty(8 * 4096 * 1536 * 2, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty_like(pinned, device=dev)
    h2d = _time(lambda: dst.copy_(pinned, non_blocking=True), reps, sync)
    print(f"gpu ({torch.cuda.get_device_name()}): pinned H2D {pinned.numel() / h2d / 1e9:.1f} GB/s")
    for name, src in (("float32", xs), ("compact uint8", u8)):
        base = _time(lambda src=src: torch.cat(src).to(dev, torch.bfloat16), reps, sync)
        ours = _time(
            lambda src=src: materialize_features(src, device=dev, dtype=torch.bfloat16), reps, sync
        )
        gbps = sum(t.numel() * t.element_size() for t in src) / ours / 1e9
        _line(
            f"  8 x [4096, 1536] {name} cpu -> cuda bf16 ({gbps:.1f} GB/s read)",
            "baseline",
            base,
            ours,
        )
        temps = []
        for fn in (
            lambda src=src: torch.cat(src).to(dev, torch.bfloat16),
            lambda src=src: materialize_features(src, device=dev, dtype=torch.bfloat16),
        ):
            sync()
            torch.cuda.reset_peak_memory_stats()
            start = torch.cuda.memory_allocated()
            out = fn()
            sync()
            temps.append(torch.cuda.max_memory_allocated() - start - out.numel() * 2)
            del out
        print(
            f"  temporary device memory: baseline {temps[0] / MB:.1f} MB | mmferry "
            f"{temps[1] / MB:.1f} MB"
        )


def run(report: Report, quick: bool) -> None:
    """CPU materialisation, the cross-process hand-off, and the GPU path when CUDA is present."""
    bench_cpu(5 if quick else 7, report)
    bench_transport(5 if quick else 7, [4, 16] if quick else [4, 16, 64], report)
    if torch.cuda.is_available():
        report.section("materialize (cuda)")
        bench_gpu(3 if quick else 10)


def main(argv: list[str] | None = None) -> int:
    return main_for(run, argv, __doc__.splitlines()[0])


if __name__ == "__main__":
    raise SystemExit(main())
