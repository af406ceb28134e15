"""Features on mixed devices and dtypes -> one tensor on the encoder's device, in one step."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def materialize_features(
    features: Sequence[torch.Tensor], *, device: torch.device | str, dtype: torch.dtype
) -> torch.Tensor:
    """Concatenate rows of `features` into one tensor on `device` in `dtype`, one allocation."""
    if len(features) == 0:
        raise ValueError("materialize_features needs at least one feature tensor")
    trailing = None
    for i, f in enumerate(features):
        if f.dim() == 0:
            raise ValueError(f"feature {i} is 0-dim; features need a row axis")
        if trailing is None:
            trailing = f.shape[1:]
        elif f.shape[1:] != trailing:
            raise ValueError(
                f"feature {i} has trailing shape {tuple(f.shape[1:])}, expected {tuple(trailing)}"
            )
    rows = sum(f.shape[0] for f in features)
    out = torch.empty((rows, *trailing), device=device, dtype=dtype)
    o = 0
    for f in features:
        out[o : o + f.shape[0]].copy_(f, non_blocking=True)
        o += f.shape[0]
    return out
