"""Data-parallel vision encoding over a torch.distributed group: each rank encodes a share.

Every rank is called with the same items (grids are host metadata every rank knows; features
are only read for the rank's own share), so output sizes are known on the host everywhere and
one collective per call moves all outputs: each rank packs its rows into a padded
`[1 + num_deepstack, max_rows + 1, out_hidden]` buffer on the encoder's device in the encoder's
dtype, and one all-gather fills every rank's copy. The extra row carries a status flag, so a rank
whose encode raised still joins the collective and every rank fails instead of hanging.
Reading those flags is the call's one device-to-host read (`world` values). Outputs are row
views of the gathered buffer (a video split across ranks is concatenated once).

Precondition: every rank passes the same grids in the same order (features may differ in where
they live); the assignment is computed independently, and identically, on each rank.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from mmferry.encoder.assign import Assignment, CostModel, Shard, assign_work
from mmferry.feed.materialize import materialize_features
from mmferry.items import MultimodalItem
from mmferry.models import spec_for

if TYPE_CHECKING:
    from mmferry.encoder.model import VisionEncoder, VisionOutput

LocalEncode = Callable[[Sequence[Shard]], Sequence["VisionOutput"]]


class ShardedEncodeError(RuntimeError):
    """Raised on the ranks whose own share succeeded when another rank's share failed."""

    def __init__(self, failed_ranks: Sequence[int], rank: int) -> None:
        self.failed_ranks = tuple(failed_ranks)
        super().__init__(
            f"sharded vision encode failed on rank(s) {list(self.failed_ranks)} of the group "
            f"(this is rank {rank}); that rank raised the underlying error"
        )


def plan_for(
    encoder: VisionEncoder, grids: Sequence[tuple[int, int, int]], world_size: int
) -> Assignment:
    """The assignment `encode_sharded` uses for these grids on `world_size` ranks."""
    cfg = encoder.config
    return assign_work(
        grids,
        world_size,
        merge_size=cfg.spatial_merge_size,
        # NOTE: exact only for towers that never attend across a frame (the spec says).
        split_frames=spec_for(cfg.family).frame_local,
        cost_model=CostModel.for_config(cfg),
    )


def _sub_item(item: MultimodalItem, s: Shard) -> MultimodalItem:
    t, h, w = item.grid_thw
    if (s.frame_start, s.frame_stop) == (0, t):
        return item
    # Frames [a, b) of a video are rows [a*h*w, b*h*w) of its feature: a view, no copy.
    ts = item.timestamps
    return replace(
        item,
        feature=item.feature[s.frame_start * h * w : s.frame_stop * h * w],
        grid_thw=(s.frame_stop - s.frame_start, h, w),
        hash=f"{item.hash}[{s.frame_start}:{s.frame_stop}]",
        timestamps=None if ts is None else ts[s.frame_start : s.frame_stop],
    )


def encode_sharded(
    encoder: VisionEncoder, items: Sequence[MultimodalItem], group: dist.ProcessGroup | None = None
) -> list[VisionOutput]:
    """Per-item outputs, in input order, on every rank of `group`; equal to `encoder(items)`."""
    items = list(items)

    def local(shards: Sequence[Shard]) -> Sequence[VisionOutput]:
        return encoder([_sub_item(items[s.item], s) for s in shards])

    if _world(group) == 1:
        return list(encoder(items)) if items else []
    return _run(encoder, [it.grid_thw for it in items], local, group)


def encode_sharded_packed(
    encoder: VisionEncoder,
    pixel_values: torch.Tensor,
    grid_thw: Sequence[Sequence[int]],
    *,
    layout: str = "hf",
    group: dist.ProcessGroup | None = None,
) -> list[VisionOutput]:
    """Like `encode_sharded` for packed features (rows of all items, `grid_thw` per item)."""
    grids = [(int(t), int(h), int(w)) for t, h, w in grid_thw]
    starts = [0]
    for t, h, w in grids:
        starts.append(starts[-1] + t * h * w)
    if pixel_values.dim() != 2 or pixel_values.shape[0] != starts[-1]:
        raise ValueError(
            f"pixel_values of shape {tuple(pixel_values.shape)} does not hold the "
            f"{starts[-1]} patch rows the grids describe"
        )

    def local(shards: Sequence[Shard]) -> Sequence[VisionOutput]:
        parts, sub = [], []
        for s in shards:
            _, h, w = grids[s.item]
            lo = starts[s.item] + s.frame_start * h * w
            parts.append(pixel_values[lo : lo + (s.frame_stop - s.frame_start) * h * w])
            sub.append((s.frame_stop - s.frame_start, h, w))
        # One copy of just this rank's rows, straight onto the encoder's device.
        x = materialize_features(parts, device=encoder.device, dtype=pixel_values.dtype)
        return encoder.forward_packed(x, sub, layout=layout)

    if _world(group) == 1:
        return list(encoder.forward_packed(pixel_values, grids, layout=layout)) if grids else []
    return _run(encoder, grids, local, group)


