"""Features on mixed devices and dtypes -> one tensor on the encoder's device, in one step.

One output allocation, the cast fused into the single copy of each row, host->device copies
non-blocking from pinned memory (pinned inputs and pinned shared-memory views directly, pageable
ones through `PinnedStaging`), and no host synchronisation on a device target.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mmferry.feed.pinned import PinnedStaging, staging_for


def _int_range(dtype: torch.dtype) -> tuple[int, int]:
    if dtype == torch.bool:
        return 0, 1
    info = torch.iinfo(dtype)
    return info.min, info.max


def _check_cast(i: int, src: torch.dtype, dst: torch.dtype) -> None:
    # NOTE: a cast is allowed only when every value of `src` survives it (up to float rounding):
    # anything -> a floating dtype, and an integer -> an integer whose range holds all of it.
    # Float -> integer truncates and a narrowing integer cast wraps (300 -> 44 in uint8).
    if dst.is_floating_point or dst.is_complex:
        if src.is_complex and not dst.is_complex:
            raise ValueError(
                f"feature {i} is {src}; casting it to {dst} would drop the imaginary part"
            )
        return
    if src.is_floating_point or src.is_complex:
        raise ValueError(
            f"feature {i} is {src}; casting it to {dst} would truncate values. "
            "Materialise into a floating dtype (the encoder's dtype) instead"
        )
    (lo, hi), (dlo, dhi) = _int_range(src), _int_range(dst)
    if lo < dlo or hi > dhi:
        raise ValueError(
            f"feature {i} is {src} (values {lo}..{hi}); casting it to {dst} (values {dlo}..{dhi}) "
            "would wrap values that do not fit, so lossy integer casts are refused. Materialise "
            f"into a floating dtype or an integer dtype that holds every {src} value"
        )


def _validate(features: Sequence[torch.Tensor], dtype: torch.dtype) -> tuple[torch.Size, int]:
    if isinstance(features, torch.Tensor) or not isinstance(features, Sequence):
        raise ValueError(
            "materialize_features takes a sequence of tensors; wrap a single tensor in a list"
        )
    if len(features) == 0:
        raise ValueError("materialize_features needs at least one feature tensor, got none")
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtype must be a torch.dtype, got {dtype!r}")
    trailing = None
    rows = 0
    for i, f in enumerate(features):
        if not isinstance(f, torch.Tensor):
            raise ValueError(f"feature {i} is a {type(f).__name__}, not a torch.Tensor")
        if f.dim() == 0:
            raise ValueError(f"feature {i} is 0-dim; features need a leading row axis")
        if trailing is None:
            trailing = f.shape[1:]
        elif f.shape[1:] != trailing:
            raise ValueError(
                f"feature {i} has trailing shape {tuple(f.shape[1:])}, but feature 0 has "
                f"{tuple(trailing)}; all features must share every axis after the first"
            )
        _check_cast(i, f.dtype, dtype)
        rows += f.shape[0]
    assert trailing is not None
    return trailing, rows


def _resolve(device: torch.device | str) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def materialize_features(
    features: Sequence[torch.Tensor],
    *,
    device: torch.device | str,
    dtype: torch.dtype,
    staging: PinnedStaging | None = None,
) -> torch.Tensor:
    """Rows of `features`, in order, as one contiguous tensor on `device` in `dtype`."""
    trailing, rows = _validate(features, dtype)
    device = _resolve(device)
    if len(features) == 1:
        f = features[0]
        if f.device == device and f.dtype == dtype and f.is_contiguous():
            return f  # already where the encoder wants it: no copy at all
    # NOTE: the only allocation of the output's size; every row is written exactly once.
    out = torch.empty((rows, *trailing), device=device, dtype=dtype)
    if device.type == "cuda":
        (staging or staging_for(device)).copy_rows(out, features)
        return out
    o = 0
    for f in features:
        n = f.shape[0]
        if n:
            # CPU (or meta) target: the cast is fused into this copy, no temporaries.
            out[o : o + n].copy_(f)
        o += n
    return out
