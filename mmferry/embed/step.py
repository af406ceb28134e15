"""One prefill step for a batch of (possibly chunked) requests: what the LLM's forward needs.

An engine calls `prefill_step` once per scheduler step with each request's expanded prompt, its
items and the token range `[start, end)` it computes now. The step:
- finds the items whose vision tokens fall in the step, takes them from the cache, and encodes
  the rest in ONE encoder call (images and videos together), deduplicated by hash across the
  batch (the hash leaves out the layout, so the same image as `hf` and `compact-u8` is one item);
- slices each item's rows for this step (an item cut by a chunk boundary is encoded once and
  served from the cache for the next chunk);
- builds every index on the host from the prompts' offsets and sends it once, so the device is
  never asked a question (no `.item()`, no boolean-mask indexing, no `nonzero`, no `isin`).

Requests are packed: their tokens are concatenated in order (`cu_seqlens` says where each
starts), as varlen attention kernels take them. Deepstack rows come for the vision tokens only,
in token order, as transformers' Qwen3-VL language model adds them (`visual_pos_masks`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from mmferry.embed.cache import EncoderCache, encode_with_cache
from mmferry.embed.merge import check_spans
from mmferry.encoder.model import VisionOutput
from mmferry.items import Modality, MultimodalItem

if TYPE_CHECKING:
    from mmferry.prompt.expand import ExpandedPrompt

# Token types as transformers' processors write `mm_token_type_ids`.
TOKEN_TYPE = {"image": 1, "video": 2}

Encoder = Callable[[Sequence[MultimodalItem]], list[VisionOutput]]
# The LLM's token embedding: an `nn.Embedding`-like module, a `[vocab, hidden]` table, or any
# callable from long ids to `[n, hidden]` rows.
TextEmbedding = nn.Module | torch.Tensor | Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Precomputed:
    """An item's encoder output computed elsewhere (an encoder service), standing in for it."""

    modality: Modality
    output: VisionOutput

    def __post_init__(self) -> None:
        if self.modality not in TOKEN_TYPE:
            raise ValueError(f"modality must be 'image' or 'video', got {self.modality!r}")

    @property
    def num_tokens(self) -> int:
        return self.output.embeds.shape[0]


StepItem = MultimodalItem | Precomputed


@dataclass(frozen=True)
class StepRequest:
    """One request's share of a prefill step: tokens `[start, end)` of its expanded prompt."""

    prompt: ExpandedPrompt
    items: Sequence[StepItem]
    start: int
    end: int

    def __post_init__(self) -> None:
        n = len(self.prompt.input_ids)
        if not 0 <= self.start <= self.end <= n:
            raise ValueError(
                f"step range [{self.start}, {self.end}) is not inside the prompt's {n} tokens"
            )
        if len(self.items) != len(self.prompt.offsets):
            raise ValueError(
                f"{len(self.items)} items given but the prompt has {len(self.prompt.offsets)}"
            )


@dataclass(frozen=True)
class StepOutput:
    """The packed inputs of one prefill step (n tokens, v of them vision tokens).

    - `inputs_embeds [n, H]`: text embeddings with the vision rows written in.
    - `positions [3, n]` long: mRoPE positions (time, height, width).
    - `mm_token_type_ids [n]` int32: 0 text, 1 image, 2 video.
    - `vision_index [v]` long: rows of `inputs_embeds` that hold vision tokens, ascending.
    - `vision_mask [n]` bool: the same rows as a mask (transformers' `visual_pos_masks`).
    - `deepstack`: one `[v, H]` tensor per deepstack level, rows in `vision_index` order.
    - `cu_seqlens`: host ints; request r owns rows `[cu_seqlens[r], cu_seqlens[r + 1])`.
    - `encoded`: items encoded by this step (cache misses after deduplication).
    """

    inputs_embeds: torch.Tensor
    positions: torch.Tensor
    mm_token_type_ids: torch.Tensor
    vision_index: torch.Tensor
    vision_mask: torch.Tensor
    deepstack: tuple[torch.Tensor, ...]
    cu_seqlens: tuple[int, ...]
    encoded: int = 0


@dataclass(frozen=True)
class _Piece:
    """Rows [row0, row1) of one output land at packed step rows `dst` (host ints)."""

    key: tuple[int, int]  # (request, item)
    row0: int
    row1: int
    dst: np.ndarray
    token_type: int


def _plan(requests: Sequence[StepRequest]) -> tuple[list[_Piece], list[int]]:
    pieces: list[_Piece] = []
    cu = [0]
    for r, req in enumerate(requests):
        check_spans(req.prompt.offsets, len(req.prompt.input_ids))
        base = cu[-1] - req.start  # packed row of prompt token 0
        for i, spans in enumerate(req.prompt.offsets):
            row, first, dst = 0, None, []
            for a, b in spans:
                lo, hi = max(a, req.start), min(b, req.end)
                if lo < hi:
                    if first is None:
                        first = row + (lo - a)
                    dst.append(np.arange(lo + base, hi + base))
                row += b - a
            if first is not None:
                rows = np.concatenate(dst)
                modality = req.items[i].modality
                pieces.append(_Piece((r, i), first, first + len(rows), rows, TOKEN_TYPE[modality]))
        cu.append(cu[-1] + req.end - req.start)
    # Items of one prompt never interleave (spans are checked apart), so ordering pieces by
    # their first row puts every vision row in token order.
    pieces.sort(key=lambda p: int(p.dst[0]))
    return pieces, cu


