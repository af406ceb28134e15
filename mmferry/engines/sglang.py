"""SGLang from mmferry's embeddings: `Engine.generate(input_ids=..., image_data=[...])`.

    prompt = proc.expand_prompt(text_ids, items)              # one pad id per vision token
    req = to_sglang(prompt, items, outputs)
    engine.generate(input_ids=req["input_ids"], image_data=req.get("image_data"),
                    video_data=req.get("video_data"), ...)

SGLang (0.5.23) takes rows computed elsewhere in two dict forms, ONE dict per modality holding
every item's rows in prompt order, with `input_ids` already expanded:
- `{"format": "precomputed_embedding", "feature": rows, ...}` puts the rows where pixels go and
  leaves it to the model's `get_image_feature` to notice; Qwen2.5-VL's image path does (by the
  width), its video path and every Qwen3-VL path run the vision tower on the rows and the
  scheduler dies.
- `{"format": "processor_output", "precomputed_embeddings": rows, "image_grid_thw": grids}`
  (videos: `"modality": "video"`, `video_grid_thw`) sets the item's precomputed embeddings, which
  the scheduler scatters into the prompt without calling the tower. This is the form built here;
  it serves every family, images and videos. For Qwen3-VL, SGLang's `separate_deepstack_embeds`
  splits the last dim at the LM's hidden size, i.e. `[main | ds0 | ds1 ...]`, the layout
  `packed_rows` builds.
The scheduler dies on a request whose rows outnumber nothing or fall short of its pad tokens, and
silently trims extra rows, so the counts are checked here, against the prompt's offsets (an
`ExpandedPrompt`) or its pad ids, before SGLang sees them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from mmferry.engines.rows import EngineItem, engine_items

FORMAT = "processor_output"
MODALITIES = ("image", "video")


def precomputed_entry(
    group: Sequence[EngineItem], second_per_grid_ts: Sequence[float] | None = None
) -> dict[str, Any]:
    """The one `image_data` (or `video_data`) dict for a modality's items, in prompt order."""
    modality = group[0].modality
    if any(e.modality != modality for e in group):
        raise ValueError("one precomputed entry holds items of one modality")
    widths = {e.rows.shape[1] for e in group}
    if len(widths) != 1:
        raise ValueError(f"{modality} rows of one request need one width, got {sorted(widths)}")
    rows = [e.rows for e in group]
    entry: dict[str, Any] = {
        "format": FORMAT,
        "modality": modality,
        "precomputed_embeddings": rows[0] if len(rows) == 1 else torch.cat(rows),
        f"{modality}_grid_thw": torch.tensor([list(e.grid_thw) for e in group]),
    }
    if second_per_grid_ts is not None:
        entry["second_per_grid_ts"] = torch.tensor(list(second_per_grid_ts), dtype=torch.float32)
    return entry


def _runs(ids: Sequence[int], pad: int) -> list[int]:
    """Lengths of the runs of `pad` in `ids`."""
    out, n = [], 0
    for t in ids:
        if t == pad:
            n += 1
        elif n:
            out.append(n)
            n = 0
    if n:
        out.append(n)
    return out


def _check_offsets(offsets: Sequence[Any], entries: Sequence[EngineItem]) -> None:
    if len(offsets) != len(entries):
        raise ValueError(f"the prompt has {len(offsets)} items, got {len(entries)}")
    for k, (spans, e) in enumerate(zip(offsets, entries)):
        n = sum(end - start for start, end in spans)
        if n != e.rows.shape[0]:
            raise ValueError(f"item {k}: {e.rows.shape[0]} rows for {n} placeholder tokens")


def _check_pad_ids(
    ids: Sequence[int], pad_ids: Mapping[str, int], entries: Sequence[EngineItem]
) -> None:
    """Images: one run of pad ids per image, as long as its rows; videos (Qwen3-VL splits them
    per frame with timestamp text between): as many pad ids as rows in all."""
    for modality in MODALITIES:
        group = [e for e in entries if e.modality == modality]
        pad = pad_ids.get(modality)
        if pad is None:
            if group:
                raise ValueError(f"pad_ids has no {modality} id")
            continue
        runs = _runs(ids, pad)
        rows = [e.rows.shape[0] for e in group]
        if modality == "image" and runs != rows:
            raise ValueError(
                f"the prompt's image pad runs are {runs} tokens long, the images' rows {rows}: "
                "expand the prompt to one pad id per vision token (Processor.expand_prompt)"
            )
        if sum(runs) != sum(rows):
            raise ValueError(
                f"the prompt has {sum(runs)} {modality} pad ids for {sum(rows)} rows: expand "
                "the prompt to one pad id per vision token (Processor.expand_prompt)"
            )


def to_sglang(
    prompt: Any,
    items: Sequence[Any],
    outputs: Sequence[Any] | None = None,
    *,
    pad_ids: Mapping[str, int] | None = None,
    dtype: torch.dtype | None = None,
    **kwargs: Any,
) -> dict[str, Any]:
    """`input_ids`, and `image_data` / `video_data` (one precomputed dict each), for
    `Engine.generate` or the `/generate` route; items as for `mmferry.engines.vllm.to_vllm`.

    `prompt` is an `ExpandedPrompt` (`Processor.expand_prompt`), whose offsets size each item,
    or expanded token ids with `pad_ids={"image": id, "video": id}` to count them by."""
    entries = engine_items(items, outputs, dtype=dtype, **kwargs)
    ids = [int(t) for t in getattr(prompt, "input_ids", prompt)]
    offsets = getattr(prompt, "offsets", None)
    if offsets is not None:
        _check_offsets(offsets, entries)
    elif pad_ids is not None:
        _check_pad_ids(ids, pad_ids, entries)
    elif entries:
        raise ValueError(
            "to_sglang needs the prompt's offsets (an ExpandedPrompt) or pad_ids= to check the "
            "rows against: SGLang's scheduler dies on a mismatch"
        )
    out: dict[str, Any] = {"input_ids": ids}
    for modality in MODALITIES:
        picked = [(e, it) for e, it in zip(entries, items) if e.modality == modality]
        if not picked:
            continue
        spans = [getattr(it, "second_per_grid_t", None) for _, it in picked]
        seconds = spans if all(s is not None for s in spans) else None
        out[f"{modality}_data"] = [precomputed_entry([e for e, _ in picked], seconds)]
    return out
