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


def check_spans(offsets: Sequence[Spans], prompt_len: int | None) -> None:
    """Raise unless every span is non-empty, inside `[0, prompt_len)` and apart from the others."""
    flat = []
    for i, spans in enumerate(offsets):
        for a, b in spans:
            if b <= a:
                raise ValueError(f"item {i}: span [{a}, {b}) is empty or reversed")
            if a < 0 or (prompt_len is not None and b > prompt_len):
                where = "" if prompt_len is None else f" of {prompt_len} tokens"
                raise ValueError(f"item {i}: span [{a}, {b}) lies outside the prompt{where}")
            flat.append((a, b, i))
    flat.sort()
    for (_, b0, i0), (a1, b1, i1) in zip(flat, flat[1:]):
        if a1 < b0:
            raise ValueError(f"item {i1}: span [{a1}, {b1}) overlaps a span of item {i0}")


def merge_vision_embeddings(
    inputs_embeds: torch.Tensor,
    offsets: Sequence[Spans],
    outputs: Sequence[VisionOutput],
    *,
    chunk_start: int | None = None,
    prompt_len: int | None = None,
) -> MergedEmbeddings:
    """Write each item's embeddings over its placeholder spans of this prefill chunk.

    Without `chunk_start`, `inputs_embeds` is the whole prompt. With it, it is one chunk, and
    spans are checked against `prompt_len` when given.
    """
    if inputs_embeds.dim() != 2:
        raise ValueError(
            f"inputs_embeds must be [tokens, hidden], got {tuple(inputs_embeds.shape)}"
        )
    if len(offsets) != len(outputs):
        raise ValueError(f"{len(offsets)} items in the prompt but {len(outputs)} vision outputs")
    length, hidden = inputs_embeds.shape
    if chunk_start is None:
        chunk_start, prompt_len = 0, length
    if chunk_start < 0:
        raise ValueError(f"chunk_start must be >= 0, got {chunk_start}")
    # NOTE: a span outside the prompt would vanish, a negative one write partially and
    # overlapping ones overwrite each other: all are errors, never silent.
    check_spans(offsets, prompt_len)
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
