"""Container quirks the seeking decoder must survive: MP4 edit lists and missing sync-sample
tables. A full PyAV decode of the same file is the oracle for which frame index i is."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mmferry.models import preset
from mmferry.preprocess.sampling import frame_timestamps
from mmferry.preprocess.video import process_video, sample_indices
from mmferry.preprocess.video_decode import VideoInfo, decode_frames, probe_video

from . import reference as ref
from .video_files import SeekLog, edit_list, find_box, full_decode, rename_box, write_video

CFG = preset("qwen3-vl")
STSS = [b"moov", b"trak", b"mdia", b"minf", b"stbl", b"stss"]


def _decode(data: bytes, indices: list[int], info: VideoInfo) -> np.ndarray:
    """decode_frames at full size with the probe's seek table, as [n, H, W, 3]."""
    got = decode_frames(data, "clip", indices, lambda h, w: None, lambda h, w: (h, w), info)
    return got.permute(0, 2, 3, 1).numpy()


# 5: the edit starts inside the first GOP, so its keyframe and four more frames are decoded
# as references and discarded; 24: it starts on the third keyframe, and the demuxer drops the
# first two GOPs from its index altogether (the container still says 120 frames).
@pytest.mark.parametrize("discard", [5, 24])
@pytest.mark.parametrize("codec", ["mpeg4", "libx264"])
def test_edit_list_discarded_frames_count_for_neither_indices_nor_times(
    codec, discard, monkeypatch
):
    data = write_video(codec, ref.moving_frames(120, 64, 96, seed=discard), first_pts=-discard)
    assert [media_time > 0 for _, media_time in edit_list(data)] == [True]
    want, times = full_decode(data)
    assert len(want) == 120 - discard
    assert times[0] == 0  # presentation starts at the edit

    info = probe_video(data, "clip")
    assert info.total_frames == len(want)
    assert info.times == pytest.approx(times, abs=1e-9)
    indices = [0, 3, 11, 40, 41, 41, 77, len(want) - 1]
    log = SeekLog(monkeypatch)
    got = _decode(data, indices, info)
    log.assert_seek_path_succeeded(min_seeks=3)
    np.testing.assert_array_equal(got, want[indices])


@pytest.mark.parametrize("codec", ["mpeg4", "libx264"])
def test_edit_list_video_item_samples_the_presented_frames(codec):
    data = write_video(codec, ref.moving_frames(120, 64, 96, seed=1), first_pts=-5)
    want, times = full_decode(data)
    item = process_video(data, CFG, layout="compact-u8")  # needs the last presented frame
    indices = sample_indices(CFG, len(want), 30.0)
    assert item.timestamps == pytest.approx(frame_timestamps(indices, 30.0, 2, times), abs=1e-9)
    oracle = process_video(want, CFG, layout="compact-u8", source_fps=30.0)
    assert item.grid_thw == oracle.grid_thw
    assert torch.equal(item.feature, oracle.feature)
    assert item.timestamps == pytest.approx(oracle.timestamps, abs=1e-9)


@pytest.mark.parametrize("codec", ["mpeg4", "libx264"])
def test_mp4_without_sync_sample_table(codec):
    """No `stss` box: MP4 then calls every sample a keyframe. Seeking to a frame that needs
    its references must not pass off a frame decoded without them."""
    data = write_video(codec, ref.moving_frames(120, 64, 96, seed=7), gop=12)
    data = rename_box(data, STSS, b"free")
    want, _ = full_decode(data)
    assert len(want) == 120
    info = probe_video(data, "clip")
    if codec == "mpeg4":  # the demuxer takes the container's word: all 120 are keyframes
        assert info.keyframes == tuple(range(120))
    indices = [0, 5, 17, 40, 41, 77, 119]
    np.testing.assert_array_equal(_decode(data, indices, info), want[indices])


def test_intra_only_video_still_seeks(monkeypatch):
    """Every MJPEG frame is a keyframe: the keyframe check keeps the seek path for it."""
    data = write_video("mjpeg", ref.moving_frames(60, 64, 96, seed=8))
    assert find_box(data, STSS) is None  # all samples are sync samples: no table written
    want, _ = full_decode(data)
    indices = [0, 5, 17, 40, 41, 59]
    info = probe_video(data, "clip")
    log = SeekLog(monkeypatch)
    got = _decode(data, indices, info)
    log.assert_seek_path_succeeded(min_seeks=4)
    np.testing.assert_array_equal(got, want[indices])