def _vision_outputs(
    requests: Sequence[StepRequest],
    pieces: Sequence[_Piece],
    encoder: Encoder | None,
    cache: EncoderCache | None,
) -> tuple[dict[tuple[int, int], VisionOutput], int]:
    """Each needed item's output: precomputed, cached, or encoded in one deduplicated call."""
    outputs: dict[tuple[int, int], VisionOutput] = {}
    keys: list[tuple[int, int]] = []
    items: list[MultimodalItem] = []
    for p in pieces:
        item = requests[p.key[0]].items[p.key[1]]
        if isinstance(item, Precomputed):
            outputs[p.key] = item.output
        else:
            keys.append(p.key)
            items.append(item)
    encoded = 0

    def encode(misses: Sequence[MultimodalItem]) -> list[VisionOutput]:
        nonlocal encoded
        if encoder is None:
            raise ValueError(f"{len(misses)} item(s) need encoding but no encoder was given")
        encoded = len(misses)
        return encoder(misses)

    if items:
        outputs.update(zip(keys, encode_with_cache(encode, items, cache)))
    return outputs, encoded


def _embed_ids(embed: TextEmbedding, ids: torch.Tensor) -> torch.Tensor:
    if isinstance(embed, torch.Tensor):
        return embed.index_select(0, ids)
    return embed(ids)


def _device_of(embed: TextEmbedding, device: torch.device | str | None) -> torch.device:
    if device is not None:
        return torch.device(device)
    if isinstance(embed, torch.Tensor):
        return embed.device
    if isinstance(embed, nn.Module):
        for p in embed.parameters():
            return p.device
    raise ValueError("pass device= when the text embedding is a plain callable")


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    # Host-built metadata goes to the device once, from pinned memory, without waiting.
    if device.type == "cuda":
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


def prefill_step(
    requests: Sequence[StepRequest],
    *,
    embed_tokens: TextEmbedding,
    encoder: Encoder | None = None,
    cache: EncoderCache | None = None,
    device: torch.device | str | None = None,
) -> StepOutput:
    """The packed `inputs_embeds`, positions, vision index/mask, deepstack rows and token types
    of one prefill step; missing items are encoded in one call (see the module docstring)."""
    if not requests:
        raise ValueError("a prefill step needs at least one request")
    dev = _device_of(embed_tokens, device)
    pieces, cu = _plan(requests)
    outputs, num_encoded = _vision_outputs(requests, pieces, encoder, cache)
    n = cu[-1]

    ids = np.empty(n, dtype=np.int64)
    for req, c in zip(requests, cu):
        ids[c : c + req.end - req.start] = req.prompt.input_ids[req.start : req.end]
    positions = torch.cat([req.prompt.positions[:, req.start : req.end] for req in requests], 1)
    index = np.concatenate([p.dst for p in pieces]) if pieces else np.empty(0, np.int64)
    types = np.zeros(n, dtype=np.int32)
    for p in pieces:
        types[p.dst] = p.token_type

    inputs_embeds = _embed_ids(embed_tokens, _to_device(torch.from_numpy(ids), dev))
    if inputs_embeds.shape[0] != n or inputs_embeds.dim() != 2:
        raise ValueError(f"the text embedding gave {tuple(inputs_embeds.shape)} for {n} ids")
    hidden, dtype = inputs_embeds.shape[1], inputs_embeds.dtype
    token_types = torch.from_numpy(types)
    vision_index = _to_device(torch.from_numpy(index), dev)
    # A step without vision tokens still has the encoder's levels, with zero rows each.
    empty = inputs_embeds.new_empty((0, hidden))
    deepstack = (empty,) * int(getattr(encoder, "num_deepstack", 0))
    if pieces:
        used = [outputs[p.key] for p in pieces]
        levels = {len(o.deepstack) for o in used}
        if len(levels) > 1:
            raise ValueError(f"vision outputs disagree on the number of deepstack levels: {levels}")
        for p, out in zip(pieces, used):
            # NOTE: a row-count mismatch is an error, never a trim (a stale entry or a wrong
            # precomputed output would put the wrong image into the prompt).
            want = sum(b - a for a, b in requests[p.key[0]].prompt.offsets[p.key[1]])
            for t in (out.embeds, *out.deepstack):
                if t.shape != (want, hidden):
                    raise ValueError(
                        f"request {p.key[0]} item {p.key[1]}: vision rows of shape "
                        f"{tuple(t.shape)}, but its spans hold {want} tokens of width {hidden}"
                    )
        rows = torch.cat([out.embeds[p.row0 : p.row1] for p, out in zip(pieces, used)])
        # NOTE: written in place: the embedding's output was made by this call for this step.
        inputs_embeds.index_copy_(0, vision_index, rows.to(dev, dtype, non_blocking=True))
        deepstack = tuple(
            torch.cat([out.deepstack[lvl][p.row0 : p.row1] for p, out in zip(pieces, used)]).to(
                dev, dtype, non_blocking=True
            )
            for lvl in range(levels.pop())
        )
    mask = torch.zeros(n, dtype=torch.bool)
    mask[torch.from_numpy(index)] = True  # host tensor: no device question asked
    return StepOutput(
        inputs_embeds=inputs_embeds,
        positions=_to_device(positions, dev),
        mm_token_type_ids=_to_device(token_types, dev),
        vision_index=vision_index,
        vision_mask=_to_device(mask, dev),
        deepstack=deepstack,
        cu_seqlens=tuple(cu),
        encoded=num_encoded,
    )