def _world(group: dist.ProcessGroup | None) -> int:
    if not (dist.is_available() and dist.is_initialized()):
        if group is not None:
            raise ValueError("a process group was given but torch.distributed is not initialised")
        return 1
    return dist.get_world_size(group)


def _all_gather(out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup | None) -> None:
    # torch >= 2.13 names it all_gather_single; older releases all_gather_into_tensor.
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, inp, group=group)


def _pack(
    send: torch.Tensor, outs: Sequence[VisionOutput], plan: Assignment, shards: Sequence[Shard]
) -> None:
    if len(outs) != len(shards):
        raise RuntimeError(f"encoder returned {len(outs)} outputs for {len(shards)} items")
    planes, _, width = send.shape
    row = 0
    for s, o in zip(shards, outs):
        n = plan.shard_rows(s)
        tensors = (o.embeds, *o.deepstack)
        if len(tensors) != planes or any(x.shape != (n, width) for x in tensors):
            raise RuntimeError(
                f"encoder output for item {s.item} frames [{s.frame_start}, {s.frame_stop}) has "
                f"shapes {[tuple(x.shape) for x in tensors]}, expected {planes} x ({n}, {width})"
            )
        for p, x in enumerate(tensors):
            send[p, row : row + n].copy_(x)
        row += n


def _run(
    encoder: VisionEncoder,
    grids: Sequence[tuple[int, int, int]],
    encode_local: LocalEncode,
    group: dist.ProcessGroup | None,
) -> list[VisionOutput]:
    from mmferry.encoder.model import VisionOutput

    world, rank = dist.get_world_size(group), dist.get_rank(group)
    plan = plan_for(encoder, grids, world)
    if not grids:
        # Every rank sees the same (empty) grids, so every rank skips the collective.
        return []
    mine = plan.shards[rank]
    max_rows = max(plan.rows)
    planes, width = 1 + encoder.num_deepstack, encoder.out_hidden_size
    # NOTE: device and dtype are the encoder's, stated explicitly, never an input's: inputs may
    # have fallen back to the CPU, and an NCCL collective refuses CPU tensors. This holds for a
    # rank with nothing to encode too; its buffer is all padding plus the status row.
    device, dtype = torch.device(encoder.device), encoder.dtype
    # [planes, max_rows + 1, width]: plane 0 embeds, plane 1+k deepstack k; last row = status.
    send = torch.empty((planes, max_rows + 1, width), device=device, dtype=dtype)
    send[:, max_rows].zero_()
    error: BaseException | None = None
    try:
        if mine:
            _pack(send, encode_local(mine), plan, mine)
    except Exception as e:  # re-raised below, after the collective
        error = e
        send[0, max_rows, 0] = 1.0
    recv = torch.empty((world * planes * (max_rows + 1), width), device=device, dtype=dtype)
    _all_gather(recv, send.view(-1, width), group)
    # [world * planes * (max_rows + 1), width] -> [world, planes, max_rows + 1, width]
    recv = recv.view(world, planes, max_rows + 1, width)
    # The one host read per call: `world` flags, so a remote failure is an error, not garbage.
    status = recv[:, 0, max_rows, 0].tolist()
    if error is not None:
        raise error
    failed = [r for r, flag in enumerate(status) if flag != 0]
    if failed:
        raise ShardedEncodeError(failed, rank)
    outputs = []
    for pieces in plan.pieces():
        planes_out = []
        for p in range(planes):
            parts = [recv[r, p, off : off + n] for r, off, n in pieces]
            planes_out.append(parts[0] if len(parts) == 1 else torch.cat(parts))
        outputs.append(VisionOutput(planes_out[0], tuple(planes_out[1:])))
    return outputs
