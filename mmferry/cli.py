"""Command line: `mmferry demo | encode | serve | proxy | bench`."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from mmferry.commands import CommandParser, HelpFormatter, UsageError
from mmferry.commands.model_args import (
    DTYPES,
    add_family_arg,
    add_resize_args,
    check_device,
    family_of,
    load_error,
    native_only,
    resize_options,
    with_options,
)

# The demo's default image budget (--max-pixels): the 24-layer default tower stays quick on a
# laptop CPU; with --model, the checkpoint's own unless given.
DEMO_MAX_PIXELS = 160 * 32 * 32
_DEMO_DESCRIPTION = (
    "Run the whole path once: preprocess three photographs and a short video, expand a prompt, "
    "hand the features over through shared memory, encode them and merge the embeddings into a "
    "prompt's rows. Without --model the tower is built in with seeded RANDOM weights (no "
    "download)."
)


def _demo(args: argparse.Namespace) -> int:
    import torch

    import mmferry as mf
    from mmferry.embed.merge import merge_vision_embeddings
    from mmferry.models import spec_for

    check_device(args.device)
    options = resize_options(args)
    family = family_of(args)
    if args.model:
        native_only(args.model, family)
        if args.max_pixels == DEMO_MAX_PIXELS:
            options.pop("max_pixels")  # a checkpoint keeps its own unless told
        try:
            proc = mf.Processor.from_pretrained(args.model)
        except (OSError, ValueError) as e:
            raise load_error(args.model, e) from None
    else:
        proc = mf.Processor.for_model("qwen3-vl")
    proc = with_options(proc, options)
    sources = [str(p) for p in args.images] or [str(p) for p in mf.sample_images()]
    t0 = time.perf_counter()
    items = [proc.image(s, layout="compact-u8") for s in sources]
    video_path = str(args.video or mf.sample_video())
    video = None if args.no_video else proc.video(video_path, "compact-u8")
    t_pre = time.perf_counter() - t0
    print(
        f"preprocess  {len(items)} images{' + 1 video' if video else ''} "
        f"in {t_pre * 1e3:.1f} ms (layout compact-u8)"
    )
    for src, it in zip(sources, items):
        print(
            f"  image {Path(src).name:<18} grid {it.grid_thw}  {it.num_tokens:>5} tokens  "
            f"{it.feature.numel():>9,} bytes  hash {it.hash[:12]}"
        )
    if video is not None:
        stamps = ", ".join(f"{t:.1f}" for t in (video.timestamps or ())[:6])
        print(
            f"  video {'':<18} grid {video.grid_thw}  {video.num_tokens:>5} tokens  "
            f"{video.feature.numel():>9,} bytes  timestamps [{stamps}]"
        )

    # A chat-template-like prompt: one placeholder per item, wrapped in vision start/end.
    # Qwen3-VL video prompts carry timestamp text, which needs the checkpoint's tokenizer.
    tok = proc.config.tokens
    in_prompt = list(items)
    needs_tokenizer = spec_for(proc.config.family).timestamps_in_prompt
    if video is not None and (not needs_tokenizer or proc.has_tokenizer):
        in_prompt.append(video)
    ids = [1, 2, 3]
    for it in in_prompt:
        pad = tok.image if it.modality == "image" else tok.video
        ids += [tok.vision_start, pad, tok.vision_end, 4]
    prompt = proc.expand_prompt(ids, in_prompt)
    print(
        f"prompt      {len(ids)} ids -> {len(prompt.input_ids)} ids, "
        f"mRoPE positions {tuple(prompt.positions.shape)}, delta {prompt.mrope_delta}"
        + ("" if video is None or video in in_prompt else " (video left out: no tokenizer)")
    )

    dtype = getattr(torch, args.dtype)
    if args.model:
        enc = mf.VisionEncoder.from_pretrained(args.model, device=args.device, dtype=dtype)
    else:
        enc = mf.VisionEncoder.random("qwen3-vl", device=args.device, dtype=dtype)
    batch = _through_shared_memory(items + ([video] if video is not None else []))
    with torch.inference_mode():
        t0 = time.perf_counter()
        outs = enc(batch)
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        t_enc = time.perf_counter() - t0
    rows = sum(o.embeds.shape[0] for o in outs)
    print(
        f"encode      {len(batch)} items -> {rows} embeddings x {enc.out_hidden_size} "
        f"(+{enc.num_deepstack} deepstack) on {args.device}/{args.dtype} "
        f"in {t_enc * 1e3:.0f} ms"
    )
    # No LLM is loaded: text rows stay zero; the vision rows land on their placeholder spans.
    text = torch.zeros(len(prompt.input_ids), enc.out_hidden_size, dtype=dtype, device=args.device)
    merged = merge_vision_embeddings(text, prompt.offsets, outs[: len(in_prompt)])
    filled = int(merged.inputs_embeds.abs().sum(-1).gt(0).sum())
    print(
        f"merge       {filled} of {len(prompt.input_ids)} prompt rows filled with vision "
        f"embeddings, {len(merged.deepstack)} deepstack buffers"
    )
    if getattr(enc, "random_weights", False):
        print(
            "NOTE: the vision tower has seeded RANDOM weights (built-in default, no download);"
            " pass --model for a real checkpoint."
        )
    return 0


def _through_shared_memory(items: list) -> list:
    """Hand the features over as a consumer process would get them: small handles, views."""
    import dataclasses
    import pickle

    from mmferry.transport.shm import ShmArena, open_shared

    nbytes = sum(it.feature.numel() for it in items)
    with ShmArena(max(nbytes, 1 << 20) + (1 << 20)) as arena:
        wire = [pickle.dumps(arena.put(it.feature)) for it in items]
        # NOTE: the views stay valid after the arena closes; their lease ends with them.
        views = [open_shared(pickle.loads(w)) for w in wire]
    print(
        f"transport   {len(items)} features, {nbytes:,} bytes in shared memory, "
        f"sent as {sum(len(w) for w in wire):,} bytes of handles; zero-copy views on the other side"
    )
    return [dataclasses.replace(it, feature=v) for it, v in zip(items, views)]


def _add_demo_args(demo: argparse.ArgumentParser) -> None:
    demo.add_argument("images", nargs="*", type=Path, help="images (default: bundled samples)")
    demo.add_argument("--video", type=Path, help="a video file (default: the bundled sample)")
    demo.add_argument("--no-video", action="store_true", help="leave the video out")
    demo.add_argument(
        "--model",
        "--model-dir",
        dest="model",
        metavar="DIR",
        help="a local Qwen-VL checkpoint folder (default: the built-in Qwen3-VL-2B-sized tower "
        "with seeded RANDOM weights)",
    )
    add_family_arg(demo)
    add_resize_args(
        demo,
        max_pixels=DEMO_MAX_PIXELS,
        why="the default keeps the built-in tower quick on a laptop CPU; with --model, the "
        "checkpoint's own unless given",
    )
    demo.add_argument("--device", default="cpu", help="where the tower runs (cpu, cuda, cuda:1)")
    demo.add_argument(
        "--dtype", default="float32", choices=DTYPES, help="the tower's parameter dtype"
    )


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser], dict]:
    """The top-level parser, each command's parser, and each command's function."""
    parser = argparse.ArgumentParser(prog="mmferry", description=__doc__)
    sub = parser.add_subparsers(
        dest="cmd", required=True, metavar="COMMAND", parser_class=CommandParser
    )
    from mmferry.commands import bench, encode, proxy, serve

    parsers: dict[str, argparse.ArgumentParser] = {}
    commands = {"demo": _demo}
    for name, module, text in (
        ("demo", None, "run the whole pipeline on the bundled samples"),
        ("encode", encode, "encode images and videos into one safetensors file"),
        ("serve", serve, "run the HTTP encoder service"),
        ("proxy", proxy, "run the encode/prefill/decode front in front of vLLM"),
        ("bench", bench, "run the benchmarks (figures beside their baselines)"),
    ):
        description = _DEMO_DESCRIPTION if module is None else module.__doc__
        p = sub.add_parser(name, help=text, description=description, formatter_class=HelpFormatter)
        parsers[name] = p
        if module is None:
            _add_demo_args(p)
        else:
            module.add_args(p)
            commands[name] = module.run
    return parser, parsers, commands


def main(argv: list[str] | None = None) -> int:
    """`mmferry`: parse, run the command; a user mistake is one line on stderr and exit 2."""
    parser, parsers, commands = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        # NOTE: argparse reports these with the top-level usage; the command's is the one to show.
        parsers[args.cmd].error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        return commands[args.cmd](args)
    except UsageError as e:
        print(f"mmferry {args.cmd}: error: {e}", file=sys.stderr)
        return 2
