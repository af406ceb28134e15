"""A conversation's media are preprocessed as one batch: each item equal to its own
`build_item` call, in prompt order, and a bad part's own error (the first bad part's)."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

import mmferry as mf
from mmferry.chat.apply import _build_items
from mmferry.chat.media import build_item
from mmferry.chat.parts import PartError, parse_messages

PROC = mf.Processor.for_model("qwen3-vl")


def _jpeg(h: int, w: int, seed: int) -> bytes:
    rgb = np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, "JPEG", quality=90)
    return buf.getvalue()


def _messages(*values: object) -> list[dict]:
    content = [{"type": "image", "image": v} for v in values]
    return [{"role": "user", "content": [*content, {"type": "text", "text": "what?"}]}]


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_media_batch_equals_one_call_per_part(threads):
    values = [_jpeg(300, 420, 1), _jpeg(64, 90, 2), Image.new("RGB", (500, 333), (9, 80, 200))]
    frames = np.random.default_rng(5).integers(0, 256, (4, 64, 96, 3), dtype=np.uint8)
    messages = _messages(*values)
    messages[0]["content"].insert(1, {"type": "video", "video": list(frames), "sample_fps": 2})
    media = parse_messages(messages).media
    got = _build_items(PROC, media, "compact-u8", {}, threads)
    want = [build_item(PROC, part, "compact-u8", {}) for part in media]
    assert [g.modality for g in got] == ["image", "video", "image", "image"]
    for g, w in zip(got, want):
        assert (g.grid_thw, g.hash, g.timestamps) == (w.grid_thw, w.hash, w.timestamps)
        assert bool((g.feature == w.feature).all())


def test_the_first_bad_part_is_named():
    media = parse_messages(_messages(_jpeg(40, 40, 3), b"junk", b"more junk")).media
    for _ in range(3):
        with pytest.raises(PartError, match="^message 0 part 1 "):
            _build_items(PROC, media, "hf", {}, 2)
