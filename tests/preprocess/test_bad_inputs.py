"""Bad inputs get a ValueError naming the source and what is wrong."""

from __future__ import annotations

import io
import struct
import zlib

import numpy as np
import pytest
import torch
from PIL import Image

from mmferry.models import preset
from mmferry.preprocess.image import process_image
from mmferry.preprocess.video import process_video

from . import reference as ref
from .conftest import encode, gradient

CFG = preset("qwen3-vl")


def _png_declaring(width: int, height: int) -> bytes:
    """A tiny PNG whose header claims width x height (a decompression bomb's shape)."""
    data = encode(Image.fromarray(gradient(8, 8)), "PNG")
    ihdr = bytearray(data[8 : 8 + 25])  # length, b"IHDR", 13 bytes of fields, CRC
    ihdr[8:16] = struct.pack(">II", width, height)
    ihdr[21:25] = struct.pack(">I", zlib.crc32(bytes(ihdr[4:21])))
    return data[:8] + bytes(ihdr) + data[33:]


@pytest.mark.parametrize(
    ("source", "match"),
    [
        (b"", r"<bytes of length 0>.*empty"),
        (b"not an image at all" * 10, r"<bytes of length 190>.*not a readable image"),
        ("/nonexistent/dir/photo.jpg", r"not found: /nonexistent/dir/photo.jpg"),
        (np.zeros((10, 10, 3), np.float32), r"dtype float32.*uint8"),
        (np.zeros((10, 10, 2), np.uint8), r"2 channels"),
        (np.zeros((10, 10), np.uint8), r"3-d"),
        (np.zeros((0, 10, 3), np.uint8), r"empty"),
        (torch.zeros(10, 10, 3, dtype=torch.uint8), r"channels-last"),
        (12345, r"unsupported image source"),
    ],
    ids=["empty", "garbage", "missing", "float", "2ch", "2d", "zero", "hwc-tensor", "int"],
)
def test_image_errors(source, match):
    with pytest.raises(ValueError, match=match):
        process_image(source, CFG)


