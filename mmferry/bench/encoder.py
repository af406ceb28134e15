"""Vision tower: mmferry vs transformers' vision models, same random weights, same batch.

CPU, float32 (always): the Qwen3-VL-2B tower (24 layers x 1024) with seeded random weights,
copied into transformers' tower; a mixed batch of two 448x448 images, one 896x672 image and a
4-frame 448x448 video. The pixels are random uint8; transformers gets them normalised in HF
layout, mmferry gets the same HF rows and, on a second line, the compact-u8 rows. Outputs
(embeddings and every deepstack level) are checked against transformers' first, within a stated
tolerance; then the forward times are interleaved over 5 rounds (median and spread, warm-up
excluded). Then packed attention alone: one call for a batch of mixed frame sizes against a
loop of one call per item (outputs checked equal first).
GPU, bfloat16 (only when CUDA is available): the same batch, plus images/s for batches of
448x448 and 1344x1344 images.
--full (CUDA only): the full-size towers (--towers; random weights) in bfloat16: images/s at
448x448 (32 a call) and 1344x1344 (4 a call) beside transformers at the same shapes; eager vs
CUDA graphs at 1, 4 and 32 images of 448x448; each mmferry figure with its model FLOPs
utilisation (FLOPs a forward / median time / the device's dense bf16 peak).

Run: python -m mmferry.bench.encoder [--quick] [--json FILE] [--full [--towers A,B]
     [--rounds N] [--peak-tflops X]]   (--quick: 4 layers, a smaller batch)
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
from collections.abc import Callable, Sequence

import torch

from mmferry.bench import harness
from mmferry.config import VisionConfig
from mmferry.encoder import attention
from mmferry.encoder.flops import bf16_peak, tower_flops, utilisation
from mmferry.encoder.model import VisionEncoder
from mmferry.items import MultimodalItem
from mmferry.models import preset, spec_for

P, T, C = 16, 2, 3


def _qwen3_vl_8b() -> VisionConfig:
    # Qwen3-VL-8B's tower: 27 layers x 1152, deepstack taps 8, 16, 24, into a 4096-wide LLM.
    return dataclasses.replace(
        spec_for("qwen3-vl").random_config,
        depth=27,
        hidden_size=1152,
        intermediate_size=4304,
        out_hidden_size=4096,
        deepstack_visual_indexes=(8, 16, 24),
    )


# The full-size towers --full times, by name: (preset, config).
TOWERS: dict[str, Callable[[], VisionConfig]] = {
    "qwen2.5-vl-7b": lambda: spec_for("qwen2.5-vl").random_config,  # 32 layers x 1280
    "qwen3-vl-2b": lambda: spec_for("qwen3-vl").random_config,  # 24 layers x 1024
    "qwen3-vl-8b": _qwen3_vl_8b,
}


def _grid(height: int, width: int, frames: int = 1, patch: int = P) -> tuple[int, int, int]:
    return (frames // T if frames > 1 else 1, height // patch, width // patch)


def make_items(
    grids, seed: int = 0, model: str = "qwen3-vl", patch: int = P
) -> tuple[list[MultimodalItem], list[MultimodalItem]]:
    """The same random pixels as compact-u8 items and as normalised HF-layout items."""
    gen = torch.Generator().manual_seed(seed)
    p = preset(model)
    compact, hf = [], []
    for i, (t, h, w) in enumerate(grids):
        n = t * h * w
        video = t > 1
        shape = (n, C, T, patch, patch) if video else (n, C, patch, patch)
        u8 = torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8)
        mean, std = (p.video_mean, p.video_std) if video else (p.image_mean, p.image_std)
        view = (1, C) + (1,) * (u8.dim() - 2)
        x = (u8.float() / 255 - torch.tensor(mean).view(view)) / torch.tensor(std).view(view)
        if not video:  # HF repeats an image to T identical frames
            x = x[:, :, None].expand(n, C, T, patch, patch)
        modality = "video" if video else "image"
        compact.append(MultimodalItem(modality, u8.reshape(n, -1), (t, h, w), "compact-u8", f"{i}"))
        hf.append(MultimodalItem(modality, x.reshape(n, -1).contiguous(), (t, h, w), "hf", f"{i}"))
    return compact, hf


# transformers' vision model class of each family, for the baseline.
_HF_VISION = {
    "qwen3_vl": ("Qwen3VLConfig", "qwen3_vl.modeling_qwen3_vl", "Qwen3VLVisionModel"),
    "qwen2_5_vl": (
        "Qwen2_5_VLConfig",
        "qwen2_5_vl.modeling_qwen2_5_vl",
        "Qwen2_5_VisionTransformerPretrainedModel",
    ),
}


def hf_tower(enc: VisionEncoder, device: str, dtype: torch.dtype):
    """transformers' vision model of `enc`'s family holding `enc`'s weights."""
    import importlib

    import transformers

    from mmferry.testing.checkpoints import hf_vision

    c = enc.config
    config_name, module, cls_name = _HF_VISION[c.family]
    vision = getattr(transformers, config_name)(vision_config=hf_vision(c.family, c)).vision_config
    vision._attn_implementation = "sdpa"
    cls = getattr(importlib.import_module(f"transformers.models.{module}"), cls_name)
    with torch.device(device):  # initialised where it runs: a full-size tower inits fast there
        model = cls(vision)  # non-persistent rope buffers need a real init
    model.load_state_dict(enc.tower.state_dict(), strict=True)
    return model.eval().to(device=device, dtype=dtype)


