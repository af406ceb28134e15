"""SGLang from mmferry's embeddings: `Engine.generate(input_ids=..., image_data=[...])`.

    prompt = proc.expand_prompt(text_ids, items)              # one pad id per vision token
    req = to_sglang(prompt, items, outputs)
    engine.generate(input_ids=req["input_ids"], image_data=req["image_data"], ...)

SGLang takes an item's encoder output as `{"format": "precomputed_embedding", "feature": rows,
"image_grid_thw": [[t, h, w]]}`, with `input_ids` already expanded. For Qwen3-VL its deepstack
split expects `[main | ds0 | ds1 ...]` on the last dim, the layout `packed_rows` builds. SGLang
refuses a request that mixes precomputed and raw items, and trims an embedding longer than its
placeholders with only a warning, so the row count is checked here against the prompt.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from mmferry.engines.rows import EngineItem, engine_items

FORMAT = "precomputed_embedding"


def image_data_entry(item: EngineItem) -> dict[str, Any]:
    """One `image_data` entry for SGLang's precomputed-embedding path."""
    if item.modality != "image":
        raise ValueError(
            "SGLang's precomputed-embedding input is wired for images (image_data); "
            f"got a {item.modality}"
        )
    return {
        "format": FORMAT,
        "feature": item.rows,
        "image_grid_thw": torch.tensor([list(item.grid_thw)], dtype=torch.int64),
    }


def to_sglang(
    prompt: Any,
    items: Sequence[Any],
    outputs: Sequence[Any] | None = None,
    *,
    dtype: torch.dtype | None = None,
    **kwargs: Any,
) -> dict[str, Any]:
    """`input_ids` (mmferry's expansion, `prompt` an `ExpandedPrompt`) and `image_data` for
    `Engine.generate`; items as for `mmferry.engines.vllm.to_vllm`."""
    entries = engine_items(items, outputs, dtype=dtype, **kwargs)
    offsets = getattr(prompt, "offsets", None)
    if offsets is not None:
        if len(offsets) != len(entries):
            raise ValueError(f"the prompt has {len(offsets)} items, got {len(entries)}")
        for k, (spans, e) in enumerate(zip(offsets, entries)):
            n = sum(end - start for start, end in spans)
            if n != e.rows.shape[0]:
                raise ValueError(f"item {k}: {e.rows.shape[0]} rows for {n} placeholder tokens")
    ids = list(getattr(prompt, "input_ids", prompt))
    return {"input_ids": ids, "image_data": [image_data_entry(e) for e in entries]}
