"""Scatter vision embeddings (and Qwen3 deepstack rows) into the LLM's input embeddings.

The positions come from the prompt's host-side offsets, so the scatter indices are built on the
host and the device never answers a question (no mask, no `.sum().item()`, no `nonzero`).
Prefill may be chunked: `chunk_start` says where `inputs_embeds` begins in the expanded prompt,
and only the rows of items that overlap the chunk are written.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from mmferry.encoder.model import VisionOutput

Spans = Sequence[tuple[int, int]]


@dataclass(frozen=True)
class MergedEmbeddings:
    inputs_embeds: torch.Tensor
    # One [L, H] tensor per deepstack level: vision rows filled, zeros elsewhere (added after
    # the matching LLM layers).
    deepstack: tuple[torch.Tensor, ...]


@dataclass(frozen=True)
class _Piece:
    """Rows [row0, row1) of one item's output land at chunk positions `dst`."""

    item: int
    row0: int
    row1: int
    dst: list[int]


def _plan(offsets: Sequence[Spans], chunk_start: int, chunk_len: int) -> list[_Piece]:
    pieces: list[_Piece] = []
    chunk_end = chunk_start + chunk_len
    for i, spans in enumerate(offsets):
        row = 0
        dst: list[int] = []
        first = None
        for a, b in spans:
            lo, hi = max(a, chunk_start), min(b, chunk_end)
            if lo < hi:
                if first is None:
                    first = row + (lo - a)
                dst.extend(range(lo - chunk_start, hi - chunk_start))
            row += b - a
        if first is not None:
            pieces.append(_Piece(i, first, first + len(dst), dst))
    return pieces


def merge_vision_embeddings(
    inputs_embeds: torch.Tensor,
    offsets: Sequence[Spans],
    outputs: Sequence[VisionOutput],
    *,
    chunk_start: int = 0,
) -> MergedEmbeddings:
    """Write each item's embeddings over its placeholder spans of this prefill chunk."""
    if inputs_embeds.dim() != 2:
        raise ValueError(
            f"inputs_embeds must be [tokens, hidden], got {tuple(inputs_embeds.shape)}"
        )
    if len(offsets) != len(outputs):
        raise ValueError(f"{len(offsets)} items in the prompt but {len(outputs)} vision outputs")
    length, hidden = inputs_embeds.shape
    levels = {len(o.deepstack) for o in outputs}
    if len(levels) > 1:
        raise ValueError(f"vision outputs disagree on the number of deepstack levels: {levels}")
    num_levels = levels.pop() if levels else 0
    for i, (spans, out) in enumerate(zip(offsets, outputs)):
        # NOTE: a length mismatch is an error, never a silent trim (a stale cache entry or a
        # hash collision would otherwise put the wrong image into the prompt).
        want = sum(b - a for a, b in spans)
        for name, t in (("embeds", out.embeds), *(("deepstack", d) for d in out.deepstack)):
            if t.shape != (want, hidden):
                raise ValueError(
                    f"item {i}: {name} has shape {tuple(t.shape)} but its placeholder spans hold "
                    f"{want} tokens of width {hidden}"
                )
    device, dtype = inputs_embeds.device, inputs_embeds.dtype
    merged = inputs_embeds.clone()
    deepstack = tuple(
        torch.zeros((length, hidden), device=device, dtype=dtype) for _ in range(num_levels)
    )
    for p in _plan(offsets, chunk_start, length):
        out = outputs[p.item]
        # Host-built indices, sent once per item; pinned so the copy can be asynchronous.
        idx = torch.tensor(p.dst, dtype=torch.long)
        if device.type == "cuda":
            idx = idx.pin_memory()
        idx = idx.to(device, non_blocking=True)
        merged.index_copy_(0, idx, out.embeds[p.row0 : p.row1].to(device, dtype, non_blocking=True))
        for buf, rows in zip(deepstack, out.deepstack):
            buf.index_copy_(0, idx, rows[p.row0 : p.row1].to(device, dtype, non_blocking=True))
    return MergedEmbeddings(merged, deepstack)
