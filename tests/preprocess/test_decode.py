"""Valid images with awkward metadata or memory layouts decode like their plain counterparts.

References are independent of decode.py: orientations are turned with numpy (checked against
Pillow's `exif_transpose` where Pillow can read the file), flipped arrays against a contiguous
copy, features against the plain-torch statement of transformers' processor (reference.py).
"""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

from mmferry.models import preset
from mmferry.preprocess.decode import decode_image
from mmferry.preprocess.image import process_image
from tests.preprocess import exif

from . import reference as ref
from .conftest import encode, gradient

CFG = preset("qwen3-vl")


def _by_hand(stored: np.ndarray, orientation: int) -> np.ndarray:
    """The upright view of `stored` [H, W, C] for an EXIF orientation (the TIFF 6.0 table)."""
    turn = {
        1: lambda a: a,
        2: lambda a: a[:, ::-1],  # mirrored left-right
        3: lambda a: a[::-1, ::-1],  # upside down
        4: lambda a: a[::-1],  # mirrored top-bottom
        5: lambda a: a.transpose(1, 0, 2),  # mirrored along the main diagonal
        6: lambda a: np.rot90(a, -1),  # shown turned 90 degrees clockwise
        7: lambda a: a.transpose(1, 0, 2)[::-1, ::-1],  # mirrored along the other diagonal
        8: lambda a: np.rot90(a, 1),  # shown turned 90 degrees counter-clockwise
    }[orientation]
    return np.array(turn(stored))  # contiguous and writable


def _assert_features(item, rgb: np.ndarray) -> None:
    want, grid = ref.image_hf(rgb, CFG)
    assert item.grid_thw == grid
    torch.testing.assert_close(item.feature, want, atol=1e-5, rtol=0)


# Numeric tags whose value written as text breaks Pillow's EXIF re-serialisation, which
# `ImageOps.exif_transpose` runs after turning the pixels.
BROKEN_TAGS = {
    "XResolution": exif.X_RESOLUTION,
    "ImageWidth": exif.IMAGE_WIDTH,
    "ResolutionUnit": exif.RESOLUTION_UNIT,
}


CASES = [(o, "XResolution") for o in range(1, 9)] + [(6, "ImageWidth"), (6, "ResolutionUnit")]


@pytest.mark.parametrize(("orientation", "tag_name"), CASES, ids=[f"{o}-{t}" for o, t in CASES])
def test_orientation_applied_when_another_exif_tag_is_broken(orientation, tag_name):
    tag = BROKEN_TAGS[tag_name]
    pixels = Image.fromarray(gradient(48, 80, orientation))
    clean = encode(pixels, "JPEG", quality=95, exif=exif.exif_block(exif.orientation(orientation)))
    broken_exif = exif.exif_block(exif.orientation(orientation), exif.as_text(tag))
    broken = encode(pixels, "JPEG", quality=95, exif=broken_exif)
    stored = np.array(Image.open(io.BytesIO(broken)).convert("RGB"))
    want = _by_hand(stored, orientation)
    # The numpy table is Pillow's where Pillow can read the file.
    np.testing.assert_array_equal(ref.load_rgb(clean), want)
    _assert_features(process_image(broken, CFG, layout="hf"), want)
    _assert_features(process_image(Image.open(io.BytesIO(broken)), CFG, layout="hf"), want)


def test_unreadable_orientation_is_ignored_as_pillow_does():
    # The orientation itself stored as text: no viewer can apply it, Pillow leaves the pixels.
    pixels = Image.fromarray(gradient(48, 80, 9))
    data = encode(pixels, "JPEG", quality=95, exif=exif.exif_block(exif.as_text(exif.ORIENTATION)))
    stored = np.array(Image.open(io.BytesIO(data)))
    np.testing.assert_array_equal(ref.load_rgb(data), stored)
    _assert_features(process_image(data, CFG, layout="hf"), stored)


def test_png_exif_chunk_with_a_broken_tag():
    # PNG carries EXIF in an eXIf chunk; the same orientation rule applies.
    pixels = Image.fromarray(gradient(40, 72, 10))
    broken = exif.exif_block(exif.orientation(6), exif.as_text(exif.X_RESOLUTION))
    data = encode(pixels, "PNG", exif=broken)
    want = _by_hand(np.asarray(pixels), 6)
    _assert_features(process_image(data, CFG, layout="hf"), want)


HWC = (12, 200, 3)


@pytest.mark.parametrize(
    "flipped",
    [
        lambda a: a[:1][::-1],  # one row, rows flipped
        lambda a: a[:, :1][:, ::-1],  # one column, columns flipped
        lambda a: a[..., :1][..., ::-1],  # one channel, channels flipped
        lambda a: a[:1, :, ::-1][::-1],  # one row, rows and channels flipped
        lambda a: a[:1, ::-1][::-1],  # one row, rows and columns flipped
        lambda a: a[:, :1, :1][::-1, ::-1, ::-1],  # every axis flipped
        lambda a: a[::-1, ::-1],  # no axis of length 1
    ],
    ids=["row", "column", "channel", "row+channels", "row+columns", "all", "plain-flip"],
)
def test_flipped_arrays_equal_their_contiguous_copies(flipped):
    source = gradient(*HWC[:2], 11)
    arr = flipped(source)
    assert min(arr.strides) < 0
    cfg = CFG.replace(image_min_pixels=32 * 32)
    plain = arr.copy()  # np.ascontiguousarray would keep a length-1 axis's negative stride
    assert min(plain.strides) >= 0
    want = process_image(plain, cfg, layout="hf")
    got = process_image(arr, cfg, layout="hf")
    assert got.grid_thw == want.grid_thw and got.hash == want.hash
    assert torch.equal(got.feature, want.feature)
    # The same pixels as a CHW tensor (torch has no negative strides: a flip is a copy).
    chw = torch.from_numpy(plain).permute(2, 0, 1)
    assert torch.equal(process_image(chw, cfg, layout="hf").feature, want.feature)


@pytest.mark.parametrize("mode", ["La", "RGBa"])
def test_premultiplied_alpha_modes_composite_on_white(mode):
    """Pillow converts La / RGBa only to LA / RGBA; the result is that image on white."""
    rng = np.random.default_rng(5)
    straight = "LA" if mode == "La" else "RGBA"
    bands = len(straight)
    pixels = rng.integers(0, 256, (20, 30, bands), dtype=np.uint8)
    im = Image.fromarray(pixels, straight).convert(mode)
    got = decode_image(im, 1 << 24).pixels.permute(1, 2, 0).numpy()
    rgba = np.asarray(im.convert(straight).convert("RGBA")).astype(np.float64)
    alpha = rgba[..., 3:] / 255
    want = rgba[..., :3] * alpha + 255 * (1 - alpha)
    assert np.abs(got.astype(np.float64) - want).max() <= 1
