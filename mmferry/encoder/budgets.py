"""Token budgets: a batch's patches padded up to one of a few fixed sizes.

A CUDA graph replays fixed shapes, so every batch is padded to the smallest budget that holds
it (powers of two from 1k to 64k patches by default) and one graph per budget serves them all.
The padding never reaches a real row:
- padding rows form their own attention sequence (full and window attention alike), so no real
  query ever sees a padding key;
- their positions are zero and their learned-position weights zero (finite values, no NaN);
- Qwen2.5-VL's window permutation leaves padding merge blocks in place at the end, and the
  merged (and deepstack) rows of padding are dropped by slicing to the real count.
Every tensor here is built on the host from host ints, then sent once (see metadata.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from mmferry.encoder.attention import VarlenBatch, varlen_batch
from mmferry.encoder.metadata import TowerMetadata

SMALLEST_BUDGET = 1 << 10
LARGEST_BUDGET = 1 << 16


def token_budgets(
    smallest: int = SMALLEST_BUDGET, largest: int = LARGEST_BUDGET
) -> tuple[int, ...]:
    """Powers of two from `smallest` to `largest` patches (both powers of two)."""
    for name, v in (("smallest", smallest), ("largest", largest)):
        if v < 1 or v & (v - 1):
            raise ValueError(f"{name} token budget must be a power of two, got {v}")
    if smallest > largest:
        raise ValueError(f"smallest token budget {smallest} exceeds the largest {largest}")
    return tuple(1 << e for e in range(smallest.bit_length() - 1, largest.bit_length()))


def check_budgets(budgets: Sequence[int], unit: int) -> tuple[int, ...]:
    """Budgets sorted, each a positive multiple of the merge unit (merged rows stay whole)."""
    out = tuple(sorted({int(b) for b in budgets}))
    if not out:
        raise ValueError("token budgets must hold at least one size")
    bad = [b for b in out if b < unit or b % unit]
    if bad:
        raise ValueError(f"token budgets {bad} are not positive multiples of {unit} patches")
    return out


def budget_for(patches: int, budgets: Sequence[int]) -> int | None:
    """The smallest budget holding `patches`, or None beyond the largest (run eagerly)."""
    for b in budgets:
        if patches <= b:
            return b
    return None


def sequence_capacity(budget: int, unit: int) -> int:
    """Most sequences one budget can hold: every frame and window has at least `unit`
    patches, plus the padding sequence."""
    return budget // unit + 1


def pad_batch(batch: VarlenBatch, budget: int, unit: int) -> VarlenBatch:
    """`batch` plus one padding sequence up to `budget` rows, with cu_seqlens of a fixed
    length per budget (trailing zero-length sequences) and `max_seqlen` = budget."""
    lengths = batch.cu_seqlens.diff().tolist()  # a host tensor: no device read
    pad = budget - batch.total
    if pad < 0:
        raise ValueError(f"{batch.total} rows do not fit a budget of {budget}")
    if pad:
        lengths.append(pad)
    slots = sequence_capacity(budget, unit)
    if len(lengths) > slots:
        raise ValueError(f"{len(lengths)} sequences exceed the {slots} slots of budget {budget}")
    return varlen_batch(lengths + [0] * (slots - len(lengths)), max_seqlen=budget)


def pad_metadata(meta: TowerMetadata, budget: int, unit: int) -> TowerMetadata:
    """Host metadata of `meta` padded to `budget` patches (see the module docstring)."""
    n = meta.num_patches
    pad = budget - n
    if pad % unit:
        raise ValueError(f"padding of {pad} patches is not a multiple of {unit}")

    def extend(t: torch.Tensor | None, rows: int, fill: torch.Tensor | None = None):
        if t is None:
            return None
        tail = torch.zeros((rows, *t.shape[1:]), dtype=t.dtype) if fill is None else fill
        return torch.cat([t, tail])

    blocks, pad_blocks = n // unit, pad // unit
    tail_blocks = torch.arange(blocks, blocks + pad_blocks, dtype=torch.int64)
    return dataclasses.replace(
        meta,
        positions=extend(meta.positions, pad),
        full=pad_batch(meta.full, budget, unit),
        interp_taps=extend(meta.interp_taps, pad),
        interp_weights=extend(meta.interp_weights, pad),
        windows=None if meta.windows is None else pad_batch(meta.windows, budget, unit),
        window_index=extend(meta.window_index, pad_blocks, tail_blocks),
        window_reverse=extend(meta.window_reverse, pad_blocks, tail_blocks),
    )
