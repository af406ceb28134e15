"""MiMo-VL loads on the native Qwen2.5-VL path.

MiMo-VL-7B's checkpoints declare `Qwen2_5_VLForConditionalGeneration` (its model card: "full
compatibility with the Qwen2_5_VLForConditionalGeneration architecture"): Qwen2.5-VL's vision
tower (32 blocks of width 1280, window attention with full attention at blocks 7/15/23/31)
projecting into MiMo-7B's 4096-wide language model, with Qwen's vision token ids. The
config.json below is written as those checkpoints spell it (transformers 4.x: text fields at the
top level, `rope_scaling` with `mrope_section`, `torch_dtype`); the tower's sizes are
Qwen2.5-VL-7B's, `out_hidden_size` the 4096 of MiMo-7B. transformers reading the same file
builds the oracle tower on `meta`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers

import mmferry as mf
from mmferry.models import spec_for
from mmferry.models.generic import uses_generic

MIMO_VL = {
    "architectures": ["Qwen2_5_VLForConditionalGeneration"],
    "model_type": "qwen2_5_vl",
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 11008,
    "max_position_embeddings": 65536,
    "max_window_layers": 36,
    "num_attention_heads": 32,
    "num_hidden_layers": 36,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
    "rope_theta": 640000,
    "sliding_window": 32768,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151680,
    "image_token_id": 151655,
    "video_token_id": 151656,
    "vision_start_token_id": 151652,
    "vision_end_token_id": 151653,
    "vision_token_id": 151654,
    "vision_config": {
        "depth": 32,
        "hidden_act": "silu",
        "hidden_size": 1280,
        "intermediate_size": 3420,
        "num_heads": 16,
        "in_chans": 3,
        "out_hidden_size": 4096,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "spatial_patch_size": 14,
        "temporal_patch_size": 2,
        "window_size": 112,
        "fullatt_block_indexes": [7, 15, 23, 31],
        "tokens_per_second": 2,
        "torch_dtype": "bfloat16",
    },
}
PREPROCESSOR = {
    "image_processor_type": "Qwen2VLImageProcessor",
    "processor_class": "Qwen2_5_VLProcessor",
    "min_pixels": 3136,
    "max_pixels": 12845056,
    "patch_size": 14,
    "merge_size": 2,
    "temporal_patch_size": 2,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
}


def _folder(tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(MIMO_VL))
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR))
    return tmp_path


def test_mimo_vl_config_loads_on_the_native_path(tmp_path):
    folder = _folder(tmp_path)
    assert not uses_generic(folder, None)
    mc = mf.load_model_config(folder)
    assert (mc.model_type, mc.family) == ("qwen2_5_vl", spec_for("qwen2.5-vl").family)
    v = mc.vision
    assert (v.depth, v.hidden_size, v.out_hidden_size) == (32, 1280, 4096)
    assert (v.window_size, v.fullatt_block_indexes) == (112, (7, 15, 23, 31))
    assert mc.text_hidden_size == 4096
    assert (mc.tokens.image, mc.tokens.video) == (151655, 151656)
    assert mc.processor.image_max_pixels == 12845056
    proc = mf.Processor.from_pretrained(folder)
    assert type(proc) is mf.Processor and proc.config.factor == 28


def test_mimo_vl_tower_has_transformers_shapes(tmp_path):
    folder = _folder(tmp_path)
    mc = mf.load_model_config(folder)
    with torch.device("meta"):
        ours = spec_for(mc.model_type).tower(mc.vision)
        config = transformers.AutoConfig.from_pretrained(folder)
        theirs = transformers.Qwen2_5_VLForConditionalGeneration(config).model.visual
    want = {k: tuple(t.shape) for k, t in theirs.state_dict().items()}
    got = {k: tuple(t.shape) for k, t in ours.state_dict().items()}
    assert got == want
