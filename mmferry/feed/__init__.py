"""The device feed: features on any device -> one tensor on the encoder's device and dtype.

`materialize` packs features in one allocation with the cast fused into the copy; `pinned`
stages pageable host rows through reusable pinned buffers; `capabilities` packs inputs for an
encoder that does not move its own (one that declares `moves_own_inputs`, as `VisionEncoder`
does, gets the features untouched).
"""

from __future__ import annotations

from mmferry._exports import lazy_exports

_EXPORTS: dict[str, str] = {
    "materialize_features": "mmferry.feed.materialize",
    "PinnedStaging": "mmferry.feed.pinned",
    "capabilities_of": "mmferry.feed.capabilities",
    "prepare_encoder_inputs": "mmferry.feed.capabilities",
    "EncoderCapabilities": "mmferry.feed.capabilities",
    "EncoderInputs": "mmferry.feed.capabilities",
}

__all__ = list(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
