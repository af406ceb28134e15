"""Encoder capabilities read from attributes, and the pipeline step that packs encoder inputs.

An encoder declares what it does instead of being recognised by class name:
- `moves_own_inputs: bool` -- it materialises features on its device itself, so the pipeline
  must not move them first (that would be a second, redundant copy);
- `accepted_layouts: tuple[str, ...]` -- feature layouts it consumes ("hf", "compact-u8");
- `device`, `dtype` -- where and in what dtype it computes.
Missing attributes get safe defaults: the pipeline moves the features, "hf" only, and device /
dtype from the module's first parameter.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from mmferry.feed.materialize import materialize_features


@dataclass(frozen=True)
class EncoderCapabilities:
    device: torch.device
    dtype: torch.dtype
    moves_own_inputs: bool = False
    accepted_layouts: tuple[str, ...] = ("hf",)


@dataclass(frozen=True)
class EncoderInputs:
    """What an encoder call receives: features, their grids, and whether they were moved."""

    # One tensor on the encoder's device/dtype when `moved`, else the untouched source tensors.
    features: torch.Tensor | tuple[torch.Tensor, ...]
    grid_thw: torch.Tensor  # [num_items, 3] int64, on the host
    layout: str
    moved: bool


def _first_tensor(encoder: Any) -> torch.Tensor | None:
    if isinstance(encoder, torch.nn.Module):
        for t in encoder.parameters():
            return t
        for t in encoder.buffers():
            return t
    return None


def capabilities_of(encoder: Any) -> EncoderCapabilities:
    """The encoder's declared capabilities, with safe defaults for what it does not declare."""
    first = _first_tensor(encoder)
    device = getattr(encoder, "device", None)
    if device is None:
        device = first.device if first is not None else torch.device("cpu")
    dtype = getattr(encoder, "dtype", None)
    if dtype is None:
        dtype = first.dtype if first is not None and first.is_floating_point() else torch.float32
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"encoder.dtype must be a torch.dtype, got {dtype!r}")
    layouts = tuple(getattr(encoder, "accepted_layouts", ("hf",)))
    return EncoderCapabilities(
        device=torch.device(device),
        dtype=dtype,
        moves_own_inputs=bool(getattr(encoder, "moves_own_inputs", False)),
        accepted_layouts=layouts,
    )


def _split(
    features_or_items: Sequence[Any], grids: Sequence[Sequence[int]] | None
) -> tuple[list[torch.Tensor], list[tuple[int, int, int]], list[str]]:
    if isinstance(features_or_items, torch.Tensor) or len(features_or_items) == 0:
        raise ValueError("pass a non-empty list of MultimodalItems or of feature tensors")
    if all(isinstance(x, torch.Tensor) for x in features_or_items):
        if grids is None or len(grids) != len(features_or_items):
            raise ValueError("raw feature tensors need one grid_thw per tensor (grids=...)")
        feats = list(features_or_items)
        layouts = ["compact-u8" if f.dtype == torch.uint8 else "hf" for f in feats]
        return feats, [tuple(int(v) for v in g) for g in grids], layouts
    if grids is not None:
        raise ValueError("items carry their own grid_thw; do not pass grids with items")
    try:
        feats = [it.feature for it in features_or_items]
        thw = [tuple(int(v) for v in it.grid_thw) for it in features_or_items]
        layouts = [it.layout for it in features_or_items]
    except AttributeError as e:
        raise ValueError(
            "expected MultimodalItems (feature, grid_thw, layout) or feature tensors"
        ) from e
    return feats, thw, layouts


def prepare_encoder_inputs(
    encoder: Any,
    features_or_items: Sequence[Any],
    grids: Sequence[Sequence[int]] | None = None,
) -> EncoderInputs:
    """Pack items (or features + grids) for `encoder`, moving them only if it does not."""
    caps = capabilities_of(encoder)
    feats, thw, layouts = _split(features_or_items, grids)
    for i, (f, g) in enumerate(zip(feats, thw, strict=True)):
        if len(g) != 3 or min(g) < 1:
            raise ValueError(f"grid {i} must be three positive ints (t, h, w), got {g}")
        if f.dim() == 0 or f.shape[0] != g[0] * g[1] * g[2]:
            raise ValueError(
                f"feature {i} has shape {tuple(f.shape)}, but grid {g} needs t*h*w = "
                f"{g[0] * g[1] * g[2]} rows"
            )
    layout = layouts[0]
    if any(x != layout for x in layouts):
        raise ValueError(f"items mix layouts {sorted(set(layouts))}; encode each layout apart")
    if layout not in caps.accepted_layouts:
        raise ValueError(
            f"encoder accepts layouts {caps.accepted_layouts}, features are {layout!r}; "
            f"preprocess with layout={caps.accepted_layouts[0]!r}"
        )
    grid_thw = torch.tensor(thw, dtype=torch.int64)  # [num_items, 3], from host ints
    if caps.moves_own_inputs:
        # NOTE: the encoder materialises these itself; moving them here would copy twice.
        return EncoderInputs(tuple(feats), grid_thw, layout, moved=False)
    # NOTE: compact-u8 stays uint8 across the move (a quarter of float32's bytes); encoders
    # that accept it fold normalisation into their weights, so casting here would be wasted.
    dtype = torch.uint8 if layout == "compact-u8" else caps.dtype
    packed = materialize_features(feats, device=caps.device, dtype=dtype)
    return EncoderInputs(packed, grid_thw, layout, moved=True)
