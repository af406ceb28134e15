"""Multimodal rotary positions (mRoPE): one `[3, L]` table of (time, height, width) positions.

Text tokens count up on all three axes. A vision span of merged grid (t, h, w) that starts at
position p gets `(p + time(k), p + i, p + j)` for its tokens in (k, i, j) order, where `time(k)`
is `k` (images, Qwen2-VL, Qwen3-VL frames) or `int(k * interval)` with
`interval = second_per_grid_t * tokens_per_second` (Qwen2.5-VL videos, float32 as transformers
computes it). Qwen3-VL videos are one t=1 span per frame: their time lives in the timestamp text.

Where the text after a span resumes is the one place the references disagree:
- "extent" (default): one past the span's largest position. This is the rule of the original
  Qwen-VL code, transformers 4.x, vLLM and SGLang, and what the checkpoints were trained with.
- "spatial": `p + max(h, w)`, transformers 5.x's `get_rope_index`. It differs only for
  Qwen2/2.5-VL videos whose temporal positions outrun their spatial extent, where the text after
  the video reuses positions the video already holds.
Both agree on every image and every Qwen3-VL frame. `delta` is `max(position) + 1 - L` in both.

Spans are known from prompt expansion, so nothing here scans ids: the arithmetic is Python ints
per span and a few tensor ops per distinct grid shape, never per token.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from collections.abc import Sequence
from typing import Literal, NamedTuple

import numpy as np
import torch

Advance = Literal["extent", "spatial"]


class VisionSpan(NamedTuple):
    """A run of vision tokens in the expanded ids, in merged-grid units."""

    start: int  # index of the span's first token
    t: int
    h: int
    w: int
    time_interval: float = 1.0  # temporal position step; only Qwen2.5-VL videos differ from 1

    @property
    def length(self) -> int:
        return self.t * self.h * self.w


@functools.lru_cache(maxsize=1024)
def _time_steps(t: int, interval: float) -> tuple[int, ...]:
    # NOTE: float32 product, then truncation toward zero: transformers multiplies an int64
    # arange by a float32 scalar tensor and casts with `.long()`; float64 would differ at ties.
    if interval == 1.0:
        return tuple(range(t))
    steps = np.arange(t, dtype=np.float32) * np.float32(interval)
    return tuple(int(s) for s in steps.astype(np.int64))


@functools.lru_cache(maxsize=256)
def _grid_offsets(t: int, h: int, w: int, interval: float) -> torch.Tensor:
    """Positions of a span relative to its start, `[3, t*h*w]` (never mutated by callers)."""
    time = torch.tensor(_time_steps(t, interval), dtype=torch.long)
    tt, hh, ww = torch.meshgrid(time, torch.arange(h), torch.arange(w), indexing="ij")
    return torch.stack([tt, hh, ww]).reshape(3, -1)  # [3, t, h, w] -> [3, t*h*w]


def mrope_positions(
    length: int, spans: Sequence[VisionSpan], *, advance: Advance = "extent"
) -> tuple[torch.Tensor, int]:
    """The `[3, length]` long positions and the rope delta for a prompt with these vision spans."""
    if advance not in ("extent", "spatial"):
        raise ValueError(f"advance must be 'extent' or 'spatial', got {advance!r}")
    spans = sorted(spans, key=lambda s: s.start)
    # Host pass over spans: where each starts in position space and how far it moves the text.
    shift = 0  # position minus index for the text that follows the spans seen so far
    prev_end = 0
    max_pos = -1
    starts_pos: list[int] = []
    ends: list[int] = []
    shifts: list[int] = []
    for s in spans:
        if min(s.t, s.h, s.w) < 1:
            raise ValueError(f"vision span {s} has an empty grid")
        end = s.start + s.length
        if s.start < prev_end or end > length:
            raise ValueError(
                f"vision span [{s.start}, {end}) overlaps another span or runs past the "
                f"{length} prompt tokens"
            )
        pos = s.start + shift
        last_t = _time_steps(s.t, s.time_interval)[-1]
        span_max = pos + max(last_t, s.h - 1, s.w - 1)
        nxt = span_max + 1 if advance == "extent" else pos + max(s.h, s.w)
        shift = nxt - end
        max_pos = max(max_pos, span_max)
        starts_pos.append(pos)
        ends.append(end)
        shifts.append(shift)
        prev_end = end
    if prev_end < length:  # trailing text holds the last position
        max_pos = max(max_pos, length - 1 + shift)
    delta = max_pos + 1 - length

    # Text: index plus the shift in force at that index (a step function over span ends).
    steps = torch.zeros(length + 1, dtype=torch.long)
    if spans:
        prev_shifts = [0, *shifts[:-1]]
        steps.index_add_(
            0,
            torch.tensor(ends, dtype=torch.long),
            torch.tensor([b - a for a, b in zip(prev_shifts, shifts)], dtype=torch.long),
        )
    positions = (torch.arange(length) + steps[:length].cumsum(0)).expand(3, length).clone()

    # Vision: one gather/scatter per distinct grid shape, however many spans share it.
    groups: dict[tuple[int, int, int, float], list[int]] = defaultdict(list)
    for i, s in enumerate(spans):
        groups[(s.t, s.h, s.w, s.time_interval)].append(i)
    for (t, h, w, interval), members in groups.items():
        rel = _grid_offsets(t, h, w, interval)  # [3, n]
        n = rel.shape[1]
        first = torch.tensor([spans[i].start for i in members], dtype=torch.long)
        base = torch.tensor([starts_pos[i] for i in members], dtype=torch.long)
        index = (first[:, None] + torch.arange(n)).reshape(-1)  # [k, n] -> [k*n]
        values = (base[None, :, None] + rel[:, None, :]).reshape(3, -1)  # [3, k, n] -> [3, k*n]
        # index_copy_, not `positions[:, index] = ...`: advanced-index assignment is ~50x slower.
        positions.index_copy_(1, index, values)
    return positions, delta


def decode_positions(
    token_index: Sequence[int] | torch.Tensor,
    mrope_delta: Sequence[int] | torch.Tensor,
    *,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """`[3, B]` positions of the tokens at `token_index` (prompt length + k) past their prompts.

    Every token after the prompt is text: its position is `index + mrope_delta` on all three
    axes. Tensors stay on their device (no sync); Python ints are built on the host and sent once.
    """
    if not torch.is_tensor(token_index):
        token_index = torch.as_tensor(token_index, dtype=torch.long)
    if not torch.is_tensor(mrope_delta):
        mrope_delta = torch.as_tensor(mrope_delta, dtype=torch.long)
    if token_index.dim() != 1 or mrope_delta.shape != token_index.shape:
        raise ValueError(
            f"token_index and mrope_delta must be two 1-D sequences of the same length, got "
            f"{tuple(token_index.shape)} and {tuple(mrope_delta.shape)}"
        )
    pos = token_index.long() + mrope_delta.to(token_index.device).long()
    if device is not None:
        # Host ints -> device once; pinned so the copy can overlap.
        dev = torch.device(device)
        if dev.type == "cuda" and pos.device.type == "cpu":
            pos = pos.pin_memory()
        pos = pos.to(dev, non_blocking=True)
    return pos.expand(3, -1)  # [B] -> [3, B], a view: the three axes agree after the prompt
