"""Video sampling, sizes, timestamps and pixels against transformers' Qwen-VL video code.

transformers' video processors resize with torchvision, which is unavailable; their frame
reading (`read_video_pyav`), sampling (`sample_frames`), sizing (`smart_resize`) and timestamp
(`_calculate_timestamps`) code is called directly, and pixels are compared with the plain-torch
statement of their resize/normalise/patchify in reference.py.
"""

from __future__ import annotations

from functools import partial

import numpy as np
import pytest
import torch
from PIL import Image
from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
from transformers.video_utils import VideoMetadata, read_video_pyav

import mmferry as mf
from mmferry.models import preset
from mmferry.preprocess.samples import sample_video
from mmferry.preprocess.sampling import frame_timestamps
from mmferry.preprocess.video import process_video, sample_indices
from mmferry.testing.layouts import compact_to_hf

from . import reference as ref

Qwen2VLVideoProcessor = ref.import_without_torchvision(
    "transformers.models.qwen2_vl.video_processing_qwen2_vl"
).Qwen2VLVideoProcessor


def _hf_timestamps(indices, fps, t=2):
    return Qwen3VLProcessor._calculate_timestamps(None, list(indices), fps, t)


@pytest.fixture(scope="module")
def videos(tmp_path_factory):
    root = tmp_path_factory.mktemp("videos")
    out = {}
    for n, h, w, fps in [(1, 48, 64, 30), (2, 48, 64, 30), (5, 64, 48, 10), (300, 48, 80, 30)]:
        path = root / f"v{n}.mp4"
        ref.encode_video(path, ref.moving_frames(n, h, w, seed=n), fps)
        out[n] = path
    return out


