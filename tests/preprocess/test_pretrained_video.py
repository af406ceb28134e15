"""`Processor.from_pretrained` reads a folder's video settings as transformers does.

transformers' `AutoVideoProcessor` needs torchvision (not installed), so the oracle is the part
of it that decides: `BaseVideoProcessor.get_video_processor_dict` picks the settings file
(processor_config.json's `video_processor`, else video_preprocessor_config.json, else
preprocessor_config.json), the model's video processor class supplies what the file leaves
out, and its `sample_frames` and `smart_resize` give the frames and the grid.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from transformers import Qwen2_5_VLConfig, Qwen3VLConfig
from transformers.video_processing_utils import BaseVideoProcessor
from transformers.video_utils import read_video_pyav

import mmferry as mf

from . import reference as ref

qwen2_video = ref.import_without_torchvision(
    "transformers.models.qwen2_vl.video_processing_qwen2_vl"
)
qwen3_video = ref.import_without_torchvision(
    "transformers.models.qwen3_vl.video_processing_qwen3_vl"
)
MODELS = {
    "qwen2_5_vl": (Qwen2_5_VLConfig, qwen2_video.Qwen2VLVideoProcessor, qwen2_video),
    "qwen3_vl": (Qwen3VLConfig, qwen3_video.Qwen3VLVideoProcessor, qwen3_video),
}
# The public checkpoints' image processor configs.
IMAGE_CONFIGS = {
    "qwen2_5_vl": {
        "min_pixels": 3136,
        "max_pixels": 12845056,
        "patch_size": 14,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711],
        "image_processor_type": "Qwen2VLImageProcessor",
    },
    "qwen3_vl": {
        "size": {"shortest_edge": 65536, "longest_edge": 16777216},
        "patch_size": 16,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "image_processor_type": "Qwen2VLImageProcessor",
    },
}
VIDEO_CONFIGS = {
    "qwen2_5_vl": {"do_sample_frames": True, "fps": 2.0, "min_pixels": 3136, "max_pixels": 200704},
    "qwen3_vl": {
        "size": {"shortest_edge": 4096, "longest_edge": 25165824},
        "fps": 2,
        "do_sample_frames": True,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
    },
}


@pytest.fixture(scope="module")
def clip(tmp_path_factory):
    """8 frames of 240x320 at 4 fps."""
    path = tmp_path_factory.mktemp("clip") / "clip.mp4"
    ref.encode_video(path, ref.moving_frames(8, 240, 320, seed=3), 4)
    return path


def _folder(root, model_type: str, video: dict | None):
    MODELS[model_type][0]().save_pretrained(root)
    (root / "preprocessor_config.json").write_text(json.dumps(IMAGE_CONFIGS[model_type]))
    if video is not None:
        (root / "video_preprocessor_config.json").write_text(json.dumps(video))
    return root


def _transformers_grid(folder, model_type: str, clip) -> tuple[int, int, int]:
    settings, _ = BaseVideoProcessor.get_video_processor_dict(str(folder))
    _, cls, module = MODELS[model_type]
    vp = cls(**{k: v for k, v in settings.items() if not k.endswith("_type")})
    if vp.do_sample_frames:
        frames, meta = read_video_pyav(str(clip), sample_indices_fn=vp.sample_frames)
    else:
        frames, meta = read_video_pyav(
            str(clip), sample_indices_fn=lambda metadata, **_: np.arange(metadata.total_num_frames)
        )
    n, h, w, t = len(frames), meta.height, meta.width, vp.temporal_patch_size
    factor = vp.patch_size * vp.merge_size
    lo, hi = vp.size.shortest_edge, vp.size.longest_edge
    if model_type == "qwen3_vl":
        size = module.smart_resize(n, h, w, t, factor, lo, hi)
    else:
        size = module.smart_resize(h, w, factor, min_pixels=lo, max_pixels=hi)
    return (math.ceil(n / t), size[0] // vp.patch_size, size[1] // vp.patch_size)


def _ours(folder, clip, with_ids: bool = False):
    proc = mf.Processor.from_pretrained(folder)
    item = proc.video(str(clip), layout="compact-u8")
    if not with_ids:
        return item.grid_thw
    tok = proc.config.tokens
    ids = proc.expand_prompt([tok.vision_start, tok.video, tok.vision_end], [item]).input_ids
    return item.grid_thw, len(ids)


def test_qwen2_5_folder_without_video_config(tmp_path, clip):
    # No video config: transformers reads preprocessor_config.json's pixel limits, and the
    # Qwen2-VL video processor keeps every frame (do_sample_frames is off by default).
    folder = _folder(tmp_path, "qwen2_5_vl", None)
    assert _transformers_grid(folder, "qwen2_5_vl", clip) == (4, 18, 22)
    assert _ours(folder, clip, with_ids=True) == ((4, 18, 22), 398)


@pytest.mark.parametrize("model_type", ["qwen2_5_vl", "qwen3_vl"])
@pytest.mark.parametrize("with_video_config", [False, True])
def test_folder_video_settings_match_transformers(tmp_path, clip, model_type, with_video_config):
    video = VIDEO_CONFIGS[model_type] if with_video_config else None
    folder = _folder(tmp_path, model_type, video)
    assert _ours(folder, clip) == _transformers_grid(folder, model_type, clip)


def test_nested_processor_config_wins(tmp_path, clip):
    # transformers v5 saves every sub-processor in processor_config.json; it comes first.
    folder = _folder(tmp_path, "qwen2_5_vl", {"do_sample_frames": True, "fps": 2.0})
    nested = {"video_processor": {"do_sample_frames": False, "min_pixels": 3136}}
    (folder / "processor_config.json").write_text(json.dumps(nested))
    assert _ours(folder, clip) == _transformers_grid(folder, "qwen2_5_vl", clip)


def test_presets_keep_their_documented_sampling():
    for name in ("qwen2.5-vl", "qwen3-vl"):
        cfg = mf.Processor.for_model(name).config
        assert cfg.do_sample_frames and cfg.fps == 2.0 and cfg.num_frames is None
