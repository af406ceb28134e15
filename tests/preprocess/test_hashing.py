"""Item keys are BLAKE3 (128-bit) over the documented bytes, checked with a plain blake3 call."""

from __future__ import annotations

import json

import blake3
import numpy as np
import pytest

from mmferry.models import preset
from mmferry.preprocess.hashing import item_hash
from mmferry.preprocess.image import process_image

from .conftest import encode, gradient

CFG = preset("qwen3-vl")


def _framed(*parts: bytes) -> bytes:
    """What the module docstring says is hashed: each part's length (8 bytes, little-endian)
    and then the part."""
    return b"".join(len(p).to_bytes(8, "little") + p for p in parts)


def _reference_key(*parts: bytes) -> str:
    return blake3.blake3(_framed(*parts)).digest(length=16).hex()


def _settings(cfg) -> bytes:
    # The fingerprint's documented form, rebuilt here rather than taken from the code.
    import dataclasses

    return json.dumps(dataclasses.asdict(cfg), sort_keys=True).encode()


def test_encoded_source_key_is_blake3_of_the_framed_bytes():
    from PIL import Image

    data = encode(Image.fromarray(gradient(300, 420, seed=11)), "JPEG", quality=90)
    key = process_image(data, CFG).hash
    assert len(key) == 32  # 128 bits
    assert key == _reference_key(b"image", _settings(CFG), b"", b"encoded", data)
    assert process_image(data, CFG, layout="compact-u8").hash == key


def test_pixel_source_key_is_blake3_of_the_upright_pixels():
    rgb = gradient(320, 416, seed=12)  # a multiple of 32 on both sides: not resized
    key = process_image(rgb, CFG).hash
    shape = b"320,416,3"
    expected = _reference_key(
        b"image", _settings(CFG), b"", b"upright-hwc-u8", shape, np.ascontiguousarray(rgb).tobytes()
    )
    assert key == expected


@pytest.mark.parametrize("size", [0, 1, 5000, 3 << 20])
def test_item_hash_matches_reference_for_any_length(size):
    payload = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()
    got = item_hash("video", [b"encoded", memoryview(payload)], CFG, b"{}")
    assert got == _reference_key(b"video", _settings(CFG), b"{}", b"encoded", payload)
