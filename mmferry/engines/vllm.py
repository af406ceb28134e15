"""vLLM from mmferry's embeddings: `LLM.generate` inputs and `vllm serve` content parts.

    inputs = to_vllm(items, outputs)          # or to_vllm(client.encode(parts))
    llm = LLM(model=DIR, enable_mm_embeds=True, limit_mm_per_prompt={"image": 4})
    llm.generate(inputs.prompt(text), params)

vLLM (0.32) takes, per modality, one `[N, D]` tensor holding every item's rows in prompt order
plus an `[n, 3]` int64 grid (t, h, w in patches before the merge); Qwen3-VL's D is
`out_hidden * (1 + deepstack levels)`, laid out `[main | ds0 | ds1 ...]`, and its videos
also need their per-temporal-patch timestamps. Each item's uuid (mmferry's item hash) becomes
vLLM's cache key verbatim when no processor kwargs are passed, which is what the encoder-cache
connector (`mmferry.engines.vllm_connector`) looks the rows up by.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from mmferry.engines.rows import EngineItem, engine_items

MODALITIES = ("image", "video")


@dataclass(frozen=True)
class VllmInputs:
    """`multi_modal_data` and `multi_modal_uuids` of one vLLM prompt."""

    multi_modal_data: dict[str, dict[str, Any]]
    multi_modal_uuids: dict[str, list[str | None]]

    def prompt(self, prompt: str | Sequence[int]) -> dict[str, Any]:
        """A prompt dict for `LLM.generate`: text, or token ids with the vision pads unexpanded."""
        key = "prompt" if isinstance(prompt, str) else "prompt_token_ids"
        value = prompt if isinstance(prompt, str) else list(prompt)
        out: dict[str, Any] = {key: value, "multi_modal_data": self.multi_modal_data}
        if any(u is not None for us in self.multi_modal_uuids.values() for u in us):
            out["multi_modal_uuids"] = self.multi_modal_uuids
        return out


def _grids(items: Sequence[EngineItem]) -> torch.Tensor:
    return torch.tensor([list(it.grid_thw) for it in items], dtype=torch.int64)


def _cat(items: Sequence[EngineItem]) -> torch.Tensor:
    widths = {it.rows.shape[1] for it in items}
    if len(widths) != 1:
        raise ValueError(f"items of one modality must share one width, got {sorted(widths)}")
    return items[0].rows if len(items) == 1 else torch.cat([it.rows for it in items])


def _timestamps(videos: Sequence[EngineItem]) -> list[list[float]] | None:
    have = [it.timestamps is not None for it in videos]
    if not any(have):
        return None
    if not all(have):
        raise ValueError("timestamps are given for some videos only")
    return [list(it.timestamps or ()) for it in videos]


def to_vllm(
    items: Sequence[Any],
    outputs: Sequence[Any] | None = None,
    *,
    grids: Sequence[Sequence[int]] | None = None,
    uuids: Sequence[str | None] | None = None,
    timestamps: Sequence[Sequence[float] | None] | None = None,
    dtype: torch.dtype | None = None,
) -> VllmInputs:
    """vLLM's precomputed-embedding inputs for items in prompt order (see `engine_items`)."""
    entries = engine_items(
        items, outputs, grids=grids, uuids=uuids, timestamps=timestamps, dtype=dtype
    )
    data: dict[str, dict[str, Any]] = {}
    ids: dict[str, list[str | None]] = {}
    for modality in MODALITIES:
        group = [e for e in entries if e.modality == modality]
        if not group:
            continue
        d = {f"{modality}_embeds": _cat(group), f"{modality}_grid_thw": _grids(group)}
        stamps = _timestamps(group) if modality == "video" else None
        if stamps is not None:
            # NOTE: one list per video (vLLM batches this field by video and checks each
            # count against that video's grid_t); lists, since videos differ in length.
            d["timestamps"] = stamps
        data[modality] = d
        ids[modality] = [e.uuid for e in group]
    return VllmInputs(data, ids)


def _b64(t: torch.Tensor) -> str:
    buf = io.BytesIO()
    # NOTE: vLLM reads these with torch.load(weights_only=True): a plain CPU tensor that owns
    # its storage, so a row view does not ship the whole batch it came from.
    torch.save(t.detach().cpu().contiguous().clone(), buf)
    return base64.b64encode(buf.getvalue()).decode()


def content_part(item: EngineItem, *, with_rows: bool = True) -> dict[str, Any]:
    """One OpenAI chat content part for `vllm serve --enable-mm-embeds`.

    `{"type": "image_embeds", "image_embeds": {"image_embeds": B64, "image_grid_thw": [t, h, w]},
    "uuid": hash}` (video likewise, with `timestamps` for Qwen3-VL); B64 is base64 of
    `torch.save(rows)`. `with_rows=False` sends the grid and uuid only, for a server that is an
    encoder-cache consumer and loads the rows itself."""
    m = item.modality
    payload: dict[str, Any] = {f"{m}_grid_thw": list(item.grid_thw)}
    if with_rows:
        payload[f"{m}_embeds"] = _b64(item.rows)
    if m == "video" and item.timestamps is not None:
        payload["timestamps"] = list(item.timestamps)
    part: dict[str, Any] = {"type": f"{m}_embeds", f"{m}_embeds": payload}
    if item.uuid is not None:
        part["uuid"] = item.uuid
    return part


def content_parts(
    items: Sequence[Any],
    outputs: Sequence[Any] | None = None,
    *,
    with_rows: bool = True,
    dtype: torch.dtype | None = None,
    **kwargs: Any,
) -> list[dict[str, Any]]:
    """`content_part` for each item (arguments as for `to_vllm`), in prompt order."""
    entries = engine_items(items, outputs, dtype=dtype, **kwargs)
    return [content_part(e, with_rows=with_rows) for e in entries]


def to_vllm_refs(facts: Sequence[dict[str, Any]]) -> VllmInputs:
    """Inputs that name items instead of carrying rows, for an engine whose encoder-cache
    connector loads them: grids, Qwen3-VL video timestamps and uuids from the facts
    `POST /v1/cache/encode` answers (`modality`, `hash`, `grid_thw`, `timestamps`)."""
    for f in facts:
        if f.get("pixels"):
            # NOTE: vLLM (0.32) takes no grid of such a model; its pixels must go with the hash
            # as uuid (`multi_modal_uuids`), and the connector loads the rows by it.
            raise ValueError(
                f"item {f['hash']}: vLLM takes this model's images as pixels only; send the "
                "image itself with the hash as its uuid, and the connector loads its rows"
            )
    data: dict[str, dict[str, Any]] = {}
    ids: dict[str, list[str | None]] = {}
    for modality in MODALITIES:
        group = [f for f in facts if f["modality"] == modality]
        if not group:
            continue
        grids = torch.tensor([list(f["grid_thw"]) for f in group], dtype=torch.int64)
        d: dict[str, Any] = {f"{modality}_grid_thw": grids}
        stamps = [f.get("timestamps") for f in group]
        if modality == "video" and any(s is not None for s in stamps):
            if not all(s is not None for s in stamps):
                raise ValueError("timestamps are given for some videos only")
            d["timestamps"] = [list(s) for s in stamps]
        data[modality] = d
        ids[modality] = [f["hash"] for f in group]
    return VllmInputs(data, ids)
