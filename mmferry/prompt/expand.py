"""Prompt expansion: each vision placeholder becomes its item's tokens; offsets and mRoPE follow.

The chat template writes one `<|image_pad|>` / `<|video_pad|>` per item, wrapped as
`<|vision_start|><|..._pad|><|vision_end|>`. Only the pad itself is replaced, exactly as
transformers 5.x's Qwen-VL processors do, so the wrapper stays:
- images and Qwen2/2.5-VL videos: the pad becomes `num_tokens` pads (one offset span);
- Qwen3-VL videos: the pad becomes, per temporal patch, `<{t:.1f} seconds>` (tokenised) +
  `<|vision_start|>` + `h*w/merge**2` pads + `<|vision_end|>` (one offset span per frame). The
  template's own pair around the pad is dropped or kept as the installed transformers does
  (`video_wrapper`, see `prompt.wrapper`): `<0.3 seconds><|vision_start|>...<|vision_end|>` or
  `<|vision_start|><0.3 seconds><|vision_start|>...<|vision_end|><|vision_end|>`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from mmferry.config import ProcessorConfig
from mmferry.items import MultimodalItem
from mmferry.models import spec_for
from mmferry.prompt.mrope import Advance, VisionSpan, mrope_positions
from mmferry.prompt.tokenizer import load_tokenizer
from mmferry.prompt.wrapper import VideoWrapper, keeps_outer_pair


@dataclass(frozen=True)
class ExpandedPrompt:
    """Expanded token ids with where each item's vision tokens sit and their mRoPE positions.

    - `input_ids`: Python ints, as inference engines take prompt ids.
    - `offsets[i]`: half-open `[start, end)` spans of `items[i]`'s vision tokens in `input_ids`,
      in the order the items were given; one span per item, or one per frame for Qwen3-VL videos.
    - `positions`: long `[3, len(input_ids)]` (time, height, width) on the CPU.
    - `mrope_delta`: `max(positions) + 1 - len(input_ids)`; decode position n is `n + delta`.
    """

    input_ids: list[int]
    offsets: list[list[tuple[int, int]]]
    positions: torch.Tensor
    mrope_delta: int


def _as_id_array(input_ids: Any) -> np.ndarray:
    if isinstance(input_ids, torch.Tensor):
        arr = input_ids.detach().cpu().numpy()
    else:
        arr = np.asarray(input_ids)
    if arr.ndim != 1:
        raise ValueError(
            f"input_ids must be one 1-D sequence of token ids, got shape {tuple(arr.shape)}; "
            "expand one prompt at a time"
        )
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"input_ids must be integers, got dtype {arr.dtype}")
    return arr.astype(np.int64, copy=False)


def _check_counts(name: str, found: int, items: list[MultimodalItem], token: str) -> None:
    if found == len(items):
        return
    hint = ""
    if found == sum(it.num_tokens for it in items) and found:
        hint = "; the prompt looks already expanded (pass the un-expanded chat-template ids)"
    raise ValueError(
        f"the prompt has {found} {token} placeholder(s) but {len(items)} {name} item(s) were "
        f"given; each {name} needs exactly one {token} in input_ids{hint}"
    )


def _stamp(seconds: float) -> str:
    return f"<{seconds:.1f} seconds>"


def _retokenised_lead(
    ids: np.ndarray, cursor: int, stop: int, encoder: Any, first: float
) -> tuple[int, list[int] | None]:
    """Where the text before a video's first timestamp begins, and that text's ids tokenised
    together with the timestamp: with no `<|vision_start|>` between them (the pair dropped, or a
    bare pad), a processor tokenises them as one piece (" <" can be one token). (stop, None)
    when no text abuts the timestamp or the tokenizer cannot re-tokenise it."""
    run = ids[cursor:stop]
    split = np.flatnonzero(np.isin(run, np.fromiter(encoder.added_ids, np.int64)))
    begin = cursor + (int(split[-1]) + 1 if split.size else 0)
    if begin == stop:
        return stop, None
    lead = encoder.joined(ids[begin:stop].tolist(), _stamp(first))
    return (stop, None) if lead is None else (begin, lead)


def expand_prompt(
    input_ids: Any,
    items: Sequence[MultimodalItem],
    cfg: ProcessorConfig,
    *,
    tokenizer: Any = None,
    mrope_advance: Advance = "extent",
    video_wrapper: VideoWrapper = "auto",
) -> ExpandedPrompt:
    """Expand each image/video placeholder to its item's tokens; offsets and mRoPE positions.

    `mrope_advance` picks where text resumes after a Qwen2/2.5-VL video (see `prompt.mrope`);
    `video_wrapper` whether a timestamped video keeps the template's outer vision pair (see
    `prompt.wrapper`; "auto" follows the installed transformers).
    """
    ids = _as_id_array(input_ids)
    tok = cfg.tokens
    images = [i for i, it in enumerate(items) if it.modality == "image"]
    videos = [i for i, it in enumerate(items) if it.modality == "video"]
    image_at = np.flatnonzero(ids == tok.image).tolist()
    video_at = np.flatnonzero(ids == tok.video).tolist()
    _check_counts("image", len(image_at), [items[i] for i in images], "<|image_pad|>")
    _check_counts("video", len(video_at), [items[i] for i in videos], "<|video_pad|>")

    spec = spec_for(cfg.family)
    timestamps_in_text = spec.timestamps_in_prompt
    encoder = None
    drop_pair = False
    if timestamps_in_text and videos:
        encoder = load_tokenizer(tokenizer)
        drop_pair = not keeps_outer_pair(video_wrapper)

    # (placeholder index, item index) in prompt order.
    order = sorted(zip(image_at + video_at, images + videos))
    pieces: list[np.ndarray] = []
    offsets: list[list[tuple[int, int]]] = [[] for _ in items]
    spans: list[VisionSpan] = []
    cursor = 0  # next unread index in `ids`
    out_len = 0  # tokens written so far
    for at, k in order:
        item = items[k]
        timestamped = item.modality == "video" and timestamps_in_text
        if timestamped and item.timestamps is None:
            raise ValueError(
                "this model's video items need one timestamp per temporal patch "
                "(item.timestamps); build it with Processor.video"
            )
        # NOTE: only a pad wrapped exactly as `<|vision_start|><pad><|vision_end|>` loses the
        # pair (transformers matches that triplet); a bare pad expands in place either way.
        wrapped = bool(
            drop_pair
            and timestamped
            and at > cursor
            and ids[at - 1] == tok.vision_start
            and at + 1 < len(ids)
            and ids[at + 1] == tok.vision_end
        )
        stop, lead = at - int(wrapped), None
        if timestamped and item.timestamps:
            stop, lead = _retokenised_lead(ids, cursor, stop, encoder, item.timestamps[0])
        pieces.append(ids[cursor:stop])
        out_len += stop - cursor
        cursor = at + 1 + int(wrapped)
        t, h, w = item.grid_thw
        m = item.merge_size
        gh, gw = h // m, w // m
        if timestamped:
            per_frame = gh * gw
            # [vision_start, pad * per_frame, vision_end], shared by every frame of this video.
            body = np.full(per_frame + 2, tok.video, dtype=np.int64)
            body[0], body[-1] = tok.vision_start, tok.vision_end
            for f, ts in enumerate(item.timestamps):
                text = lead if f == 0 and lead is not None else encoder.encode_cached(_stamp(ts))
                pieces += [np.asarray(text, dtype=np.int64), body]
                start = out_len + len(text) + 1
                offsets[k].append((start, start + per_frame))
                spans.append(VisionSpan(start, 1, gh, gw))
                out_len += len(text) + per_frame + 2
            continue
        n = item.num_tokens
        pad = tok.image if item.modality == "image" else tok.video
        pieces.append(np.full(n, pad, dtype=np.int64))
        offsets[k].append((out_len, out_len + n))
        interval = 1.0
        if item.modality == "video" and spec.video_time_in_mrope:
            # transformers' default when no second_per_grid_ts is given is 1 second per patch.
            spgt = 1.0 if item.second_per_grid_t is None else item.second_per_grid_t
            interval = float(np.float32(spgt) * np.float32(cfg.tokens_per_second))
        spans.append(VisionSpan(out_len, t, gh, gw, interval))
        out_len += n
    pieces.append(ids[cursor:])
    out_len += len(ids) - cursor

    expanded = np.concatenate(pieces)
    positions, delta = mrope_positions(out_len, spans, advance=mrope_advance)
    return ExpandedPrompt(
        input_ids=expanded.tolist(), offsets=offsets, positions=positions, mrope_delta=delta
    )
