"""The service sizes an item for its pool only from a header the pixel limit allows, and reads
that header off the event loop."""

from __future__ import annotations

import asyncio
import base64
import io
import threading
from typing import Any

import numpy as np
import pytest
from PIL import Image

import mmferry as mf
from mmferry.preprocess import buffers
from mmferry.preprocess import scheduler as scheduler_mod
from mmferry.server.limits import Limits, RequestError

from .in_process import prepare

PROC = mf.Processor.for_model("qwen3-vl")


def _data_url(width: int, height: int) -> str:
    pixels = np.random.default_rng(width).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "JPEG", quality=80)
    return "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode()


@pytest.fixture
def asks(monkeypatch) -> list[int]:
    """The bytes each running item asks the host buffer cache to keep."""
    asked: list[int] = []
    real = buffers.ensure_host_cache

    def recording(nbytes: int) -> Any:
        asked.append(nbytes)
        return real(nbytes)

    monkeypatch.setattr(scheduler_mod, "ensure_host_cache", recording)
    return asked


def _part(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


def test_a_header_over_the_pixel_limit_never_sizes_the_buffer_cache(asks):
    # 2000x1500 = 3 MP against a 1 MP limit: refused, and the cache was never raised to the
    # 12 MB of decoded pixels the header claims.
    with pytest.raises(RequestError) as refused:
        prepare({"content": [_part(_data_url(2000, 1500))]}, Limits(max_pixels=1_000_000))
    assert refused.value.kind == "over_limit"
    assert asks == [0]


def test_an_image_within_the_limit_asks_for_its_own_bytes(asks):
    items = prepare({"content": [_part(_data_url(800, 600))]}, Limits(max_pixels=1_000_000))
    assert len(items) == 1
    assert asks == [scheduler_mod.image_bytes(600, 800, PROC.config, "compact-u8")]


def test_headers_are_read_off_the_event_loop(monkeypatch):
    opened: list[threading.Thread] = []
    real_open = Image.open

    def recording_open(*args: Any, **kwargs: Any) -> Any:
        opened.append(threading.current_thread())
        return real_open(*args, **kwargs)

    loop_threads: list[threading.Thread] = []

    async def run() -> None:
        loop_threads.append(threading.current_thread())

    monkeypatch.setattr(Image, "open", recording_open)
    asyncio.run(run())
    prepare({"content": [_part(_data_url(64, 48)), _part(_data_url(96, 80))]}, Limits())
    # The loop of `_prepare` runs on this thread, as the loop of `run` did.
    assert loop_threads == [threading.current_thread()]
    assert opened, "no image header was read"
    assert threading.current_thread() not in opened


def test_a_header_past_a_large_exif_block_still_sizes_the_item(asks):
    # The frame header comes after 20 KB of EXIF: past the first slice of the payload decoded
    # for it, within the second.
    pixels = np.random.default_rng(3).integers(0, 256, (600, 800, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "JPEG", quality=80, exif=b"Exif\0\0" + b"\0" * 20_000)
    raw = buf.getvalue()
    assert raw.find(b"\xff\xc0") > 20_000  # the frame header (SOF0) after the EXIF block
    url = "data:image/jpeg;base64," + base64.b64encode(raw).decode()
    items = prepare({"content": [_part(url)]}, Limits(max_pixels=1_000_000))
    assert len(items) == 1
    assert asks == [scheduler_mod.image_bytes(600, 800, PROC.config, "compact-u8")]
