"""DP vision encoder: load balance of mmferry's assignment vs the peers', and 2-rank wall time.

Part 1 (pure host arithmetic, the real Qwen3-VL tower's cost constants): a fixed mixed workload
on 2, 4 and 8 simulated ranks; imbalance = max rank cost / mean rank cost under mmferry's cost
model, for the peers' item-granular largest-first by patch count and for mmferry's assignment.
Part 2 (real processes, gloo, CPU): wall time of `encode_sharded` on 2 ranks vs one process,
with a tiny random Qwen3-VL tower and one torch thread per rank.

Run: python -m bench.sharded [--quick]
"""

from __future__ import annotations

import argparse
import os
import random
import socket
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from mmferry.config import VisionConfig
from mmferry.encoder.assign import CostModel, assign_work

# The public Qwen3-VL vision tower (the cost model needs only its widths).
QWEN3_VL = VisionConfig(
    family="qwen3_vl",
    depth=27,
    hidden_size=1152,
    intermediate_size=4304,
    num_heads=16,
    out_hidden_size=3584,
    hidden_act="gelu_pytorch_tanh",
    patch_size=16,
    deepstack_visual_indexes=(8, 16, 24),
)


def mixed_workload(seed: int = 0) -> list[tuple[int, int, int]]:
    """A few high-resolution images, many small ones and two long videos (Qwen3-VL grids)."""
    rng = random.Random(seed)
    grids = [(1, 68, 120), (1, 90, 160), (1, 50, 62), (1, 120, 160)]
    grids += [(1, 2 * rng.randint(8, 24), 2 * rng.randint(8, 24)) for _ in range(40)]
    # A 4-minute 720p clip at 2 fps (480 frames -> 240 temporal patches of 44x80) and a 1-hour
    # 1080p one capped at 768 frames (384 temporal patches of 8x14).
    grids += [(240, 44, 80), (384, 8, 14)]
    return grids


def balance_table(worlds: tuple[int, ...]) -> list[str]:
    grids = mixed_workload()
    model = CostModel.for_config(QWEN3_VL)
    lines = []
    for world in worlds:
        peers = assign_work(grids, world, merge_size=2, split_frames=False)
        # Re-cost the peers' placement under the same model mmferry balances.
        per_rank = [sum(model.item_cost(grids[s.item]) for s in r) for r in peers.shards]
        peers_imb = max(per_rank) * world / sum(per_rank)
        whole = assign_work(grids, world, merge_size=2, split_frames=False, cost_model=model)
        ours = assign_work(grids, world, merge_size=2, cost_model=model)
        head = f"imbalance (max/mean rank cost), {world} ranks, {len(grids)} items: "
        peers_txt = f"peers (whole items, LPT by patches) {peers_imb:.2f}"
        lines.append(
            f"{head}{peers_txt} | mmferry {ours.imbalance:.3f} | {peers_imb / ours.imbalance:.2f}x"
        )
        lines.append(
            f"{head}{peers_txt} | mmferry cost model without frame split {whole.imbalance:.2f}"
            f" | {peers_imb / whole.imbalance:.2f}x"
        )
    return lines


def _tiny_config() -> VisionConfig:
    return VisionConfig(
        family="qwen3_vl",
        depth=4,
        hidden_size=128,
        intermediate_size=256,
        num_heads=4,
        out_hidden_size=128,
        hidden_act="gelu_pytorch_tanh",
        patch_size=16,
        num_position_embeddings=256,
        deepstack_visual_indexes=(1, 3),
    )


def _timing_items(quick: bool):
    from mmferry.items import MultimodalItem

    g = torch.Generator().manual_seed(0)
    width = 3 * 2 * 16 * 16
    grids = [(1, 32, 48), (1, 48, 32), (1, 24, 24), (1, 16, 32)] * (1 if quick else 2)
    grids += [(8 if quick else 16, 16, 24)]
    return [
        MultimodalItem(
            "image" if t == 1 else "video",
            torch.randn(t * h * w, width, generator=g),
            (t, h, w),
            "hf",
            f"bench-{i}",
        )
        for i, (t, h, w) in enumerate(grids)
    ]


def _time(fn, reps: int) -> float:
    """Best of `reps` runs after one warm-up: the least disturbed by other load on the machine."""
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def _rank_main(rank: int, world: int, init: str, quick: bool, reps: int, out: str) -> None:
    from mmferry.encoder.model import VisionEncoder
    from mmferry.encoder.sharded import encode_sharded

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        enc = VisionEncoder.random(config=_tiny_config(), seed=0, dtype=torch.float32)
        items = _timing_items(quick)

        def run() -> None:
            with torch.inference_mode():
                encode_sharded(enc, items)
            dist.barrier()

        t = _time(run, reps)
        if rank == 0:
            with open(out, "w") as f:
                f.write(repr(t))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wall_time_lines(quick: bool) -> list[str]:
    from mmferry.encoder.model import VisionEncoder

    reps = 3 if quick else 7
    enc = VisionEncoder.random(config=_tiny_config(), seed=0, dtype=torch.float32)
    items = _timing_items(quick)
    patches = sum(it.num_patches for it in items)
    threads = torch.get_num_threads()
    lines = []
    single = {}
    for n in sorted({1, min(2, threads)}):
        torch.set_num_threads(n)
        with torch.inference_mode():
            single[n] = _time(lambda: enc(items), reps)
    torch.set_num_threads(threads)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "t")
        init = f"tcp://127.0.0.1:{_free_port()}"
        mp.spawn(_rank_main, args=(2, init, quick, reps, out), nprocs=2, join=True)
        with open(out) as f:
            sharded = float(f.read())
    what = f"{len(items)} items, {patches} patches, tiny Qwen3-VL tower"
    for n, t in single.items():
        lines.append(
            f"encode {what}, best of {reps}: 1 rank x {n} thread(s) {t * 1e3:.1f} ms | "
            f"2 ranks gloo x 1 thread {sharded * 1e3:.1f} ms | {t / sharded:.2f}x"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    """Print the balance table and the 2-rank wall time beside their baselines."""
    ap = argparse.ArgumentParser(prog="python -m bench.sharded", description=__doc__)
    ap.add_argument("--quick", action="store_true", help="smaller timing batch, fewer repeats")
    ap.add_argument("--no-timing", action="store_true", help="only the balance table")
    args = ap.parse_args(argv)
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"machine: {os.cpu_count()} CPUs, torch {torch.__version__}, load average {load}")
    for line in balance_table((2, 4, 8)):
        print(line)
    if not args.no_timing:
        for line in wall_time_lines(args.quick):
            print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
