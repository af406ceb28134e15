"""An encoder's answers to the proxy, checked before anything of them reaches the engine.

Nothing an encoder answers is trusted: a `/v1/cache/encode` answer must be one item's facts per
part of the call, in order, each of that part's modality (a non-empty printable hash, a grid of
three positive ints, a token count the grid gives, one timestamp per temporal patch or none,
`held` a bool; `pixels` a bool, and when true, an image whose grid may be null: the generic
family's, which the engine is sent as pixels), and a `/v1/cache/load` body safetensors holding
exactly those hashes' rows, each `[num_tokens, width]` in the dtype asked for, as the rewrite
will hand them to the engine. The proxy does not know the model's width, so any width above 0
passes. Anything else raises `BadEncoderAnswer`, which the pool counts as that encoder failing
the call's items (their next choices, then the engine's own pixels).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from mmferry.engines.cache_client import (
    BadAnswer,
    BadRows,
    check_rows,
    read_rows,
    strict_json,
)
from mmferry.server.ec import HASH_CHARS
from mmferry.server.service import DTYPES


class BadEncoderAnswer(ValueError):
    """An encoder answered 200 with something that is not the protocol's answer."""


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _merges_to(grid: list[int], tokens: int) -> bool:
    """Whether some merge size m gives `tokens` from `grid`: t*h*w == tokens*m*m, m | h, m | w."""
    t, h, w = grid
    unit, rest = divmod(t * h * w, tokens)
    m = math.isqrt(unit)
    return rest == 0 and m * m == unit and h % m == 0 and w % m == 0


def encode_facts(content: bytes, modalities: Sequence[str]) -> list[dict[str, Any]]:
    """Each item's facts of a `/v1/cache/encode` answer for parts of `modalities`, in order:
    modality, hash, grid_thw, num_tokens, timestamps, held (the fields the rewrite reads,
    checked); one item's facts per part, no more and no fewer."""
    try:
        doc = strict_json(content)
    except ValueError as e:
        raise BadEncoderAnswer(f"encode: the answer is not JSON ({e}): {content[:80]!r}") from None
    items = doc.get("items") if isinstance(doc, dict) else None
    n = len(modalities)
    if not (
        isinstance(items, list) and len(items) == n and all(isinstance(f, dict) for f in items)
    ):
        raise BadEncoderAnswer(f"encode: 'items' must hold {n} items' facts: {content[:120]!r}")
    return [_facts(f, modality) for f, modality in zip(items, modalities)]


def _facts(f: dict[str, Any], modality: str) -> dict[str, Any]:
    if f.get("modality") != modality:
        raise BadEncoderAnswer(f"encode: modality {f.get('modality')!r} for a {modality} part")
    h = f.get("hash")
    if not (isinstance(h, str) and 0 < len(h) <= HASH_CHARS and h.isascii() and h.isprintable()):
        raise BadEncoderAnswer(f"encode: hash {h!r} is not 1 to {HASH_CHARS} printable characters")
    pixels = f.get("pixels", False)  # a service before the generic family sends none
    if not isinstance(pixels, bool) or (pixels and modality != "image"):
        raise BadEncoderAnswer(f"encode: pixels {pixels!r} for a {modality} part")
    grid = f.get("grid_thw")
    gridless = pixels and grid is None  # a processor without a grid (Gemma 3's)
    if not gridless and not (
        isinstance(grid, list) and len(grid) == 3 and all(_int(v) and v > 0 for v in grid)
    ):
        raise BadEncoderAnswer(f"encode: grid_thw {grid!r} is not three positive ints")
    tokens = f.get("num_tokens")
    if not (_int(tokens) and tokens > 0 and (gridless or _merges_to(grid, tokens))):
        raise BadEncoderAnswer(f"encode: num_tokens {tokens!r} does not fit grid {grid}")
    stamps = f.get("timestamps")
    numbers = isinstance(stamps, list) and all(
        isinstance(s, (int, float)) and not isinstance(s, bool) for s in stamps
    )
    if stamps is not None and (gridless or not (numbers and len(stamps) == grid[0])):
        patches = "no grid" if gridless else f"{grid[0]} temporal patches"
        raise BadEncoderAnswer(f"encode: timestamps {stamps!r} for {patches}")
    held = f.get("held", True)  # a service without "held" pins every item it encodes
    if not isinstance(held, bool):
        raise BadEncoderAnswer(f"encode: held {held!r} is not a bool")
    return {
        "modality": modality,
        "hash": h,
        "grid_thw": None if gridless else list(grid),
        "num_tokens": tokens,
        "timestamps": stamps,
        "held": held,
        "pixels": pixels,
    }


def loaded_rows(content: bytes, facts: Sequence[dict[str, Any]], dtype: str) -> list[torch.Tensor]:
    """Each item's `[num_tokens, width]` rows in `dtype` from a `/v1/cache/load` body holding
    exactly their hashes, checked as the rewrite hands them to the engine."""
    from mmferry.engines.rows import EngineItem

    try:
        loaded = read_rows(content, list(dict.fromkeys(f["hash"] for f in facts)))
    except BadAnswer as e:
        raise BadEncoderAnswer(str(e)) from None
    out = []
    for f in facts:
        h = f["hash"]
        rows = loaded[h]
        try:
            check_rows(h, rows, f["num_tokens"], DTYPES[dtype])
            # NOTE: a tower's rows are layer-normed, never NaN or infinite; such rows are a
            # broken encoder's, and vLLM would generate from them without a word.
            if not bool(torch.isfinite(rows).all()):
                raise ValueError(f"{h}: rows hold NaN or infinite values")
            # The rewrite's own item (its merge rule and timestamps), built once here so that
            # an answer it would refuse fails this encoder instead of the request.
            stamps = f["timestamps"]
            grid = tuple(f["grid_thw"])
            EngineItem(f["modality"], grid, rows, h, None if stamps is None else tuple(stamps))
        except (BadAnswer, BadRows, ValueError) as e:
            raise BadEncoderAnswer(str(e)) from None
        out.append(rows)
    return out
