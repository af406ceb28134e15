"""The device feed: features on any device -> one tensor on the encoder's device and dtype.

`materialize` packs features in one allocation with the cast fused into the copy; `pinned`
stages pageable host rows through reusable pinned buffers; `capabilities` packs inputs for an
encoder that does not move its own (one that declares `moves_own_inputs`, as `VisionEncoder`
does, gets the features untouched).
"""

from __future__ import annotations

from mmferry.feed.capabilities import (
    EncoderCapabilities,
    EncoderInputs,
    capabilities_of,
    prepare_encoder_inputs,
)
from mmferry.feed.materialize import materialize_features
from mmferry.feed.pinned import PinnedStaging

__all__ = [
    "EncoderCapabilities",
    "EncoderInputs",
    "PinnedStaging",
    "capabilities_of",
    "materialize_features",
    "prepare_encoder_inputs",
]