def _check(name: str, outs, ref_out, grids, atol: float) -> float:
    """Raise unless every item's embeddings and deepstack rows match transformers'."""
    sizes = [t * h * w // 4 for t, h, w in grids]
    if len(outs[0].deepstack) != len(getattr(ref_out, "deepstack_features", None) or []):
        raise AssertionError(f"{name}: deepstack levels differ from transformers'")
    worst = 0.0
    levels = [ref_out.pooler_output, *(getattr(ref_out, "deepstack_features", None) or [])]
    for level, want in enumerate(levels):
        for i, (o, r) in enumerate(zip(outs, want.split(sizes))):
            got = o.embeds if level == 0 else o.deepstack[level - 1]
            harness.check_equal(f"{name} item {i} level {level}", got.float(), r.float(), atol=atol)
            worst = max(worst, (got.float() - r.float()).abs().max().item())
    return worst


def bench_batch(report, enc, ref, grids, device, dtype, rounds, sync, atol) -> None:
    compact, hf = make_items(grids)
    x = torch.cat([it.feature for it in hf]).to(device=device, dtype=dtype)
    grid_thw = torch.tensor(grids, device=device)
    patches = sum(a * b * c for a, b, c in grids)
    with torch.inference_mode():
        want = ref(x, grid_thw=grid_thw)
        d_hf = _check("hf", enc(hf), want, grids, atol)
        d_u8 = _check("compact-u8", enc(compact), want, grids, atol)
        for label, items, diff in (("hf layout", hf, d_hf), ("compact-u8 input", compact, d_u8)):
            report.add(
                harness.compare(
                    f"{device} {str(dtype).removeprefix('torch.')} forward, {label}, "
                    f"{len(grids)} items / {patches} patches",
                    {
                        "transformers": lambda: ref(x, grid_thw=grid_thw),
                        "mmferry": lambda i=items: enc(i),
                    },
                    rounds=rounds,
                    sync=sync,
                    note=f"max abs diff {diff:.1e}, allowed {atol:g}",
                )
            )


def bench_throughput(report, enc, ref, side: int, count: int, device, dtype, rounds, sync) -> None:
    grids = [_grid(side, side)] * count
    compact, hf = make_items(grids, seed=1)
    x = torch.cat([it.feature for it in hf]).to(device=device, dtype=dtype)
    grid_thw = torch.tensor(grids, device=device)
    with torch.inference_mode():
        _check("throughput", enc(compact), ref(x, grid_thw=grid_thw), grids, 0.25)
        report.add(
            harness.compare(
                f"{side}x{side} x{count} images/s (compact-u8)",
                {
                    "transformers": lambda: ref(x, grid_thw=grid_thw),
                    "mmferry": lambda: enc(compact),
                },
                rounds=rounds,
                sync=sync,
                per=count,
                unit="images/s",
            )
        )


def _per_item_attention(q, k, v, batch) -> torch.Tensor:
    """The baseline: one SDPA call per sequence, in a loop (4-D views, as the tower's runs
    pass them, so SDPA picks the same fused kernel)."""
    n, h, d = q.shape
    out = q.new_empty((n, h, d))
    for start, end in zip(batch.cu_seqlens[:-1].tolist(), batch.cu_seqlens[1:].tolist()):
        qs, ks, vs = (x[None, start:end].transpose(1, 2) for x in (q, k, v))  # [1, H, L, D]
        one = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs)
        out[start:end] = one[0].transpose(0, 1)
    return out.view(n, h * d)


def bench_attention(report, lengths: Sequence[int], rounds: int) -> None:
    """Packed attention for frames of mixed sizes: one call vs a loop over items (CPU)."""
    gen = torch.Generator().manual_seed(0)
    heads, head_dim = 16, 64  # Qwen3-VL-2B's tower
    q, k, v = torch.randn(sum(lengths), 3, heads, head_dim, generator=gen).unbind(1)
    batch = attention.varlen_batch(lengths)
    one = attention.sdpa_varlen(q, k, v, batch)
    harness.check_equal("attention one call", one, _per_item_attention(q, k, v, batch), atol=1e-4)
    report.add(
        harness.compare(
            f"cpu float32 attention, {len(lengths)} frames / {sum(lengths)} patches "
            f"(sizes {min(lengths)}-{max(lengths)})",
            {
                "per-item loop": lambda: _per_item_attention(q, k, v, batch),
                "mmferry": lambda: attention.sdpa_varlen(q, k, v, batch),
            },
            rounds=rounds,
        )
    )


