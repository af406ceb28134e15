"""SGLang from mmferry's embeddings: `Engine.generate(input_ids=..., image_data=[...])`.

    prompt = proc.expand_prompt(text_ids, items)              # one pad id per vision token
    req = to_sglang(prompt, items, outputs)
    engine.generate(input_ids=req["input_ids"], image_data=req["image_data"], ...)

SGLang (0.5.23) takes precomputed rows as ONE dict per modality, `{"format":
"precomputed_embedding", "feature": [N, D], "image_grid_thw": [n, 3]}` (videos:
`video_data`, `video_grid_thw`), every item's rows in prompt order, with `input_ids` already
expanded; it refuses a second dict for a modality, and a request mixing precomputed and raw
items. For Qwen3-VL its `separate_deepstack_embeds` splits the last dim at the LM's hidden
size, i.e. `[main | ds0 | ds1 ...]`, the layout `packed_rows` builds. Row counts are checked
here against the prompt's placeholders before SGLang sees them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from mmferry.engines.rows import EngineItem, engine_items

FORMAT = "precomputed_embedding"


def precomputed_entry(group: Sequence[EngineItem]) -> dict[str, Any]:
    """The one `image_data` (or `video_data`) dict for a modality's items, in prompt order."""
    modality = group[0].modality
    if any(e.modality != modality for e in group):
        raise ValueError("one precomputed entry holds items of one modality")
    rows = [e.rows for e in group]
    return {
        "format": FORMAT,
        "feature": rows[0] if len(rows) == 1 else torch.cat(rows),
        f"{modality}_grid_thw": torch.tensor([list(e.grid_thw) for e in group]),
    }


def to_sglang(
    prompt: Any,
    items: Sequence[Any],
    outputs: Sequence[Any] | None = None,
    *,
    dtype: torch.dtype | None = None,
    **kwargs: Any,
) -> dict[str, Any]:
    """`input_ids` (mmferry's expansion: `prompt` is an `ExpandedPrompt`) and `image_data` /
    `video_data` for `Engine.generate`; items as for `mmferry.engines.vllm.to_vllm`."""
    entries = engine_items(items, outputs, dtype=dtype, **kwargs)
    offsets = getattr(prompt, "offsets", None)
    if offsets is not None:
        if len(offsets) != len(entries):
            raise ValueError(f"the prompt has {len(offsets)} items, got {len(entries)}")
        for k, (spans, e) in enumerate(zip(offsets, entries)):
            n = sum(end - start for start, end in spans)
            if n != e.rows.shape[0]:
                raise ValueError(f"item {k}: {e.rows.shape[0]} rows for {n} placeholder tokens")
    out: dict[str, Any] = {"input_ids": list(getattr(prompt, "input_ids", prompt))}
    for modality in ("image", "video"):
        group = [e for e in entries if e.modality == modality]
        if group:
            out[f"{modality}_data"] = [precomputed_entry(group)]
    return out
