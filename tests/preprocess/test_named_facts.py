"""`encoded_image_facts`: the hash and grid an encoded image gets, read from its header alone,
are the ones `process_image` finds decoding it, for every format, mode, EXIF turn and resize
branch (what `mmferry proxy --name-ahead` names items by before an encoder has read them)."""

from __future__ import annotations

import pytest
from PIL import Image

from mmferry.config import ProcessorConfig
from mmferry.preprocess.image import encoded_image_facts, process_image

from .conftest import encode, gradient
from .exif import as_text, exif_block, orientation

QWEN2 = ProcessorConfig(family="qwen2_vl", patch_size=14)
QWEN3 = ProcessorConfig(
    family="qwen3_vl", patch_size=16, image_mean=(0.5,) * 3, image_std=(0.5,) * 3
)
SMALL = QWEN2.replace(image_min_pixels=56 * 56, image_max_pixels=112 * 112)  # shrinks them
LARGE = QWEN2.replace(image_min_pixels=1024 * 1024)  # grows them


def _turned(value: int) -> bytes:
    img = Image.fromarray(gradient(70, 130, value))
    exif = img.getexif()
    exif[0x0112] = value
    return encode(img, "JPEG", quality=90, exif=exif)


def _cases(odd_images: dict[str, bytes]) -> dict[str, bytes]:
    cases = dict(odd_images)
    for value in range(1, 9):
        cases[f"exif_{value}"] = _turned(value)
    png = Image.fromarray(gradient(45, 91, 12))
    cases["webp"] = encode(png, "WEBP", quality=80)
    cases["gif"] = encode(png.convert("P"), "GIF")
    cases["bmp"] = encode(png, "BMP")
    cases["tiff"] = encode(png, "TIFF")
    # A turn Pillow cannot read as a number is no turn, to both.
    cases["exif_text"] = encode(png, "JPEG", exif=exif_block(as_text(0x0112)))
    cases["exif_png_6"] = encode(png, "PNG", exif=exif_block(orientation(6)))
    return cases


@pytest.mark.parametrize(
    "cfg", [QWEN2, QWEN3, SMALL, LARGE], ids=["qwen2", "qwen3", "small", "large"]
)
def test_header_facts_are_the_decoded_items(odd_images, cfg):
    for name, data in _cases(odd_images).items():
        item = process_image(data, cfg)
        got = encoded_image_facts(data, cfg)
        assert got == (item.hash, tuple(item.grid_thw)), name


def test_the_settings_are_part_of_the_name(odd_images):
    data = odd_images["rgb_jpeg_odd"]
    names = {encoded_image_facts(data, cfg)[0] for cfg in (QWEN2, QWEN3, SMALL, LARGE)}
    assert len(names) == 4


@pytest.mark.parametrize(
    "data",
    [b"", b"not an image at all", encode(Image.fromarray(gradient(40, 40)), "PNG")[:20]],
    ids=["empty", "garbage", "cut_header"],
)
def test_an_unreadable_header_is_a_value_error_as_when_decoding(data):
    with pytest.raises(ValueError):
        process_image(data, QWEN2)
    with pytest.raises(ValueError):
        encoded_image_facts(data, QWEN2)


def test_a_header_over_the_pixel_budget_is_refused_before_anything_is_decoded():
    data = encode(Image.fromarray(gradient(60, 60)), "PNG")
    cfg = QWEN2.replace(max_decoded_pixels=59 * 60)
    with pytest.raises(ValueError, match="max_decoded_pixels"):
        encoded_image_facts(data, cfg)