def run(report: harness.Report, quick: bool) -> None:
    """CPU float32 batch (always); GPU bfloat16 batch and images/s when CUDA is present."""
    cfg = spec_for("qwen3-vl").random_config
    if quick:
        cfg = dataclasses.replace(cfg, depth=4, deepstack_visual_indexes=(1,))
        grids = [_grid(224, 224), _grid(224, 224), _grid(448, 320), _grid(224, 224, frames=4)]
    else:
        grids = [_grid(448, 448), _grid(448, 448), _grid(896, 672), _grid(448, 448, frames=4)]
    print(f"tower: Qwen3-VL-2B shape, {cfg.depth} layers, random weights; transformers 5.24 sdpa")
    enc = VisionEncoder.random(config=cfg, seed=0)
    ref = hf_tower(enc, "cpu", torch.float32)
    # float32 on the CPU: the same maths in another summation order.
    bench_batch(report, enc, ref, grids, "cpu", torch.float32, 5, lambda: None, 1e-3)
    del enc, ref
    # Frames of 448x448-ish images at patch 16, sizes close enough for the one padded call.
    sizes = [784, 728, 840, 812, 756, 784] if quick else [784, 728, 840, 812, 756, 784, 700, 812]
    bench_attention(report, sizes, 5)
    if not torch.cuda.is_available():
        print("GPU figures skipped: CUDA is not available")
        return
    enc = VisionEncoder.random(config=cfg, seed=0, device="cuda", dtype=torch.bfloat16)
    ref = hf_tower(enc, "cuda", torch.bfloat16)
    sync = torch.cuda.synchronize
    # bfloat16 keeps 8 bits of mantissa; kernels differ in rounding, so rows agree to ~1e-1.
    bench_batch(report, enc, ref, grids, "cuda", torch.bfloat16, 10, sync, 0.25)
    bench_throughput(report, enc, ref, 448, 32, "cuda", torch.bfloat16, 10, sync)
    bench_throughput(report, enc, ref, 1344, 4, "cuda", torch.bfloat16, 10, sync)


# -- --full: the full-size towers on CUDA ----------------------------------------------------


def _with_mfu(fig: harness.Figure, flops: int, count: int, peak: float | None) -> harness.Figure:
    """`fig` (images/s) with the model FLOPs utilisation of its mmferry median in the note."""
    if peak is None:
        return fig
    seconds = count / statistics.median(fig.ours)
    mfu = f"mmferry MFU {utilisation(flops, seconds, peak):.1%} of {peak / 1e12:.0f} TFLOP/s"
    base = utilisation(flops, count / statistics.median(fig.base), peak)
    mfu += f", {fig.base_name} {base:.1%}"
    note = f"{fig.note}; {mfu}" if fig.note else mfu
    return dataclasses.replace(fig, note=note)


def _tolerance(ref: torch.Tensor) -> float:
    # bfloat16 through 24-32 random-weight layers: rows agree to a few per cent of their scale.
    return 0.05 * ref.float().abs().max().item() + 0.25


