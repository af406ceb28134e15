"""Vision tower: mmferry vs transformers' Qwen3VLVisionModel, same random weights, same batch.

CPU, float32 (always): the Qwen3-VL-2B tower (24 layers x 1024) with seeded random weights,
copied into transformers' tower; a mixed batch of two 448x448 images, one 896x672 image and a
4-frame 448x448 video. The pixels are random uint8; transformers gets them normalised in HF
layout, mmferry gets the same HF rows and, on a second line, the compact-u8 rows. Reports the
forward time of each (best of the repeats, warm-up excluded) and the max abs difference.
GPU, bfloat16 (only when CUDA is available): the same batch, plus images/s for batches of
448x448 and 1344x1344 images.

Run: python -m bench.encoder [--quick]   (--quick: 4 layers and a smaller batch)
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time
from collections.abc import Callable

import torch

from mmferry.config import preset
from mmferry.encoder.model import VisionEncoder
from mmferry.items import MultimodalItem
from mmferry.models import spec_for

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


def _time(fn: Callable[[], object], sync: Callable[[], None]) -> float:
    t = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t


def compare(runs: dict[str, Callable[[], object]], repeats: int, sync) -> dict[str, float]:
    """Best-of-`repeats` seconds per run (the least disturbed by other load on the machine);
    warm-up excluded, runs interleaved so drift hits all alike."""
    for fn in runs.values():
        fn()
    sync()
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, fn in runs.items():
            times[name].append(_time(fn, sync))
    return {name: min(ts) for name, ts in times.items()}


def _line(label: str, base: float, ours: float) -> str:
    ratio = base / ours
    return (
        f"{label:<26} baseline {base * 1e3:9.1f} ms | mmferry {ours * 1e3:9.1f} ms | {ratio:.2f}x"
    )


def _max_diff(outs, ref, grids) -> float:
    sizes = [t * h * w // 4 for t, h, w in grids]
    diffs = [
        (o.embeds.float() - r.float()).abs().max().item() for o, r in zip(outs, ref.split(sizes))
    ]
    return max(diffs)


def bench_batch(enc, ref, grids, device, dtype, repeats, sync) -> list[str]:
    compact, hf = make_items(grids)
    x = torch.cat([it.feature for it in hf]).to(device=device, dtype=dtype)
    grid_thw = torch.tensor(grids, device=device)
    runs = {
        "transformers": lambda: ref(x, grid_thw=grid_thw),
        "mmferry hf": lambda: enc(hf),
        "mmferry compact-u8": lambda: enc(compact),
    }
    with torch.inference_mode():
        t = compare(runs, repeats, sync)
        want = ref(x, grid_thw=grid_thw).pooler_output
        d_hf = _max_diff(enc(hf), want, grids)
        d_u8 = _max_diff(enc(compact), want, grids)
    patches = sum(a * b * c for a, b, c in grids)
    return [
        f"batch: {len(grids)} items, grids {grids}, {patches} patches",
        _line("forward, hf layout", t["transformers"], t["mmferry hf"])
        + f" | max abs diff {d_hf:.2e}",
        _line("forward, compact-u8 input", t["transformers"], t["mmferry compact-u8"])
        + f" | max abs diff {d_u8:.2e}",
    ]


def bench_throughput(enc, ref, side: int, count: int, device, dtype, repeats, sync) -> str:
    grids = [_grid(side, side)] * count
    compact, hf = make_items(grids, seed=1)
    x = torch.cat([it.feature for it in hf]).to(device=device, dtype=dtype)
    grid_thw = torch.tensor(grids, device=device)
    runs = {"transformers": lambda: ref(x, grid_thw=grid_thw), "mmferry": lambda: enc(compact)}
    with torch.inference_mode():
        t = compare(runs, repeats, sync)
    base, ours = count / t["transformers"], count / t["mmferry"]
    return (
        f"{side}x{side} x{count} images/s (compact-u8) baseline {base:8.1f} | "
        f"mmferry {ours:8.1f} | {ours / base:.2f}x"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="4 layers and a smaller batch")
    parser.add_argument("--repeats", type=int, default=None)
    args = parser.parse_args(argv)
    cfg = spec_for("qwen3-vl").random_config
    if args.quick:
        cfg = dataclasses.replace(cfg, depth=4, deepstack_visual_indexes=(1,))
        grids = [_grid(224, 224), _grid(224, 224), _grid(448, 320), _grid(224, 224, frames=4)]
    else:
        grids = [_grid(448, 448), _grid(448, 448), _grid(896, 672), _grid(448, 448, frames=4)]
    repeats = args.repeats or (5 if args.quick else 2)
    print(
        f"machine: {os.cpu_count()} CPUs, torch {torch.__version__}, threads "
        f"{torch.get_num_threads()}; tower: Qwen3-VL-2B shape, {cfg.depth} layers, random weights"
    )
    enc = VisionEncoder.random(config=cfg, seed=0)
    ref = hf_tower(enc, "cpu", torch.float32)
    print("CPU float32 (transformers 5.24 Qwen3VLVisionModel sdpa = baseline)")
    for line in bench_batch(enc, ref, grids, "cpu", torch.float32, repeats, lambda: None):
        print("  " + line)
    del enc, ref
    if torch.cuda.is_available():
        print(f"GPU bfloat16 on {torch.cuda.get_device_name()}")
        enc = VisionEncoder.random(config=cfg, seed=0, device="cuda", dtype=torch.bfloat16)
        ref = hf_tower(enc, "cuda", torch.bfloat16)
        sync = torch.cuda.synchronize
        for line in bench_batch(enc, ref, grids, "cuda", torch.bfloat16, 10, sync):
            print("  " + line)
        print("  " + bench_throughput(enc, ref, 448, 32, "cuda", torch.bfloat16, 10, sync))
        print("  " + bench_throughput(enc, ref, 1344, 4, "cuda", torch.bfloat16, 10, sync))
    else:
        print("GPU section skipped: CUDA is not available")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
