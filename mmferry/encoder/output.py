"""`VisionOutput`: what every vision encoder returns per item."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class VisionOutput:
    """One item's vision embeddings [tokens, out_hidden] and Qwen3-VL deepstack rows."""

    embeds: torch.Tensor
    deepstack: tuple[torch.Tensor, ...] = ()
