"""The model options `serve` and `encode` share, and building the processor and tower from them."""

from __future__ import annotations

import argparse
from typing import Any

from mmferry.commands import UsageError, quoted

DTYPES = ("float32", "bfloat16", "float16")


def add_model_args(p: argparse.ArgumentParser) -> None:
    """--model / --random / --depth / --device / --dtype, and the resize options."""
    from mmferry.models import PRESETS

    p.add_argument(
        "--model",
        metavar="DIR",
        help="a local checkpoint folder (default: the built-in tower, see --random)",
    )
    add_family_arg(p)
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
        "tower for trying the command out; its deepstack taps move into range; default: all)",
    )
    p.add_argument("--device", default="cpu", help="where the tower runs (cpu, cuda, cuda:1)")
    p.add_argument("--dtype", default="float32", choices=DTYPES, help="the tower's parameter dtype")
    add_resize_args(p)


def add_family_arg(p: argparse.ArgumentParser) -> None:
    """--family: the checkpoint's native spec, or transformers' own code (the generic family)."""
    from mmferry.models.generic import FAMILY_CHOICES

    p.add_argument(
        "--family",
        default="auto",
        choices=FAMILY_CHOICES,
        help="with --model: auto reads a Qwen-VL checkpoint through mmferry's native spec (the "
        "fast path) and any other image-text checkpoint through transformers' own processor "
        "and vision code; generic forces the latter",
    )


def family_of(args: argparse.Namespace) -> str | None:
    """The `family=` the library loaders take for --family; UsageError without --model."""
    from mmferry.models.generic import family_choice

    family = family_choice(getattr(args, "family", "auto"))
    if family is not None and not args.model:
        raise UsageError(f"--family {family} needs --model (the built-in towers are native)")
    return family


def add_resize_args(
    p: argparse.ArgumentParser, max_pixels: int | None = None, why: str = ""
) -> None:
    """The processor's resize and sampling options, as transformers spells them (`max_pixels`,
    `why`: a default of the command's own, and why)."""
    model = "default: the model's own"
    p.add_argument(
        "--min-pixels",
        type=int,
        metavar="N",
        help=f"image pixel budget, lower bound (transformers' min_pixels: also videos' for "
        f"Qwen2-VL and Qwen2.5-VL, as their video processor reads it; {model})",
    )
    p.add_argument(
        "--max-pixels",
        type=int,
        metavar="N",
        default=max_pixels,
        help="image pixel budget, upper bound (transformers' max_pixels, as --min-pixels; "
        + (why or model)
        + ")",
    )
    # The old name: the image budget alone, whatever the family.
    p.add_argument("--image-max-pixels", type=int, help=argparse.SUPPRESS)
    p.add_argument(
        "--video-min-pixels",
        type=int,
        metavar="N",
        help=f"video pixel budget, lower bound (transformers' videos_kwargs min_pixels; {model})",
    )
    p.add_argument(
        "--video-max-pixels",
        type=int,
        metavar="N",
        help=f"video pixel budget, upper bound (transformers' videos_kwargs max_pixels; {model})",
    )
    p.add_argument(
        "--fps", type=float, help=f"frames sampled per second of video (transformers' fps; {model})"
    )
    p.add_argument(
        "--num-frames",
        type=int,
        metavar="N",
        help=f"frames sampled per video, instead of --fps (transformers' num_frames; {model})",
    )


def resize_options(args: argparse.Namespace) -> dict[str, Any]:
    """The resize and sampling options given, spelled as transformers spells them (read by
    `mmferry.chat.options`, so they mean what transformers means)."""
    out: dict[str, Any] = {
        k: getattr(args, k)
        for k in ("min_pixels", "max_pixels", "fps", "num_frames")
        if getattr(args, k, None) is not None
    }
    video = {
        k: getattr(args, f"video_{k}")
        for k in ("min_pixels", "max_pixels")
        if getattr(args, f"video_{k}", None) is not None
    }
    if video:
        out["videos_kwargs"] = video
    if getattr(args, "image_max_pixels", None) is not None:
        out["images_kwargs"] = {"max_pixels": args.image_max_pixels}
    return out


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
    """The processor and vision tower the arguments name (the generic family's for a
    checkpoint without a native spec, or with --family generic)."""
    import torch

    import mmferry as mf
    from mmferry.models import spec_for

    check_device(args.device)
    dtype = getattr(torch, args.dtype)
    family = family_of(args)
    if args.model:
        try:
            proc = mf.Processor.from_pretrained(args.model, family=family)
        except (OSError, ValueError) as e:
            raise load_error(args.model, e) from None
    else:
        proc = mf.Processor.for_model(args.random)
    proc = with_options(proc, resize_options(args))  # checked before the tower is built
    options = graph_options(args)
    if args.model:
        try:
            enc = mf.VisionEncoder.from_pretrained(
                args.model, device=args.device, dtype=dtype, family=family, **options
            )
        except (OSError, ValueError) as e:
            raise load_error(args.model, e) from None
        return proc, enc
    cfg = spec_for(args.random).random_config
    if args.depth is not None:
        if args.depth < 1:  # --depth 0 is a mistake, not "all layers"
            raise UsageError(f"--depth must be at least 1, got {args.depth}")
        cfg = cfg.with_depth(args.depth)
    enc = mf.VisionEncoder.random(config=cfg, device=args.device, dtype=dtype, **options)
    return proc, enc


def graph_options(args: argparse.Namespace) -> dict[str, Any]:
    """The encoder's CUDA-graph options from `serve --cuda-graphs` (none for other commands)."""
    import torch

    from mmferry.encoder.budgets import LARGEST_BUDGET, SMALLEST_BUDGET, token_budgets

    if not getattr(args, "cuda_graphs", False):
        return {}
    if torch.device(args.device).type != "cuda":
        raise UsageError(f"--cuda-graphs needs a CUDA --device, not {quoted(args.device)}")
    if args.cuda_graph_mib < 0:
        raise UsageError(f"--cuda-graph-mib must be at least 0, got {args.cuda_graph_mib}")
    # Budgets up to the largest call the batcher makes (a single larger item runs eagerly).
    calls = max(args.max_batch_patches, SMALLEST_BUDGET)
    largest = min(1 << (calls - 1).bit_length(), LARGEST_BUDGET)
    return dict(
        cuda_graphs=True,
        token_budgets=token_budgets(SMALLEST_BUDGET, largest),
        graph_memory_limit=args.cuda_graph_mib << 20,
    )


def native_only(model: str, family: str | None = None) -> None:
    """UsageError for a checkpoint `mmferry demo` would read through the generic family: it
    runs the native path (compact-u8 items with grids, mRoPE prompts)."""
    import json
    from pathlib import Path

    from mmferry.models import supported_model_types
    from mmferry.models.generic import uses_generic

    if not uses_generic(model, family):
        return
    if family is not None:
        raise UsageError(
            "--family generic: the demo runs native families only; mmferry serve, encode and "
            "the library read a checkpoint through the generic family"
        )
    model_type = json.loads((Path(model) / "config.json").read_text()).get("model_type")
    raise UsageError(
        f"--model {quoted(model)}: model_type {model_type!r} has no native spec, and the "
        f"demo runs native families only ({', '.join(supported_model_types())}); "
        "mmferry serve, encode and the library read it through the generic family"
    )


def with_options(proc, options: dict[str, Any]):  # -> Processor
    """`proc` with the command line's processor options; UsageError for a bad value."""
    if not options:
        return proc
    try:
        return proc.with_options(options)
    except ValueError as e:  # min above max, an fps of 0, ...
        raise UsageError(" ".join(str(e).split())) from None
