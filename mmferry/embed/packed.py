"""`packed_rows`: an item's main and deepstack rows side by side, `[main | ds0 | ds1 ...]`.

The layout vLLM and SGLang take (`mmferry.engines.rows`) and the one the service's cache routes
answer (`mmferry.server.ec`); here, below both, so neither reaches into the other.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def packed_rows(
    embeds: torch.Tensor, deepstack: Sequence[torch.Tensor] = (), dtype: torch.dtype | None = None
) -> torch.Tensor:
    """`[main | ds0 | ds1 ...]` along the last dim, cast to `dtype`, in one allocation."""
    parts = (embeds, *deepstack)
    n, width = embeds.shape
    for k, d in enumerate(deepstack):
        if d.shape != embeds.shape:
            raise ValueError(f"deepstack {k} has shape {tuple(d.shape)}, embeds {(n, width)}")
    if not deepstack and (dtype is None or dtype == embeds.dtype):
        return embeds
    out = torch.empty(n, width * len(parts), dtype=dtype or embeds.dtype, device=embeds.device)
    for k, part in enumerate(parts):
        out[:, k * width : (k + 1) * width].copy_(part)  # the cast happens in this one copy
    return out
