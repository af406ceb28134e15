"""A list of frames under the service's limits: counted before anything is read, then each
frame read, checked from its header and decoded in turn."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from mmferry.chat.media import build_item
from mmferry.chat.parts import parse_content
from mmferry.server.limits import Limits, RequestError

from .in_process import PROC, prepare


@pytest.fixture
def reads(monkeypatch) -> dict[str, int]:
    """Opens of each file, by its real path: every read of a source opens it once."""
    opened: dict[str, int] = {}
    real_open = os.open

    def counting(path: Any, *args: Any, **kwargs: Any) -> int:
        key = os.path.realpath(path)
        opened[key] = opened.get(key, 0) + 1
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", counting)
    return opened


def _frame(path: Path, width: int, height: int, seed: int) -> str:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(path, "PNG")
    return os.path.realpath(path)


def _video(frames: list[str]) -> dict[str, Any]:
    return {"content": [{"type": "video", "video": [f"file://{f}" for f in frames]}]}


def test_more_frames_than_the_limit_are_refused_before_any_is_read(tmp_path, reads):
    frame = _frame(tmp_path / "f.png", 64, 48, seed=1)
    limits = Limits(max_frames=10, allow_paths=(str(tmp_path),))
    with pytest.raises(RequestError) as refused:
        prepare(_video([frame] * 500), limits)
    assert refused.value.kind == "over_limit" and "--limit-frames" in refused.value.message
    assert reads.get(frame, 0) == 0


def test_frames_are_read_and_checked_one_at_a_time(tmp_path, reads):
    small = _frame(tmp_path / "small.png", 64, 48, seed=2)
    large = _frame(tmp_path / "large.png", 400, 300, seed=3)
    limits = Limits(max_pixels=100_000, allow_paths=(str(tmp_path),))
    # Frame 3 is over the pixel limit: frames 4 and 5 are never read.
    with pytest.raises(RequestError) as refused:
        prepare(_video([small, small, small, large, small, small]), limits)
    assert refused.value.kind == "over_limit" and "frame 3" in refused.value.message
    assert reads.get(small, 0) == 3 and reads.get(large, 0) == 1


def test_a_frame_list_equals_the_library_item(tmp_path):
    frames = [_frame(tmp_path / f"{k}.png", 96, 64, seed=k) for k in range(3)]
    (got,) = prepare(_video(frames), Limits(allow_paths=(str(tmp_path),)))
    (part,) = parse_content([{"type": "video", "video": [Path(f).read_bytes() for f in frames]}])
    want = build_item(PROC, part, "compact-u8", {})
    assert got.grid_thw == want.grid_thw and got.hash == want.hash
    assert got.timestamps == want.timestamps
    assert torch.equal(got.feature, want.feature)
