"""Several devices behind one endpoint: `torchrun --nproc-per-node N -m mmferry serve ...`.

Rank 0 runs the HTTP service; each encoder call it makes becomes `encode_sharded` over the
group. The other ranks wait in `follow`. Per batch, rank 0 puts each feature into a
shared-memory arena once and broadcasts only the handles and item facts (the ranks share a
host); every rank opens zero-copy views, encodes its share, and one all-gather returns every
output to rank 0. A broadcast of None ends the followers.
"""

from __future__ import annotations

import signal
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from mmferry.encoder.model import VisionEncoder, VisionOutput
from mmferry.encoder.sharded import encode_sharded
from mmferry.items import MultimodalItem


def init_group(device: str, world_size: int, local_rank: int) -> str:
    """Join torchrun's group (NCCL on GPUs, gloo on CPUs); the device this rank encodes on."""
    if device.startswith("cuda"):
        device = f"cuda:{local_rank}"
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")
    if dist.get_world_size() != world_size:
        raise RuntimeError(f"group has {dist.get_world_size()} ranks, expected {world_size}")
    return device


def _facts(item: MultimodalItem) -> dict[str, Any]:
    return {
        "modality": item.modality,
        "grid_thw": item.grid_thw,
        "layout": item.layout,
        "hash": item.hash,
        "merge_size": item.merge_size,
        "timestamps": item.timestamps,
        "second_per_grid_t": item.second_per_grid_t,
    }


class ShardedLeader:
    """Rank 0's encode function: hand the batch over, then encode a share with everyone."""

    def __init__(self, encoder: VisionEncoder, arena_bytes: int = 256 << 20) -> None:
        from mmferry.transport.shm import ShmArena

        self.encoder = encoder
        self.world = dist.get_world_size()
        self.arena = ShmArena(arena_bytes, on_full="inline", max_readers=max(self.world - 1, 1))

    def __call__(self, items: Sequence[MultimodalItem]) -> list[VisionOutput]:
        followers = self.world - 1
        sent = [(_facts(it), self.arena.put(it.feature, readers=followers)) for it in items]
        dist.broadcast_object_list([sent], src=0)
        return encode_sharded(self.encoder, items)

    def close(self) -> None:
        """Release the followers and the arena."""
        dist.broadcast_object_list([None], src=0)
        self.arena.close()
        dist.destroy_process_group()


def follow(encoder: VisionEncoder) -> int:
    """A follower rank: encode its share of every batch rank 0 broadcasts, until None."""
    from mmferry.transport.shm import open_shared

    # NOTE: torchrun forwards SIGTERM to every rank; followers must keep serving rank 0's drain
    # and stop only when it says so.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    reader = dist.get_rank() - 1
    while True:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0)
        if box[0] is None:
            dist.destroy_process_group()
            return 0
        items = [
            MultimodalItem(feature=open_shared(h.for_reader(reader)), **facts)
            for facts, h in box[0]
        ]
        encode_sharded(encoder, items)
        del items  # the views go, and with them this rank's leases