@pytest.mark.parametrize("n", [1, 2, 5, 300])
def test_qwen3_video_matches_transformers(videos, n):
    cfg = preset("qwen3-vl")
    hf_proc = Qwen3VLVideoProcessor()
    frames, meta = read_video_pyav(str(videos[n]), sample_indices_fn=hf_proc.sample_frames)
    indices = [int(i) for i in meta.frames_indices]
    item = process_video(videos[n], cfg, layout="hf")
    # transformers raises in smart_resize for fewer than 2 frames; mmferry pads first.
    sized_frames = max(len(indices), 2)
    size = ref.qwen3_video_size(cfg, sized_frames, meta.height, meta.width)
    p = cfg.patch_size
    grid_t = (len(indices) + 1) // 2
    assert item.grid_thw == (grid_t, size[0] // p, size[1] // p)
    assert item.timestamps == pytest.approx(_hf_timestamps(indices, meta.fps), abs=1e-12)
    want = ref.video_hf(frames, cfg, size)
    torch.testing.assert_close(item.feature, want, atol=1e-5, rtol=0)
    compact = process_video(videos[n], cfg, layout="compact-u8")
    assert compact.feature.dtype == torch.uint8 and compact.feature.shape == want.shape
    assert compact.hash == item.hash
    torch.testing.assert_close(compact_to_hf(compact, cfg), item.feature, atol=1e-6, rtol=0)


def test_qwen3_300_frames_sampling(videos):
    item = process_video(videos[300], preset("qwen3-vl"), layout="compact-u8")
    # E8/E9: 300 frames at 30 fps -> 20 sampled -> grid_t 10; first timestamps 0.3, 1.3, 2.4.
    assert item.grid_thw[0] == 10
    assert [f"{t:.1f}" for t in item.timestamps[:4]] == ["0.3", "1.3", "2.4", "3.4"]


@pytest.mark.parametrize(
    ("total", "fps", "want"),
    [
        (300, 30, [0, 16, 31, 47, 63, 79, 94, 110]),
        (15, 30, [0, 5, 9, 14]),
    ],
)
def test_qwen3_worked_indices(total, fps, want):
    got = sample_indices(preset("qwen3-vl"), total, fps)
    assert got[: len(want)] == want
    meta = VideoMetadata(total_num_frames=total, fps=fps)
    assert got == Qwen3VLVideoProcessor().sample_frames(meta).tolist()


@pytest.mark.parametrize("total", [1, 2, 3, 4, 5, 7, 15, 30, 64, 300, 601, 100000])
@pytest.mark.parametrize("src_fps", [1.0, 10.0, 29.97, 30.0])
def test_sampling_vs_transformers(total, src_fps):
    meta = VideoMetadata(total_num_frames=total, fps=src_fps)
    q3 = Qwen3VLVideoProcessor().sample_frames(meta).tolist()
    assert sample_indices(preset("qwen3-vl"), total, src_fps) == q3
    for num in (4, 8):
        want = Qwen3VLVideoProcessor().sample_frames(meta, num_frames=num).tolist()
        if num <= total:
            assert sample_indices(preset("qwen3-vl"), total, src_fps, num_frames=num) == want
    cfg2 = preset("qwen2.5-vl")
    ours = sample_indices(cfg2, total, src_fps)
    if total >= cfg2.temporal_patch_size:
        want2 = Qwen2VLVideoProcessor().sample_frames(meta, fps=cfg2.fps).tolist()
        assert ours == want2
    else:  # transformers divides by zero here; mmferry keeps the lone frame
        assert ours == list(range(total))


@pytest.mark.parametrize("total", [2, 3, 300])
def test_qwen2_num_frames_below_one_patch_keeps_one_patch(total):
    # num_frames=1 rounds to 0 temporal patches (transformers then divides by zero); one patch
    # of T frames is kept, as transformers samples for num_frames=T, never the whole clip.
    cfg = preset("qwen2.5-vl")
    meta = VideoMetadata(total_num_frames=total, fps=30.0)
    want = Qwen2VLVideoProcessor().sample_frames(meta, num_frames=2).tolist()
    assert sample_indices(cfg, total, 30.0, num_frames=1) == want


def test_timestamps_worked_case():
    # E8: 15 frames at 30 fps -> indices [0, 5, 9, 14] -> timestamps 0.1 and 0.4 (rounded).
    ts = frame_timestamps([0, 5, 9, 14], 30.0, 2)
    assert [f"{t:.1f}" for t in ts] == ["0.1", "0.4"]
    assert frame_timestamps([0, 2, 4], 2.0, 2) == tuple(_hf_timestamps([0, 2, 4], 2.0))


@pytest.mark.parametrize("n", [1, 5, 300])
def test_qwen25_video(videos, n):
    cfg = preset("qwen2.5-vl")
    hf_proc = Qwen2VLVideoProcessor()
    frames, meta = read_video_pyav(
        str(videos[n]),
        sample_indices_fn=partial(hf_proc.sample_frames, fps=cfg.fps)
        if n >= 2
        else lambda metadata, **_: np.arange(metadata.total_num_frames),
    )
    item = process_video(videos[n], cfg, layout="hf")
    size = ref.hf_smart_resize(
        meta.height,
        meta.width,
        factor=cfg.factor,
        min_pixels=cfg.video_min_pixels,
        max_pixels=cfg.video_max_pixels,
    )
    assert item.grid_thw == ((len(frames) + 1) // 2, size[0] // 14, size[1] // 14)
    assert item.timestamps is None
    # Qwen2.5-VL's processor: second_per_grid_ts = temporal_patch_size / metadata.sampled_fps.
    assert item.second_per_grid_t == pytest.approx(2 / meta.sampled_fps)
    torch.testing.assert_close(item.feature, ref.video_hf(frames, cfg, size), atol=1e-5, rtol=0)


def test_frame_sequences_match_file_frames(videos):
    """Frames given directly (with source_fps) sample and encode like the decoded file."""
    cfg = preset("qwen3-vl")
    frames, meta = read_video_pyav(
        str(videos[300]), sample_indices_fn=lambda metadata, **_: np.arange(300)
    )
    from_file = process_video(videos[300], cfg, layout="compact-u8")
    pil_frames = [Image.fromarray(f) for f in frames]
    for src in (frames, torch.from_numpy(frames).permute(0, 3, 1, 2), list(frames), pil_frames):
        got = process_video(src, cfg, layout="compact-u8", source_fps=meta.fps)
        assert torch.equal(got.feature, from_file.feature)
        assert got.timestamps == from_file.timestamps
    with pytest.raises(ValueError, match="source_fps"):
        process_video(frames, cfg)


def test_fps_and_num_frames_options(videos):
    cfg = preset("qwen3-vl")
    a = process_video(videos[300], cfg, layout="compact-u8", fps=1.0)
    assert a.grid_thw[0] == 5  # 10 s at 1 fps -> 10 frames
    b = process_video(videos[300], cfg, layout="compact-u8", num_frames=6)
    assert b.grid_thw[0] == 3
    assert len({a.hash, b.hash, process_video(videos[300], cfg, layout="compact-u8").hash}) == 3
    capped = process_video(videos[300], cfg.replace(cap_pixels_per_frame=True), layout="compact-u8")
    assert capped.hash != a.hash


def test_bundled_sample_video():
    item = process_video(sample_video(), preset("qwen3-vl"), layout="hf")
    assert item.grid_thw == (2, 8, 12)  # 24 frames at 12 fps -> 4 sampled; 144x192 -> 128x192
    assert len(item.timestamps) == 2


def test_frame_array_hash_follows_content():
    cfg = preset("qwen3-vl")
    frames = ref.moving_frames(6, 32, 48, seed=3)
    a = process_video(frames, cfg, layout="compact-u8", source_fps=6)
    assert process_video(frames.copy(), cfg, layout="hf", source_fps=6).hash == a.hash
    changed = frames.copy()
    changed[5, 0, 0, 0] ^= 1  # one value in a frame that sampling keeps
    assert process_video(changed, cfg, layout="compact-u8", source_fps=6).hash != a.hash
    assert process_video(frames, cfg, layout="compact-u8", source_fps=3).hash != a.hash


def test_numpy_scalar_rates_and_counts(videos):
    """numpy scalars are numbers: they sample, encode and hash as the Python numbers do."""
    cfg = preset("qwen3-vl")
    frames = ref.moving_frames(8, 32, 48, seed=4)
    cases = [
        (
            {"num_frames": 4, "source_fps": 4},
            {"num_frames": np.int64(4), "source_fps": np.float32(4)},
        ),
        ({"num_frames": 4, "source_fps": 4}, {"num_frames": 4.0, "source_fps": 4.0}),
        ({"fps": 2, "source_fps": 4}, {"fps": np.float32(2), "source_fps": np.float64(4)}),
    ]
    for plain, numpy_kw in cases:
        want = process_video(frames, cfg, layout="compact-u8", **plain)
        got = process_video(frames, cfg, layout="compact-u8", **numpy_kw)
        assert torch.equal(got.feature, want.feature)
        assert (got.hash, got.timestamps) == (want.hash, want.timestamps)
    want = process_video(videos[300], cfg, layout="compact-u8", num_frames=6)
    got = process_video(videos[300], cfg, layout="compact-u8", num_frames=np.uint16(6))
    assert torch.equal(got.feature, want.feature) and got.hash == want.hash
    for kw, match in [
        ({"fps": np.float32("nan")}, "fps must be finite"),
        ({"num_frames": np.int64(0)}, "num_frames must be a whole number"),
        ({"num_frames": np.float64(2.5)}, "num_frames must be a whole number"),
        ({"num_frames": np.bool_(True)}, "num_frames must be a number"),
        ({"source_fps": np.float32(0)}, "source_fps must be a frame rate between"),
    ]:
        with pytest.raises(ValueError, match=match):
            process_video(frames, cfg, **{"source_fps": 4, **kw})


def test_flipped_frame_array_with_a_length_one_axis():
    """`a[::-1]` of a one-frame clip keeps a negative stride that numpy calls contiguous;
    it is an accepted input and equals the same frames laid out plainly."""
    proc = mf.Processor.for_model("qwen3-vl")
    rng = np.random.default_rng(3)
    clip = rng.integers(0, 256, (1, 64, 96, 3), dtype=np.uint8)
    for flipped in (clip[::-1], clip[:, :, :, ::-1][:, :, :, ::-1][::-1]):
        got = proc.video(flipped, layout="compact-u8", source_fps=2.0)
        want = proc.video(np.ascontiguousarray(flipped), layout="compact-u8", source_fps=2.0)
        assert torch.equal(got.feature, want.feature) and got.hash == want.hash
