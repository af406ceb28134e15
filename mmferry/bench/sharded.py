"""DP vision encoder: load balance of mmferry's assignment vs the peers', and 2-rank wall time.

Part 1 (pure host arithmetic, the real Qwen3-VL tower's cost constants): a fixed mixed workload
on 2, 4 and 8 simulated ranks; imbalance = max rank cost / mean rank cost under mmferry's cost
model, for the peers' item-granular largest-first by patch count and for mmferry's assignment.
Part 2 (measured): each rank's local encode time under each placement on 2 ranks, beside the
modelled imbalance. Part 3 (real processes, gloo, CPU): wall time of `encode_sharded` on 2 ranks
vs one process, interleaved per round, with a tiny random Qwen3-VL tower, one thread per rank.

Run: python -m mmferry.bench.sharded [--quick] [--json FILE]
"""

from __future__ import annotations

import os
import random
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from mmferry.bench import harness
from mmferry.config import VisionConfig
from mmferry.encoder.assign import CostModel, assign_work
from mmferry.encoder.sharded import _sub_item
from mmferry.testing.ports import free_port

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


def balance(report: harness.Report, worlds: tuple[int, ...]) -> None:
    """Modelled imbalance (max/mean rank cost) of the peers' placement and of mmferry's."""
    grids = mixed_workload()
    model = CostModel.for_config(QWEN3_VL)
    for world in worlds:
        peers = assign_work(grids, world, merge_size=2, split_frames=False)
        # Re-cost the peers' placement under the same model mmferry balances.
        per_rank = [sum(model.item_cost(grids[s.item]) for s in r) for r in peers.shards]
        peers_imb = max(per_rank) * world / sum(per_rank)
        whole = assign_work(grids, world, merge_size=2, split_frames=False, cost_model=model)
        ours = assign_work(grids, world, merge_size=2, cost_model=model)
        head = f"modelled imbalance, {world} ranks, {len(grids)} items"
        base = "peers (whole items, LPT by patches)"
        for label, value in ((head, ours.imbalance), (f"{head}, no frame split", whole.imbalance)):
            report.add(harness.Figure.of_values(label, base, peers_imb, value, unit="max/mean"))


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


def _rank_times(enc, items, plan, rounds: int) -> list[list[float]]:
    """Each rank's local encode (its shards alone, one thread), timed `rounds` times."""
    subs = [[_sub_item(items[s.item], s) for s in rank] for rank in plan.shards]
    times: list[list[float]] = [[] for _ in subs]
    with torch.inference_mode():
        for r, sub in enumerate(subs):
            enc(sub)  # warm-up
            for _ in range(rounds):
                t0 = time.perf_counter()
                enc(sub)
                times[r].append(time.perf_counter() - t0)
    return times


def measured_balance(report: harness.Report, quick: bool) -> None:
    """Per-rank encode time of each placement on 2 ranks, beside the modelled imbalance."""
    from mmferry.encoder.model import VisionEncoder
    from mmferry.encoder.sharded import plan_for

    rounds = 5 if quick else 9
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        enc = VisionEncoder.random(config=_tiny_config(), seed=0, dtype=torch.float32)
        items = _timing_items(quick)
        grids = [it.grid_thw for it in items]
        ours = plan_for(enc, grids, 2)
        peers = assign_work(grids, 2, merge_size=2, split_frames=False)
        model = CostModel.for_config(enc.config)
        costs = [sum(model.item_cost(grids[s.item]) for s in r) for r in peers.shards]
        peers_model = max(costs) * len(costs) / sum(costs)
        imbalance = lambda ts: [max(r) * len(r) / sum(r) for r in zip(*ts)]  # noqa: E731
        base_t, ours_t = (
            _rank_times(enc, items, peers, rounds),
            _rank_times(enc, items, ours, rounds),
        )
    finally:
        torch.set_num_threads(threads)
    per_rank = lambda ts: ", ".join(f"{statistics.median(t) * 1e3:.1f}" for t in ts)  # noqa: E731
    report.add(
        harness.Figure(
            "measured imbalance (max/mean rank encode time), 2 ranks, tiny tower",
            "peers (whole items, LPT by patches)",
            imbalance(base_t),
            imbalance(ours_t),
            unit="max/mean",
            note=f"per-rank ms: peers [{per_rank(base_t)}], mmferry [{per_rank(ours_t)}]; "
            f"modelled: peers {peers_model:.2f}, mmferry {ours.imbalance:.2f}",
        )
    )


def _rank_main(rank: int, world: int, init: str, quick: bool, rounds: int, out: str) -> None:
    from mmferry.encoder.model import VisionEncoder
    from mmferry.encoder.sharded import encode_sharded

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        enc = VisionEncoder.random(config=_tiny_config(), seed=0, dtype=torch.float32)
        items = _timing_items(quick)

        def sharded() -> None:
            encode_sharded(enc, items)
            dist.barrier()

        def single() -> None:
            if rank == 0:  # the other rank waits at the barrier meanwhile
                enc(items)
            dist.barrier()

        with torch.inference_mode():
            # Every rank runs the same deterministic order, so the barriers line up.
            runners = {"single": harness.timed(single), "sharded": harness.timed(sharded)}
            times = harness.interleave(runners, rounds=rounds)
        if rank == 0:
            with open(out, "w") as f:
                f.write(repr(times))
    finally:
        dist.destroy_process_group()


def wall_time(report: harness.Report, quick: bool) -> None:
    """2 ranks (gloo, one thread each) vs one process with one thread, interleaved per round."""
    import ast

    rounds = 5 if quick else 7
    items = _timing_items(quick)
    patches = sum(it.num_patches for it in items)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "t")
        init = f"tcp://127.0.0.1:{free_port()}"
        mp.spawn(_rank_main, args=(2, init, quick, rounds, out), nprocs=2, join=True)
        with open(out) as f:
            times = ast.literal_eval(f.read())
    report.add(
        harness.Figure(
            f"encode {len(items)} items / {patches} patches, 2 ranks gloo x 1 thread",
            "1 process x 1 thread",
            times["single"],
            times["sharded"],
            note="outputs equal a single-rank encode (tests/encoder/test_sharded.py)",
        )
    )


def run(report: harness.Report, quick: bool) -> None:
    """Modelled balance on 2, 4, 8 ranks; measured per-rank balance and wall time on 2."""
    balance(report, (2, 4, 8))
    measured_balance(report, quick)
    wall_time(report, quick)


def main(argv: list[str] | None = None) -> int:
    return harness.main_for(run, argv, __doc__.splitlines()[0])


if __name__ == "__main__":
    raise SystemExit(main())