@pytest.mark.parametrize("fmt", ["JPEG", "PNG"])
def test_truncated_image(fmt, tmp_path):
    data = encode(Image.fromarray(gradient(200, 300, 1)), fmt)
    path = tmp_path / f"cut.{fmt.lower()}"
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=rf"{path}.*(truncated|corrupt)"):
        process_image(path, CFG)
    with pytest.raises(ValueError, match=r"<bytes of length \d+>"):
        process_image(data[: len(data) // 2], CFG)


def test_decompression_bomb_refused_from_header():
    bomb = _png_declaring(200_000, 200_000)
    assert len(bomb) < 1000
    # Refused on the header: decoding it would fail differently (its data is 8x8).
    with pytest.raises(ValueError, match="max_decoded_pixels|too large"):
        process_image(bomb, CFG)
    ok = _png_declaring(8, 8)
    process_image(ok, CFG)
    small_limit = CFG.replace(max_decoded_pixels=50 * 50)
    with pytest.raises(ValueError, match=r"100x100 = 10000 pixels.*max_decoded_pixels=2500"):
        process_image(encode(Image.fromarray(gradient(100, 100)), "PNG"), small_limit)


def test_aspect_ratio_error():
    with pytest.raises(ValueError, match="aspect ratio"):
        process_image(np.zeros((1, 250, 3), np.uint8), CFG)


def test_bad_layout():
    with pytest.raises(ValueError, match="layout"):
        process_image(np.zeros((32, 32, 3), np.uint8), CFG, layout="fp16")


def test_video_errors(tmp_path):
    good = tmp_path / "good.mp4"
    ref.encode_video(good, ref.moving_frames(30, 48, 64), 30)
    data = good.read_bytes()
    with pytest.raises(ValueError, match=r"<bytes of length 0>.*empty"):
        process_video(b"", CFG)
    with pytest.raises(ValueError, match=r"<bytes of length 400>.*not a readable video"):
        process_video(b"\x00\x01garbage!" * 40, CFG)
    cut = tmp_path / "cut.mp4"
    cut.write_bytes(data[: len(data) // 3])
    with pytest.raises(ValueError, match=rf"{cut}.*(truncated|corrupt|readable)"):
        process_video(cut, CFG)
    with pytest.raises(ValueError, match="not found"):
        process_video(tmp_path / "missing.mp4", CFG)
    with pytest.raises(ValueError, match="has no frames"):
        process_video(np.zeros((0, 32, 32, 3), np.uint8), CFG, source_fps=30)
    with pytest.raises(ValueError, match="THWC uint8"):
        process_video(np.zeros((4, 32, 32, 3), np.float32), CFG, source_fps=30)
    with pytest.raises(ValueError, match="no frames"):
        process_video([], CFG, source_fps=30)
    with pytest.raises(ValueError, match="either fps or num_frames"):
        process_video(good, CFG, fps=1, num_frames=4)
    with pytest.raises(ValueError, match="exceed max_decoded_pixels"):
        process_video(good, CFG.replace(max_decoded_pixels=100))


@pytest.mark.parametrize(
    ("ext", "match"), [("avi", "it has no frames"), ("mp4", "no video stream")]
)
def test_zero_frame_video(tmp_path, ext, match):
    """Containers written with no frames: AVI keeps an empty stream, MP4 drops it."""
    import av

    path = tmp_path / f"empty.{ext}"
    with av.open(str(path), "w") as out:
        stream = out.add_stream("mpeg4", rate=30)
        stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
        out.start_encoding()
    assert path.stat().st_size > 0
    with pytest.raises(ValueError, match=rf"{path}.*{match}"):
        process_video(path, CFG)


def test_missing_pyav_message(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_av(name, *args, **kwargs):
        if name == "av":
            raise ImportError("no av")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_av)
    with pytest.raises(ImportError, match=r"pip install 'mmferry\[video\]'"):
        process_video(io.BytesIO(b"\x00" * 10), CFG)


def test_zero_min_pixels_tiny_image_is_a_value_error():
    cfg = preset("qwen2-vl").replace(image_min_pixels=0)
    with pytest.raises(ValueError, match="min_pixels"):
        process_image(np.zeros((10, 10, 3), np.uint8), cfg)


def _png_chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def _png_with_chunk(kind: bytes, body: bytes, *, after_data: bool) -> bytes:
    """A valid 32x32 PNG with one extra chunk before its pixel data or just before IEND."""
    data = encode(Image.fromarray(gradient(32, 32)), "PNG")
    at = len(data) - 12 if after_data else 33  # IEND is the last 12 bytes; IHDR ends at 33
    return data[:at] + _png_chunk(kind, body) + data[at:]


# 8 MiB of zeros deflate to 8 KiB: past Pillow's limit on inflated metadata (1 MiB).
_INFLATES_FAR = zlib.compress(bytes(8 << 20), 9)


@pytest.mark.parametrize(
    ("kind", "body", "after_data"),
    [
        (b"zTXt", b"Comment\0\0" + _INFLATES_FAR, False),
        (b"zTXt", b"Comment\0\0" + _INFLATES_FAR, True),
        (b"iTXt", b"Comment\0\1\0\0\0" + _INFLATES_FAR, False),
        (b"iCCP", b"icc\0\0" + _INFLATES_FAR, False),
    ],
    ids=["zTXt", "zTXt-after-data", "iTXt", "iCCP"],
)
def test_png_metadata_inflating_past_the_limit(tmp_path, kind, body, after_data):
    data = _png_with_chunk(kind, body, after_data=after_data)
    with pytest.raises(ValueError, match=r"<bytes of length \d+>: .*too large"):
        process_image(data, CFG)
    path = tmp_path / "bomb.png"
    path.write_bytes(data)
    with pytest.raises(ValueError, match=rf"cannot decode image {path}: .*too large"):
        process_image(path, CFG)


@pytest.mark.parametrize(
    "header",
    [b"P6\nab 2\n255\n", b"P6\n2 x2\n255\n", b"P6\n2 2\n2z5\n", b"P6\n-2 2\n255\n"],
    ids=["width", "height", "maxval", "negative"],
)
def test_ppm_with_a_non_numeric_header_field(header):
    data = header + bytes(12)
    with pytest.raises(ValueError, match=rf"cannot decode image <bytes of length {len(data)}>: "):
        process_image(data, CFG)
