"""DP-sharded encode in real processes (gloo, CPU) against the single-process encode."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from mmferry.encoder.model import VisionEncoder
from mmferry.encoder.sharded import (
    ShardedEncodeError,
    encode_sharded,
    encode_sharded_packed,
    plan_for,
)
from mmferry.items import MultimodalItem
from mmferry.models import spec_for

# The tiny Qwen3-VL tower (two deepstack taps), seeded random weights.
TINY = spec_for("qwen3_vl").tiny_config
WIDTH = TINY.in_channels * TINY.temporal_patch_size * TINY.patch_size**2
SCENARIOS: dict[str, list[tuple[int, int, int]]] = {
    "one_image": [(1, 8, 8)],
    "two_images": [(1, 8, 8), (1, 4, 8)],
    "video_and_images": [(1, 4, 4), (12, 8, 8), (1, 4, 8), (1, 8, 4)],
    "compact_u8": [(6, 8, 8), (1, 4, 8)],
    "none": [],
}
SPAWN_TIMEOUT_S = 150
# A hang fails the test instead of blocking CI (the spawn itself also has a deadline).
pytestmark = pytest.mark.timeout(SPAWN_TIMEOUT_S + 30)


def _feature(name: str, t: int, h: int, w: int, g: torch.Generator) -> torch.Tensor:
    if name == "compact_u8":
        # Raw uint8 patches; images carry no temporal copy.
        width = WIDTH if t > 1 else WIDTH // 2
        return torch.randint(0, 256, (t * h * w, width), dtype=torch.uint8, generator=g)
    # Float32 features on the CPU, as after a device pool fell back to host memory.
    return torch.randn(t * h * w, WIDTH, generator=g)


def _items(name: str) -> list[MultimodalItem]:
    g = torch.Generator().manual_seed(len(name))
    layout = "compact-u8" if name == "compact_u8" else "hf"
    return [
        MultimodalItem(
            "image" if t == 1 else "video",
            _feature(name, t, h, w, g),
            (t, h, w),
            layout,
            f"{name}-{i}",
        )
        for i, (t, h, w) in enumerate(SCENARIOS[name])
    ]


def _encoder(dtype: torch.dtype) -> VisionEncoder:
    return VisionEncoder.random(config=TINY, seed=7, device="cpu", dtype=dtype)


def _flat(outs) -> list[tuple[torch.Tensor, ...]]:
    return [(o.embeds.clone(), *(d.clone() for d in o.deepstack)) for o in outs]


def _install_gather_spy(calls: list) -> None:
    # Wraps the real collective (it still runs) to record what each rank contributed.
    name = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
    real = getattr(dist, name)

    def spy(out, inp, group=None, async_op=False):
        calls.append({"device": inp.device, "dtype": inp.dtype, "shape": tuple(inp.shape)})
        return real(out, inp, group=group, async_op=async_op)

    setattr(dist, name, spy)


def _worker(rank: int, world: int, tmp: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/pg", rank=rank, world_size=world)
    calls: list = []
    _install_gather_spy(calls)
    res: dict = {}
    try:
        enc32, enc64 = _encoder(torch.float32), _encoder(torch.float64)
        for name in SCENARIOS:
            before = len(calls)
            res[name] = _flat(encode_sharded(enc32, _items(name)))
            res[f"{name}/gathers"] = calls[before:]
        items = _items("video_and_images")
        feats = torch.cat([it.feature for it in items])
        res["packed"] = _flat(encode_sharded_packed(enc32, feats, [it.grid_thw for it in items]))
        # Float32 CPU features, float64 encoder: every buffer must follow the encoder.
        before = len(calls)
        res["f64"] = _flat(encode_sharded(enc64, _items("one_image")))
        res["f64/gathers"] = calls[before:]
        # Rank 1 gets a feature of the wrong width: every rank must fail, none may hang.
        bad = _items("two_images")
        if rank == 1:
            bad[1] = MultimodalItem("image", torch.randn(32, 5), (1, 4, 8), "hf", "bad")
        try:
            encode_sharded(enc32, bad)
            res["failure"] = None
        except Exception as e:  # recorded for the parent to check
            res["failure"] = (type(e).__name__, str(e), getattr(e, "failed_ranks", None))
        # The group is still in step after a failure.
        res["after_failure"] = _flat(encode_sharded(enc32, _items("two_images")))
    finally:
        torch.save(res, f"{tmp}/rank{rank}.pt")
        dist.destroy_process_group()


def _spawn(world: int, tmp: Path, worker=_worker) -> list[dict]:
    ctx = mp.start_processes(
        worker, args=(world, str(tmp)), nprocs=world, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + SPAWN_TIMEOUT_S
    while not ctx.join(timeout=1.0):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            pytest.fail(f"{world}-rank sharded encode did not finish in {SPAWN_TIMEOUT_S}s")
    return [torch.load(tmp / f"rank{r}.pt") for r in range(world)]


def _assert_equal(got, ref_outs, tol: float) -> None:
    ref = [(o.embeds, *o.deepstack) for o in ref_outs]
    assert len(got) == len(ref)
    for g_item, r_item in zip(got, ref):
        assert len(g_item) == len(r_item) == 1 + len(TINY.deepstack_visual_indexes)
        for g, r in zip(g_item, r_item):
            assert g.shape == r.shape and g.dtype == r.dtype
            assert (g - r).abs().max().item() <= tol


@pytest.fixture(scope="module", params=[2, 3])
def ranks(request, tmp_path_factory) -> tuple[int, list[dict]]:
    world = request.param
    return world, _spawn(world, tmp_path_factory.mktemp(f"dp{world}"))


@pytest.mark.parametrize("name", [n for n in SCENARIOS if n != "none"])
def test_every_rank_gets_the_single_process_outputs_in_order(ranks, name):
    world, results = ranks
    ref = _encoder(torch.float32)(_items(name))
    for res in results:
        _assert_equal(res[name], ref, 1e-5)
        # One collective per call, whatever the rank's share.
        assert len(res[f"{name}/gathers"]) == 1


def test_no_items_no_collective(ranks):
    _, results = ranks
    for res in results:
        assert res["none"] == [] and res["none/gathers"] == []


@pytest.mark.parametrize(("name", "video"), [("video_and_images", 1), ("compact_u8", 0)])
def test_video_is_split_by_frames(name, video):
    for world in (2, 3):
        plan = plan_for(_encoder(torch.float32), SCENARIOS[name], world)
        video_shards = [s for r in plan.shards for s in r if s.item == video]
        assert len(video_shards) > 1, "the workload should make the video split across ranks"


def test_packed_variant(ranks):
    _, results = ranks
    ref = _encoder(torch.float32)(_items("video_and_images"))
    for res in results:
        _assert_equal(res["packed"], ref, 1e-5)


def test_empty_rank_buffers_follow_the_encoder_not_the_input(ranks):
    world, results = ranks
    plan = plan_for(_encoder(torch.float64), SCENARIOS["one_image"], world)
    empty = [r for r in range(world) if not plan.shards[r]]
    assert empty, "one image on several ranks leaves a rank empty"
    ref = _encoder(torch.float64)(_items("one_image"))
    rows = max(plan.rows)
    for res in results:
        (g,) = res["f64/gathers"]
        # Inputs were float32 on the CPU; the encoder is float64 on "cpu".
        assert g["dtype"] == torch.float64 and g["device"] == torch.device("cpu")
        # [1 + deepstack planes, max_rows + status row, out_hidden], also on an empty rank.
        assert g["shape"] == ((1 + 2) * (rows + 1), TINY.out_hidden_size)
        _assert_equal(res["f64"], ref, 1e-12)
    assert all(results[r]["f64/gathers"][0]["dtype"] == torch.float64 for r in empty)


def test_a_failing_rank_fails_every_rank_clearly(ranks):
    world, results = ranks
    for r, res in enumerate(results):
        kind, msg, failed = res["failure"]
        if r == 1:
            assert kind == "ValueError" and "5 columns" in msg
        else:
            assert kind == ShardedEncodeError.__name__
            assert failed == (1,) and "rank(s) [1]" in msg
    ref = _encoder(torch.float32)(_items("two_images"))
    for res in results:
        _assert_equal(res["after_failure"], ref, 1e-5)


def test_without_a_process_group_it_is_a_plain_encode():
    assert not dist.is_initialized()
    enc = _encoder(torch.float32)
    items = _items("video_and_images")
    ref = enc(items)
    got = encode_sharded(enc, items)
    _assert_equal(_flat(got), ref, 0.0)
    assert encode_sharded(enc, []) == []


def _cuda_worker(rank: int, world: int, tmp: str) -> None:
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{tmp}/pg", rank=rank, world_size=world)
    calls: list = []
    _install_gather_spy(calls)
    res: dict = {}
    try:
        enc = VisionEncoder.random(config=TINY, seed=7, device=f"cuda:{rank}", dtype=torch.bfloat16)
        # CPU float32 features (a pool fell back to host memory); one image, so rank 1 is empty.
        outs = encode_sharded(enc, _items("one_image"))
        res["out"] = [tuple(t.float().cpu() for t in (o.embeds, *o.deepstack)) for o in outs]
        res["gathers"] = [(c["device"].type, c["dtype"]) for c in calls]
    finally:
        torch.save(res, f"{tmp}/rank{rank}.pt")
        dist.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL across ranks needs two GPUs")
def test_nccl_empty_rank_with_cpu_features(tmp_path):
    results = _spawn(2, tmp_path, _cuda_worker)
    enc = VisionEncoder.random(config=TINY, seed=7, device="cuda:0", dtype=torch.bfloat16)
    (ref,) = enc(_items("one_image"))
    for res in results:
        assert res["gathers"] == [("cuda", torch.bfloat16)]
        (got,) = res["out"]
        for g, r in zip(got, (ref.embeds, *ref.deepstack)):
            # Same kernels on the same GPU model: equal up to bf16 rounding at most.
            torch.testing.assert_close(g.bfloat16(), r.cpu())
