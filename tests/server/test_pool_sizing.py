"""The service sizes an item for its pool only from a header the pixel limit allows, reads a
fetched file's header off the event loop, and a data: URL's from its head alone."""

from __future__ import annotations

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

from .conftest import png
from .in_process import prepare
from .slow import SlowOrigin

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


def _recorded_opens(monkeypatch) -> list[tuple[threading.Thread, int | None]]:
    """Each `Image.open`: its thread and the bytes of the buffer it opened (None: not bytes)."""
    opened: list[tuple[threading.Thread, int | None]] = []
    real_open = Image.open

    def recording_open(fp: Any, *args: Any, **kwargs: Any) -> Any:
        size = len(fp.getbuffer()) if isinstance(fp, io.BytesIO) else None
        opened.append((threading.current_thread(), size))
        return real_open(fp, *args, **kwargs)

    monkeypatch.setattr(Image, "open", recording_open)
    return opened


def test_a_fetched_files_header_is_read_off_the_event_loop(monkeypatch):
    """A fetched file is any size: its header is parsed on a thread, never on the loop (which
    runs `prepare` on this thread)."""
    opened = _recorded_opens(monkeypatch)
    with SlowOrigin(png(96, 80, seed=5)) as origin:
        url = f"http://{origin.host}/img.png"
        items = prepare({"content": [_part(url), _part(url)]}, Limits(allow_hosts=(origin.host,)))
    assert len(items) == 2
    assert len(opened) >= 4, "no image header was read"  # two sizes, two decodes
    assert threading.current_thread() not in [t for t, _ in opened]


def test_a_data_urls_header_is_read_on_the_loop_from_its_head_alone(monkeypatch, asks):
    """A data: URL's header is parsed on the event loop (a hop to a thread and back cost more
    than the parse), from at most 48 KiB of its payload, whatever its size."""
    opened = _recorded_opens(monkeypatch)
    big = _data_url(1600, 1200)  # about 1.3 MB of base64
    assert len(big) > 1_000_000
    prepare({"content": [_part(big), _part(_data_url(96, 80))]}, Limits(max_pixels=4_000_000))
    on_loop = [size for t, size in opened if t is threading.current_thread()]
    assert len(on_loop) == 2  # one header each, both sized
    assert all(size is not None and size <= 48 * 1024 for size in on_loop)
    assert sorted(asks) == sorted(
        scheduler_mod.image_bytes(h, w, PROC.config, "compact-u8")
        for h, w in [(1200, 1600), (80, 96)]
    )


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