def bench_tower(
    report,
    name: str,
    rounds: int,
    peak: float | None,
    *,
    config: VisionConfig | None = None,
    device: str = "cuda",
    shapes: Sequence[tuple[int, int]] = ((448, 32), (1344, 4)),
    latency: Sequence[int] = (1, 4, 32),
) -> None:
    """One full-size tower in bfloat16: images/s beside transformers at `shapes` (side,
    images a call), and eager vs CUDA graphs at `latency` images of 448x448. On the CPU (a
    smoke test of this path) the graphs side is the padded path without capture."""
    cfg = config or TOWERS[name]()
    model = spec_for(cfg.family).preset_name
    dev, dtype = device, torch.bfloat16
    cuda = torch.device(dev).type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    eager = VisionEncoder.random(config=cfg, seed=0, device=dev, dtype=dtype)
    graphs = VisionEncoder(
        eager.tower,
        cfg,
        device=dev,
        dtype=dtype,
        attention=eager.attention,
        mean_std=_mean_std(model),
        random_weights=True,
        cuda_graphs=cuda,
        token_budgets=None if cuda else (64, 256),  # the CPU smoke's small batches
    )
    ref = hf_tower(eager, dev, dtype)
    print(f"tower {name}: {cfg.depth} layers x {cfg.hidden_size}, random weights, {eager}")
    for side, count in shapes:
        grids = [_grid(side, side, patch=cfg.patch_size)] * count
        compact, hf = make_items(grids, seed=1, model=model, patch=cfg.patch_size)
        x = torch.cat([it.feature for it in hf]).to(device=dev, dtype=dtype)
        grid_thw = torch.tensor(grids, device=dev)
        flops = tower_flops(cfg, grids)
        with torch.inference_mode():
            want = ref(x, grid_thw=grid_thw)
            atol = _tolerance(want.pooler_output)
            _check(f"{name} eager", eager(compact), want, grids, atol)
            _check(f"{name} graphs", graphs(compact), want, grids, atol)
            fig = harness.compare(
                f"{name} {side}x{side} x{count} images/s (compact-u8, eager)",
                {
                    "transformers": lambda x=x, g=grid_thw: ref(x, grid_thw=g),
                    "mmferry": lambda c=compact: eager(c),
                },
                rounds=rounds,
                sync=sync,
                per=count,
                unit="images/s",
                note=f"{flops / count / 1e9:.0f} GFLOP an image",
            )
            report.add(_with_mfu(fig, flops, count, peak))
    for count in latency:  # the latency case, and a full batch
        grids = [_grid(448, 448, patch=cfg.patch_size)] * count
        compact, _ = make_items(grids, seed=2, model=model, patch=cfg.patch_size)
        flops = tower_flops(cfg, grids)
        with torch.inference_mode():
            want = eager(compact)
            for g, w in zip(graphs(compact), want):
                harness.check_equal(f"{name} graphs x{count}", g.embeds, w.embeds,
                                    atol=_tolerance(w.embeds))  # fmt: skip
            fig = harness.compare(
                f"{name} 448x448 x{count} images/s, CUDA graphs vs eager",
                {"eager": lambda c=compact: eager(c), "mmferry": lambda c=compact: graphs(c)},
                rounds=rounds,
                sync=sync,
                per=count,
                unit="images/s",
            )
            report.add(_with_mfu(fig, flops, count, peak))
    held = graphs.graph_memory()
    print(f"{name} graphs held: " + ", ".join(f"{b}: {m / 2**20:.0f} MiB" for b, m in held.items()))


def _mean_std(model: str):
    p = spec_for(model).processor
    return (p.image_mean, p.image_std, p.video_mean, p.video_std)


def run_full(report: harness.Report, towers: Sequence[str], rounds: int, peak: float | None):
    """Every tower of `towers` at full size (CUDA only)."""
    if not torch.cuda.is_available():
        raise SystemExit("mmferry.bench.encoder --full: needs CUDA (the full-size towers)")
    name = torch.cuda.get_device_name()
    peak = peak or bf16_peak(name)
    print(f"device: {name}; bf16 peak: " + (f"{peak / 1e12:.0f} TFLOP/s" if peak else "unknown"))
    for tower in towers:
        bench_tower(report, tower, rounds, peak)
        torch.cuda.empty_cache()  # the tower's weights and graphs went with its frame


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a shorter run")
    parser.add_argument("--json", metavar="FILE", help="write every figure and round as JSON")
    parser.add_argument("--full", action="store_true", help="the full-size towers (CUDA only)")
    parser.add_argument(
        "--towers",
        default=",".join(TOWERS),
        help=f"with --full: comma-separated, of {', '.join(TOWERS)} (default: all)",
    )
    parser.add_argument("--rounds", type=int, default=10, help="with --full: rounds a figure")
    parser.add_argument(
        "--peak-tflops",
        type=float,
        help="with --full: the device's dense bf16 peak (default: from its name)",
    )
    args = parser.parse_args(argv)
    args.towers = [t.strip() for t in args.towers.split(",") if t.strip()]
    unknown = [t for t in args.towers if t not in TOWERS]
    if unknown or not args.towers:
        parser.error(f"--towers: unknown {', '.join(unknown) or '(none given)'}; "
                     f"choose from {', '.join(TOWERS)}")  # fmt: skip
    if args.rounds < harness.MIN_ROUNDS:
        parser.error(f"--rounds must be at least {harness.MIN_ROUNDS}, got {args.rounds}")
    if args.peak_tflops is not None and args.peak_tflops <= 0:
        parser.error(f"--peak-tflops must be positive, got {args.peak_tflops}")
    if not args.full and (args.peak_tflops is not None or argv and "--towers" in argv):
        parser.error("--towers and --peak-tflops go with --full")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report = harness.Report()
    print(f"machine: {harness.machine()}", flush=True)
    if args.full:
        peak = args.peak_tflops * 1e12 if args.peak_tflops else None
        run_full(report, args.towers, args.rounds, peak)
    else:
        run(report, args.quick)
    if args.json:
        report.dump_json(args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
