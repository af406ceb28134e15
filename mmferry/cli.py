"""Command line: `mmferry demo | bench`."""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from pathlib import Path

BENCHES = ("preprocess", "prompt", "materialize", "encoder", "sharded")


def _demo(args: argparse.Namespace) -> int:
    import torch

    import mmferry as mf
    from mmferry.embed.merge import merge_vision_embeddings
    from mmferry.models import spec_for

    if args.model_dir:
        proc = mf.Processor.from_pretrained(args.model_dir)
    else:
        # A modest pixel budget keeps the 24-layer default tower quick on a laptop CPU.
        proc = mf.Processor.for_model("qwen3-vl", image_max_pixels=args.max_pixels)
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
    if args.model_dir:
        enc = mf.VisionEncoder.from_pretrained(args.model_dir, device=args.device, dtype=dtype)
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
            " pass --model-dir for a real checkpoint."
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


def _bench(args: argparse.Namespace) -> int:
    # bench/ lives beside the package in a source checkout.
    root = Path(__file__).resolve().parent.parent
    if not (root / "bench").is_dir():
        print("mmferry bench needs a source checkout (the bench/ folder)", file=sys.stderr)
        return 2
    sys.path.insert(0, str(root))
    names = args.names or list(BENCHES)
    rc = 0
    for name in names:
        if name not in BENCHES:
            print(f"unknown benchmark {name!r}; choose from {', '.join(BENCHES)}", file=sys.stderr)
            return 2
        print(f"== bench/{name}.py ==", flush=True)
        mod = importlib.import_module(f"bench.{name}")
        rc |= mod.main(["--quick"] if args.quick else [])
    return rc


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mmferry", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    demo = sub.add_parser("demo", help="run the pipeline on the bundled samples")
    demo.add_argument("images", nargs="*", type=Path, help="images (default: bundled samples)")
    demo.add_argument("--video", type=Path, help="a video file (default: bundled sample)")
    demo.add_argument("--no-video", action="store_true")
    demo.add_argument("--model-dir", help="a local Qwen-VL checkpoint folder")
    demo.add_argument(
        "--max-pixels", type=int, default=160 * 32 * 32, help="image pixel budget (preset only)"
    )
    demo.add_argument("--device", default="cpu")
    demo.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    bench = sub.add_parser("bench", help="run the benchmarks (figures beside their baselines)")
    bench.add_argument("names", nargs="*", help=f"subset of {', '.join(BENCHES)}")
    bench.add_argument("--quick", action="store_true", help="short runs")
    args = parser.parse_args(argv)
    return {"demo": _demo, "bench": _bench}[args.cmd](args)
