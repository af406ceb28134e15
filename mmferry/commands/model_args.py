"""The model options `serve` and `encode` share, and building the processor and tower from them."""

from __future__ import annotations

import argparse
import dataclasses

from mmferry.commands import UsageError, quoted
from mmferry.config import VisionConfig

DTYPES = ("float32", "bfloat16", "float16")


def add_model_args(p: argparse.ArgumentParser) -> None:
    """--model / --random / --depth / --device / --dtype / --image-max-pixels."""
    from mmferry.models import PRESETS

    p.add_argument("--model", metavar="DIR", help="a local Qwen-VL checkpoint folder")
    p.add_argument(
        "--random",
        default="qwen3-vl",
        choices=list(PRESETS),
        help="without --model: the built-in tower with seeded RANDOM weights",
    )
    p.add_argument(
        "--depth",
        type=int,
        help="without --model: keep only the first DEPTH layers of the random tower (a quicker "
        "tower for trying the command out; its deepstack taps move into range)",
    )
    p.add_argument("--device", default="cpu", help="where the tower runs (cpu, cuda, cuda:1)")
    p.add_argument("--dtype", default="float32", choices=DTYPES, help="the tower's parameter dtype")
    p.add_argument(
        "--image-max-pixels", type=int, help="image pixel budget (default: the model's own)"
    )


def shallow(cfg: VisionConfig, depth: int) -> VisionConfig:
    """`cfg` cut to `depth` layers, its deepstack taps and full-attention blocks kept in range."""
    if depth < 1:
        raise ValueError(f"--depth must be at least 1, got {depth}")
    if depth >= cfg.depth:
        return cfg
    clamp = lambda idx: tuple(sorted({min(i, depth - 1) for i in idx}))  # noqa: E731
    return dataclasses.replace(
        cfg,
        depth=depth,
        deepstack_visual_indexes=clamp(cfg.deepstack_visual_indexes),
        fullatt_block_indexes=clamp(cfg.fullatt_block_indexes),
    )


def check_device(device: str) -> None:
    """UsageError for a device this torch build cannot reach (before any model is built)."""
    import torch

    try:
        dev = torch.device(device)
    except RuntimeError:
        raise UsageError(f"--device {quoted(device)} is not a device (cpu, cuda, cuda:1)") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            build = "a CPU-only build" if torch.version.cuda is None else "no usable GPU"
            raise UsageError(f"--device {device}: torch {torch.__version__} has {build}")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise UsageError(
                f"--device {device}: this machine has {torch.cuda.device_count()} GPU(s)"
            )


def load_error(model: str, e: Exception) -> UsageError:
    """A checkpoint folder that cannot be read, as one line naming it (once)."""
    text = " ".join(str(e).split())
    return UsageError(text if str(model) in text else f"--model {quoted(model)}: {text}")


def build(args: argparse.Namespace):  # -> tuple[Processor, VisionEncoder]
    """The processor and vision tower the arguments name."""
    import torch

    import mmferry as mf
    from mmferry.models import spec_for

    overrides = {}
    if args.image_max_pixels:
        overrides["image_max_pixels"] = args.image_max_pixels
    check_device(args.device)
    dtype = getattr(torch, args.dtype)
    if args.model:
        try:
            proc = mf.Processor.from_pretrained(args.model, **overrides)
            enc = mf.VisionEncoder.from_pretrained(args.model, device=args.device, dtype=dtype)
        except (OSError, ValueError) as e:
            raise load_error(args.model, e) from None
        return proc, enc
    proc = mf.Processor.for_model(args.random, **overrides)
    cfg = spec_for(args.random).random_config
    if args.depth:
        cfg = shallow(cfg, args.depth)
    enc = mf.VisionEncoder.random(config=cfg, device=args.device, dtype=dtype)
    return proc, enc
