"""Data-parallel vision encoding with torchrun: every rank encodes a share, all get every output.

    torchrun --nproc-per-node 2 examples/sharded_encode.py
    torchrun --nproc-per-node 8 examples/sharded_encode.py --model /path/to/Qwen3-VL

NCCL with one GPU per rank when CUDA is available, gloo on CPUs otherwise. The features stay on
the CPU (as when a device feature pool has fallen back to host memory); the sharded path
allocates every buffer on the encoder's device in its dtype regardless.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

from mmferry.config import VisionConfig
from mmferry.encoder.model import VisionEncoder
from mmferry.encoder.sharded import encode_sharded, plan_for
from mmferry.items import MultimodalItem
from mmferry.models import spec_for

# The tiny Qwen3-VL tower; `--model` loads a real checkpoint instead.
TINY = spec_for("qwen3_vl").tiny_config


def demo_items(cfg: VisionConfig) -> list[MultimodalItem]:
    """Two images and a 12-frame video of random (already normalised) patches, on the CPU."""
    g = torch.Generator().manual_seed(0)
    width = cfg.in_channels * cfg.temporal_patch_size * cfg.patch_size**2
    grids = [(1, 32, 48), (1, 16, 16), (12, 16, 24)]
    return [
        MultimodalItem(
            "image" if t == 1 else "video",
            torch.randn(t * h * w, width, generator=g),
            (t, h, w),
            "hf",
            f"demo-{i}",
            merge_size=cfg.spatial_merge_size,
        )
        for i, (t, h, w) in enumerate(grids)
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--model",
        "--model-dir",
        dest="model_dir",
        help="a Qwen-VL checkpoint folder (default: a tiny random tower)",
    )
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    if cuda:
        # NOTE: before the process group: NCCL binds each rank's communicator to the current
        # device, so setting it afterwards would put every rank's NCCL context on GPU 0.
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    try:
        if args.model_dir:
            enc = VisionEncoder.from_pretrained(args.model_dir, device=device, dtype=dtype)
        else:
            enc = VisionEncoder.random(config=TINY, seed=0, device=device, dtype=dtype)
        items = demo_items(enc.config)
        plan = plan_for(enc, [it.grid_thw for it in items], world)
        with torch.inference_mode():
            outs = encode_sharded(enc, items)
            ref = enc(items) if rank == 0 else None
        mine = [(s.item, s.frame_start, s.frame_stop) for s in plan.shards[rank]]
        print(f"rank {rank}/{world}: encoded (item, first frame, end frame) {mine}", flush=True)
        if ref is not None:
            err = max(
                (o.embeds.float() - r.embeds.float()).abs().max().item() for o, r in zip(outs, ref)
            )
            rows = [tuple(o.embeds.shape) for o in outs]
            print(
                f"rank 0: outputs {rows}, imbalance {plan.imbalance:.3f}, "
                f"max |sharded - single| {err:.2e}"
            )
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
