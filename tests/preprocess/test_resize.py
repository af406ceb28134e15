"""smart_resize and its video variant against transformers and the worked cases."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

# The default (torchvision) image processor module cannot import here; the PIL processor's and
# the video processor's modules hold the same function.
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
    smart_resize as hf_smart_resize,
)
from transformers.models.qwen3_vl.video_processing_qwen3_vl import (
    smart_resize as hf_video_smart_resize,
)

from mmferry import smart_resize
from mmferry.models import preset
from mmferry.preprocess.resize import smart_resize_video
from mmferry.preprocess.video import video_target_size

from .reference import import_without_torchvision

hf_video_module_smart_resize = import_without_torchvision(
    "transformers.models.qwen2_vl.video_processing_qwen2_vl"
).smart_resize

Q2 = {"factor": 28, "min_pixels": 3136, "max_pixels": 12845056}
Q3 = {"factor": 32, "min_pixels": 65536, "max_pixels": 16777216}
SIZES = [
    (800, 1000),
    (3000, 4000),
    (100, 100),
    (28, 28),
    (1080, 1920),
    (20, 3000),
    (10, 1900),
    (2000, 10),
    (720, 1280),
    (1, 1),
    (33, 6600),
]


def _hf(fn, h, w, kw):
    try:
        return fn(h, w, **kw)
    except ValueError:
        return "ValueError"


def _ours(h, w, kw):
    try:
        return smart_resize(h, w, **kw)
    except ValueError:
        return "ValueError"


@pytest.mark.parametrize("kw", [Q2, Q3], ids=["q2", "q3"])
@pytest.mark.parametrize("size", SIZES + [(1, 250)], ids=str)
def test_matches_transformers(size, kw):
    h, w = size
    assert (
        _ours(h, w, kw)
        == _hf(hf_smart_resize, h, w, kw)
        == _hf(hf_video_module_smart_resize, h, w, kw)
    )


@pytest.mark.parametrize(
    ("preset_name", "factor"), [("qwen2-vl", 28), ("qwen2.5-vl", 28), ("qwen3-vl", 32)]
)
def test_family_defaults(preset_name, factor):
    cfg = preset(preset_name)
    assert cfg.factor == factor
    kw = {"factor": factor, "min_pixels": cfg.image_min_pixels, "max_pixels": cfg.image_max_pixels}
    for h, w in SIZES:
        assert smart_resize(h, w, **kw) == hf_smart_resize(h, w, **kw)


# Reference notes section E: (size, settings) -> resized (H, W) and grid (h, w) and tokens.
WORKED = [
    ((800, 1000), Q2, (812, 1008), 1044),
    ((800, 1000), Q3, (800, 992), 775),
    ((3000, 4000), Q2, (2996, 4004), 15301),
    ((3000, 4000), {**Q2, "max_pixels": 1280 * 28 * 28}, (840, 1148), 1230),
    ((3000, 4000), Q3, (3008, 4000), 11750),
    ((100, 100), Q2, (112, 112), 16),
    ((100, 100), Q3, (256, 256), 64),
    ((28, 28), Q2, (56, 56), 4),
    ((1080, 1920), Q2, (1092, 1932), 2691),
    ((1080, 1920), Q3, (1088, 1920), 2040),
    ((20, 3000), Q2, (28, 2996), 107),
    ((10, 1900), Q2, (28, 784), 28),
    ((2000, 10), Q2, (812, 28), 29),
]


@pytest.mark.parametrize(("size", "kw", "want", "tokens"), WORKED)
def test_worked_cases(size, kw, want, tokens):
    got = smart_resize(*size, **kw)
    assert got == want
    patch = kw["factor"] // 2
    assert (got[0] // patch) * (got[1] // patch) // 4 == tokens


def test_bankers_rounding_and_aspect_limit():
    # 720 / 32 = 22.5 rounds to 22 (half to even), not 23.
    assert smart_resize(720, 1280, **Q3)[0] == 704
    with pytest.raises(ValueError, match="aspect ratio"):
        smart_resize(1, 250, **Q2)
    with pytest.raises(ValueError, match="positive"):
        smart_resize(0, 10, **Q2)


@settings(max_examples=300, deadline=None)
@given(
    h=st.integers(1, 12000),
    w=st.integers(1, 12000),
    kw=st.sampled_from([Q2, Q3, {"factor": 28, "min_pixels": 128 * 784, "max_pixels": 768 * 784}]),
)
def test_property_vs_transformers(h, w, kw):
    assert _ours(h, w, kw) == _hf(hf_smart_resize, h, w, kw)


@settings(max_examples=200, deadline=None)
@given(
    n=st.integers(2, 800),
    h=st.integers(1, 4000),
    w=st.integers(1, 4000),
)
def test_video_property_vs_transformers(n, h, w):
    kw = {"temporal_factor": 2, "factor": 32, "min_pixels": 4096, "max_pixels": 25165824}
    try:
        want = hf_video_smart_resize(n, h, w, **kw)
    except ValueError:
        with pytest.raises(ValueError):
            smart_resize_video(n, h, w, **kw)
        return
    assert smart_resize_video(n, h, w, **kw) == want


def test_video_worked_cases():
    cfg = preset("qwen3-vl")
    # E8: 20 sampled frames of 720x1280 -> 704x1280; 768 frames of 1080p -> 128x224.
    assert video_target_size(cfg, 20, 720, 1280) == (704, 1280)
    assert video_target_size(cfg, 768, 1080, 1920) == (128, 224)
    assert video_target_size(cfg, 4, 360, 640) == (352, 640)
    capped = cfg.replace(cap_pixels_per_frame=True)
    assert video_target_size(capped, 20, 720, 1280) == (640, 1152)
    # Shorter than the temporal patch: sized as the padded 2-frame clip.
    assert video_target_size(cfg, 1, 360, 640) == hf_video_smart_resize(
        2, 360, 640, temporal_factor=2, factor=32, min_pixels=4096, max_pixels=25165824
    )
    with pytest.raises(ValueError, match="temporal patch"):
        smart_resize_video(
            1, 64, 64, temporal_factor=2, factor=32, min_pixels=1, max_pixels=1 << 30
        )


@pytest.mark.parametrize(("h", "w"), [(10, 10), (10, 500), (500, 10)])
def test_zero_min_pixels_never_yields_an_empty_side(h, w):
    # transformers returns a 0 side here (round(10 / 28) == 0 passes a 0-pixel floor), which
    # then fails inside the resize kernel; mmferry says what to change instead.
    assert 0 in hf_smart_resize(h, w, factor=28, min_pixels=0, max_pixels=1 << 30)
    with pytest.raises(ValueError, match="min_pixels"):
        smart_resize(h, w, factor=28, min_pixels=0, max_pixels=1 << 30)
