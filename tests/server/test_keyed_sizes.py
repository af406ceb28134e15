"""A part's qwen-vl-utils keys choose its size within the server's budgets, over real HTTP: the
size they ask for is worked out from the header and refused before any pixel is decoded (the
refused sources here are headers over pixel data no decoder reads), a size within budget is
served."""

from __future__ import annotations

import base64
import io
import json
from collections.abc import Iterator

import httpx
import numpy as np
import pytest

from mmferry.server.encoded import from_bytes

from .conftest import IMAGE_MAX_PIXELS, Server, png, start_server
from .test_hostile import _png_with

# Qwen3-VL's rule: a video's frames (rounded up to whole temporal patches) x size within it.
VIDEO_MAX_PIXELS = 4 * 128 * 128
LIMIT_PIXELS = 1_000_000


@pytest.fixture(scope="module")
def budgeted() -> Iterator[Server]:
    s = start_server(
        [
            *("--video-max-pixels", str(VIDEO_MAX_PIXELS), "--limit-pixels", str(LIMIT_PIXELS)),
            *("--shm-mib", "0"),
        ]
    )
    yield s
    s.stop()


def _post(server: Server, *parts: dict) -> httpx.Response:
    body = json.dumps({"content": list(parts)}).encode()
    return httpx.post(
        f"{server.url}/v1/encode",
        content=body,
        headers={"content-type": "application/json"},
        timeout=120,
    )


def _data(data: bytes, mime: str) -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def _clip(frames: int, size: int = 32) -> bytes:
    """An H.264 MP4 of `frames` frames: its size sits in the container's header (avcC)."""
    import av

    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as out:
        stream = out.add_stream("libx264", rate=30)
        stream.width = stream.height = size
        stream.pix_fmt = "yuv420p"
        for i in range(frames):
            pixels = np.full((size, size, 3), (i * 7) % 256, np.uint8)
            for pkt in stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")):
                out.mux(pkt)
        for pkt in stream.encode():
            out.mux(pkt)
    return buf.getvalue()


def _header_only(mp4: bytes) -> bytes:
    """`mp4` with its coded frames zeroed: the header is read as before, no frame decodes."""
    out = bytearray(mp4)
    at = out.find(b"mdat")
    size = int.from_bytes(out[at - 4 : at], "big")
    out[at + 4 : at - 4 + size] = bytes(size - 8)
    return bytes(out)


def _refusal(r: httpx.Response) -> str:
    assert r.status_code == 422, f"{r.status_code}: {r.text[:300]!r}"
    assert r.json()["error"]["kind"] == "over_limit", r.text
    return r.json()["error"]["message"]


def _qwen_image_size(height: int, width: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """qwen-vl-utils' own `smart_resize` (the reference for what the keys ask for)."""
    from tests.chat.oracle import _import_qwen_vl_utils

    return _import_qwen_vl_utils().smart_resize(height, width, 32, min_pixels, max_pixels)


def test_an_image_asking_past_max_pixels_is_refused_from_its_header(budgeted):
    # The header says 800x600; no pixel data follows that Pillow could decode.
    header = _data(_png_with(b"", 800, 600), "image/png")
    keys = {"min_pixels": 200_000, "max_pixels": 300_000}
    h, w = _qwen_image_size(600, 800, **keys)
    assert IMAGE_MAX_PIXELS < h * w <= LIMIT_PIXELS
    message = _refusal(_post(budgeted, {"type": "image", "image": header, **keys}))
    assert message.startswith("part 0:"), message
    assert f"{w}x{h} pixels" in message and str(h * w) in message
    assert f"max_pixels={IMAGE_MAX_PIXELS} (--max-pixels)" in message
    # Past --limit-pixels too, which bounds sources: the budget is named, for the second part.
    big = {"type": "image", "image": header, "resized_height": 1024, "resized_width": 1024}
    plain = {"type": "image", "image": _data(png(64, 64, seed=3), "image/png")}
    message = _refusal(_post(budgeted, plain, big))
    assert message.startswith("part 1:") and "1024x1024 pixels" in message
    assert "(--max-pixels)" in message
    # Within budget the same header passes the check and reaches the decoder, which refuses it.
    r = _post(budgeted, {"type": "image", "image": header, "max_pixels": IMAGE_MAX_PIXELS})
    assert r.status_code == 422 and r.json()["error"]["kind"] == "bad_media", r.text


def test_an_image_keyed_within_max_pixels_is_served(budgeted):
    image = _data(png(64, 64, seed=3), "image/png")
    # 256x256 is --max-pixels exactly; one more row of patches is past it.
    at_budget = {"type": "image", "image": image, "resized_height": 256, "resized_width": 256}
    r = _post(budgeted, at_budget)
    assert r.status_code == 200, r.text
    assert from_bytes(r.content)[0].grid_thw == (1, 16, 16)
    message = _refusal(_post(budgeted, {**at_budget, "resized_height": 288}))
    assert "256x288 pixels" in message and "(--max-pixels)" in message


def test_a_video_asking_past_video_max_pixels_is_refused_from_its_header(budgeted):
    clip = _data(_header_only(_clip(8)), "video/mp4")
    keys = {"nframes": 4, "resized_height": 160, "resized_width": 128}
    message = _refusal(_post(budgeted, {"type": "video", "video": clip, **keys}))
    assert message.startswith("part 0:"), message
    assert f"4 frames of 128x160 pixels ({4 * 160 * 128} in all)" in message
    assert f"video_max_pixels={VIDEO_MAX_PIXELS} (--video-max-pixels)" in message
    big = {**keys, "resized_height": 1024, "resized_width": 1024}
    message = _refusal(_post(budgeted, {"type": "video", "video": clip, **big}))
    assert "4 frames of 1024x1024 pixels" in message and "(--video-max-pixels)" in message
    # A list of frames is sized by the same rules; these frames are headers only too.
    frame = _data(_png_with(b"", 256, 256), "image/png")
    message = _refusal(_post(budgeted, {"type": "video", "video": [frame] * 4}))
    assert "4 frames of" in message and "(--video-max-pixels)" in message
    # Within budget the header-only clip reaches the decoder, which refuses it.
    within = {**keys, "resized_height": 128}
    r = _post(budgeted, {"type": "video", "video": clip, **within})
    assert r.status_code == 422 and r.json()["error"]["kind"] == "bad_media", r.text


def test_a_video_keyed_within_video_max_pixels_is_served(budgeted):
    clip = _data(_clip(8), "video/mp4")
    # Four frames of 128x128: the budget exactly.
    keys = {"nframes": 4, "resized_height": 128, "resized_width": 128}
    r = _post(budgeted, {"type": "video", "video": clip, **keys})
    assert r.status_code == 200, r.text
    assert from_bytes(r.content)[0].grid_thw == (2, 8, 8)
    message = _refusal(_post(budgeted, {"type": "video", "video": clip, **keys, "nframes": 6}))
    assert "6 frames of 128x128 pixels" in message
