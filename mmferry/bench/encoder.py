"""Vision tower: mmferry vs transformers' Qwen3VLVisionModel, same random weights, same batch.

CPU, float32 (always): the Qwen3-VL-2B tower (24 layers x 1024) with seeded random weights,
copied into transformers' tower; a mixed batch of two 448x448 images, one 896x672 image and a
4-frame 448x448 video. The pixels are random uint8; transformers gets them normalised in HF
layout, mmferry gets the same HF rows and, on a second line, the compact-u8 rows. Outputs
(embeddings and every deepstack level) are checked against transformers' first, within a stated
tolerance; then the forward times are interleaved over 5 rounds (median and spread, warm-up
excluded).
GPU, bfloat16 (only when CUDA is available): the same batch, plus images/s for batches of
448x448 and 1344x1344 images.

Run: python -m mmferry.bench.encoder [--quick] [--json FILE]   (--quick: 4 layers, a smaller batch)
"""

from __future__ import annotations

import dataclasses

import torch

from mmferry.bench import harness
from mmferry.encoder.model import VisionEncoder
from mmferry.items import MultimodalItem
from mmferry.models import preset, spec_for

P, T, C = 16, 2, 3


def _grid(height: int, width: int, frames: int = 1) -> tuple[int, int, int]:
    return (frames // T if frames > 1 else 1, height // P, width // P)


def make_items(grids, seed: int = 0) -> tuple[list[MultimodalItem], list[MultimodalItem]]:
    """The same random pixels as compact-u8 items and as normalised HF-layout items."""
    gen = torch.Generator().manual_seed(seed)
    p = preset("qwen3-vl")
    compact, hf = [], []
    for i, (t, h, w) in enumerate(grids):
        n = t * h * w
        video = t > 1
        shape = (n, C, T, P, P) if video else (n, C, P, P)
        u8 = torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8)
        mean, std = (p.video_mean, p.video_std) if video else (p.image_mean, p.image_std)
        view = (1, C) + (1,) * (u8.dim() - 2)
        x = (u8.float() / 255 - torch.tensor(mean).view(view)) / torch.tensor(std).view(view)
        if not video:  # HF repeats an image to T identical frames
            x = x[:, :, None].expand(n, C, T, P, P)
        modality = "video" if video else "image"
        compact.append(MultimodalItem(modality, u8.reshape(n, -1), (t, h, w), "compact-u8", f"{i}"))
        hf.append(MultimodalItem(modality, x.reshape(n, -1).contiguous(), (t, h, w), "hf", f"{i}"))
    return compact, hf


def hf_tower(enc: VisionEncoder, device: str, dtype: torch.dtype):
    """transformers' Qwen3VLVisionModel holding `enc`'s weights."""
    from transformers import Qwen3VLConfig
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

    c = enc.config
    vision = Qwen3VLConfig(
        vision_config=dict(
            depth=c.depth,
            hidden_size=c.hidden_size,
            intermediate_size=c.intermediate_size,
            num_heads=c.num_heads,
            out_hidden_size=c.out_hidden_size,
            patch_size=c.patch_size,
            num_position_embeddings=c.num_position_embeddings,
            deepstack_visual_indexes=list(c.deepstack_visual_indexes),
        )
    ).vision_config
    vision._attn_implementation = "sdpa"
    model = Qwen3VLVisionModel(vision)  # non-persistent rope buffers need a real init
    model.load_state_dict(enc.tower.state_dict(), strict=True)
    return model.eval().to(device=device, dtype=dtype)


def _check(name: str, outs, ref_out, grids, atol: float) -> float:
    """Raise unless every item's embeddings and deepstack rows match transformers'."""
    sizes = [t * h * w // 4 for t, h, w in grids]
    worst = 0.0
    for level, want in enumerate([ref_out.pooler_output, *ref_out.deepstack_features]):
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


def main(argv: list[str] | None = None) -> int:
    return harness.main_for(run, argv, __doc__.splitlines()[0])


if __name__ == "__main__":
    raise SystemExit(main())
