"""`EngineItem`: one item's vision rows as both engines take them, `[main | ds0 | ds1 ...]`.

vLLM and SGLang carry Qwen3-VL's deepstack rows beside the main embeddings on the last dim
(width `out_hidden * (1 + levels)`) and split them again at the LM's hidden size. A family
without deepstack has no extra columns, so one rule serves every family: no branch on names.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from mmferry.embed.packed import packed_rows
from mmferry.embed.step import Precomputed
from mmferry.encoder.model import VisionOutput
from mmferry.items import MultimodalItem

__all__ = ["EngineItem", "engine_items", "packed_rows"]


@dataclass(frozen=True)
class EngineItem:
    """One image or video for an engine: what sizes its placeholders and the rows that fill them.

    `rows` is `[tokens, out_hidden * (1 + deepstack levels)]`; `uuid` is mmferry's item hash
    (vLLM uses it verbatim as the item's cache key); `timestamps` are Qwen3-VL's per-temporal-
    patch seconds, which vLLM writes into the prompt as `<t seconds>` text."""

    modality: str
    grid_thw: tuple[int, int, int]
    rows: torch.Tensor
    uuid: str | None = None
    timestamps: tuple[float, ...] | None = None
    merge_size: int = 2

    def __post_init__(self) -> None:
        if self.modality not in ("image", "video"):
            raise ValueError(f"modality must be 'image' or 'video', got {self.modality!r}")
        t, h, w = self.grid_thw
        want = t * h * w // self.merge_size**2
        # NOTE: a 3-D tensor kills vLLM's engine and a wrong row count is trimmed silently by
        # SGLang, so both are refused here, before either engine sees them.
        if self.rows.dim() != 2 or self.rows.shape[0] != want:
            raise ValueError(
                f"{self.modality} rows of shape {tuple(self.rows.shape)}: grid {self.grid_thw} "
                f"needs [{want}, width]"
            )
        if self.timestamps is not None and len(self.timestamps) != t:
            raise ValueError(f"{len(self.timestamps)} timestamps for {t} temporal patches")


def _one(item: Any, output: Any, grid: Any, dtype: torch.dtype | None) -> EngineItem:
    from mmferry.server.encoded import EncodedItem

    if getattr(item, "engine_needs_pixels", False) or (
        isinstance(item, EncodedItem) and item.grid_thw is None
    ):
        raise ValueError(
            "a generic-family item goes to vLLM as its pixels, with its hash as uuid, and "
            "MmferryECConnector loads its rows: vLLM (0.32) takes no precomputed rows of these "
            "models (Gemma 3 refuses image_embeds; GLM-4.1V's parser takes no grid)"
        )
    if isinstance(item, EncodedItem):
        rows = packed_rows(item.embeds, item.deepstack, dtype)
        return EngineItem(item.modality, tuple(item.grid_thw), rows, item.hash)
    if isinstance(item, MultimodalItem):
        out = output.output if isinstance(output, Precomputed) else output
        if not isinstance(out, VisionOutput):
            raise TypeError(f"a MultimodalItem needs its VisionOutput, got {type(output)}")
        return EngineItem(
            item.modality,
            item.grid_thw,
            packed_rows(out.embeds, out.deepstack, dtype),
            item.hash,
            item.timestamps,
            item.merge_size,
        )
    if isinstance(item, Precomputed):
        if grid is None:
            raise ValueError("a Precomputed item needs its grid (pass grids=)")
        rows = packed_rows(item.output.embeds, item.output.deepstack, dtype)
        return EngineItem(item.modality, tuple(int(v) for v in grid), rows)
    if isinstance(item, EngineItem):
        return item if dtype is None else replace(item, rows=item.rows.to(dtype))
    raise TypeError(f"cannot hand {type(item).__name__} to an engine")


def engine_items(
    items: Sequence[Any],
    outputs: Sequence[VisionOutput | Precomputed] | None = None,
    *,
    grids: Sequence[Sequence[int]] | None = None,
    uuids: Sequence[str | None] | None = None,
    timestamps: Sequence[Sequence[float] | None] | None = None,
    dtype: torch.dtype | None = None,
) -> list[EngineItem]:
    """Items in prompt order as `EngineItem`s.

    `items` are `EncodedItem`s (from `mmferry serve` or `mmferry encode` files), or
    `MultimodalItem`s with their `outputs`, or `Precomputed` with their `grids`. `uuids` and
    `timestamps` override or fill in per item (an `EncodedItem` does not carry timestamps)."""
    n = len(items)
    for name, seq in (("outputs", outputs), ("grids", grids), ("uuids", uuids)):
        if seq is not None and len(seq) != n:
            raise ValueError(f"{len(seq)} {name} for {n} items")
    if timestamps is not None and len(timestamps) != n:
        raise ValueError(f"{len(timestamps)} timestamps for {n} items")
    out = []
    for i, it in enumerate(items):
        e = _one(
            it, None if outputs is None else outputs[i], None if grids is None else grids[i], dtype
        )
        change: dict[str, Any] = {}
        if uuids is not None and uuids[i] is not None:
            change["uuid"] = uuids[i]
        if timestamps is not None and timestamps[i] is not None:
            change["timestamps"] = tuple(float(s) for s in timestamps[i])
        out.append(replace(e, **change) if change else e)
    return out
