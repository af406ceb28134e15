from __future__ import annotations

import dataclasses
import json
import pickle

import pytest
import torch
import transformers

import mmferry as mf
from mmferry.models import PRESETS, SUPPORTED_MODEL_TYPES, load_model_config, spec_for


def _save(cfg, tmp_path):
    cfg.save_pretrained(tmp_path)
    return tmp_path


def test_qwen3_vl_config_from_saved_checkpoint(tmp_path):
    vision = dict(
        depth=4,
        hidden_size=64,
        intermediate_size=128,
        num_heads=4,
        out_hidden_size=96,
        deepstack_visual_indexes=[1, 2],
        num_position_embeddings=64,
    )
    cfg = transformers.Qwen3VLConfig(vision_config=vision, text_config=dict(hidden_size=96))
    mc = load_model_config(_save(cfg, tmp_path))
    assert mc.family == "qwen3_vl"
    v = mc.vision
    assert (v.depth, v.hidden_size, v.intermediate_size, v.num_heads) == (4, 64, 128, 4)
    assert v.out_hidden_size == 96 and v.deepstack_visual_indexes == (1, 2)
    assert v.num_position_embeddings == 64 and v.patch_size == 16
    assert mc.tokens == mf.TokenIds(151655, 151656, 151652, 151653)
    assert mc.processor.factor == 32 and mc.text_hidden_size == 96


def test_qwen2_5_vl_config_names_are_translated(tmp_path):
    vision = dict(
        depth=3,
        hidden_size=32,
        intermediate_size=48,
        num_heads=2,
        out_hidden_size=40,
        fullatt_block_indexes=[2],
        window_size=56,
        tokens_per_second=2,
    )
    cfg = transformers.Qwen2_5_VLConfig(vision_config=vision)
    mc = load_model_config(_save(cfg, tmp_path))
    v = mc.vision
    assert mc.family == "qwen2_5_vl" and v.fullatt_block_indexes == (2,)
    assert v.window_size == 56 and v.out_hidden_size == 40 and v.patch_size == 14
    assert mc.processor.tokens_per_second == 2 and mc.processor.factor == 28


def test_qwen2_vl_embed_dim_is_the_tower_width(tmp_path):
    vision = dict(depth=2, embed_dim=32, hidden_size=80, num_heads=2, mlp_ratio=4)
    mc = load_model_config(_save(transformers.Qwen2VLConfig(vision_config=vision), tmp_path))
    assert (mc.vision.hidden_size, mc.vision.out_hidden_size) == (32, 80)
    assert mc.vision.intermediate_size == 128


def test_qwen3_5_has_its_own_token_ids_and_no_deepstack(tmp_path):
    cfg = transformers.Qwen3_5Config()
    mc = load_model_config(_save(cfg, tmp_path))
    assert mc.family == "qwen3_vl" and mc.vision.deepstack_visual_indexes == ()
    assert mc.tokens.image == cfg.image_token_id == 248056


def test_preprocessor_configs_are_read(tmp_path):
    _save(transformers.Qwen3VLConfig(), tmp_path)
    (tmp_path / "preprocessor_config.json").write_text(
        json.dumps(
            {"size": {"shortest_edge": 1024, "longest_edge": 2048}, "image_mean": [0.1, 0.2, 0.3]}
        )
    )
    (tmp_path / "video_preprocessor_config.json").write_text(
        json.dumps(
            {"size": {"shortest_edge": 512, "longest_edge": 4096}, "fps": 1, "max_frames": 64}
        )
    )
    p = load_model_config(tmp_path).processor
    assert (p.image_min_pixels, p.image_max_pixels, p.image_mean) == (1024, 2048, (0.1, 0.2, 0.3))
    assert (p.video_min_pixels, p.video_max_pixels, p.fps, p.max_frames) == (512, 4096, 1, 64)
    assert mf.Processor.from_pretrained(tmp_path).config == p


def test_unsupported_model_type_lists_supported(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llava"}))
    with pytest.raises(ValueError) as e:
        load_model_config(tmp_path)
    for name in SUPPORTED_MODEL_TYPES:
        assert name in str(e.value)


def test_presets_match_public_checkpoint_defaults():
    q3 = PRESETS["qwen3-vl"]
    assert (q3.image_min_pixels, q3.image_max_pixels) == (65536, 16777216)
    assert (q3.video_min_pixels, q3.video_max_pixels) == (4096, 25165824)
    assert q3.image_mean == q3.image_std == (0.5, 0.5, 0.5)
    q2 = PRESETS["qwen2.5-vl"]
    assert (q2.image_min_pixels, q2.image_max_pixels, q2.factor) == (3136, 12845056, 28)
    assert (q2.video_min_pixels, q2.video_max_pixels) == (128 * 28 * 28, 768 * 28 * 28)
    assert q2.image_mean == tuple(transformers.Qwen2VLImageProcessorPil.image_mean)
    with pytest.raises(TypeError, match="unknown processor setting"):
        mf.Processor.for_model("qwen3-vl", max_pixel=5)
    with pytest.raises(ValueError, match="presets"):
        mf.Processor.for_model("llava")


def test_item_invariants():
    f = torch.zeros(16, 1536)
    item = mf.MultimodalItem("image", f, (1, 4, 4), "hf", "0" * 32)
    assert item.num_tokens == 4
    with pytest.raises(ValueError, match="patch rows"):
        mf.MultimodalItem("image", f, (1, 4, 6), "hf", "0" * 32)
    with pytest.raises(ValueError, match="uint8"):
        mf.MultimodalItem("image", f, (1, 4, 4), "compact-u8", "0" * 32)


def test_with_depth_keeps_the_taps_in_range():
    """A tower cut to its first layers keeps a deepstack tap and a full-attention block inside
    them (each clamped to the last layer kept), and is the same tower when not cut."""
    qwen3 = spec_for("qwen3-vl").random_config
    assert qwen3.deepstack_visual_indexes and min(qwen3.deepstack_visual_indexes) >= 2
    cut = qwen3.with_depth(2)
    assert (cut.depth, cut.deepstack_visual_indexes) == (2, (1,))
    assert qwen3.with_depth(qwen3.depth) is qwen3 and qwen3.with_depth(99) is qwen3
    windowed = spec_for("qwen2.5-vl").random_config
    assert windowed.with_depth(3).fullatt_block_indexes == (2,)
    with pytest.raises(ValueError, match="at least 1"):
        qwen3.with_depth(0)


def test_a_settings_fingerprint_is_every_setting_and_a_replaced_one_its_own():
    from mmferry.config import ProcessorConfig

    cfg = ProcessorConfig(family="qwen2_vl", patch_size=14)
    first = cfg.fingerprint()
    assert first == json.dumps(dataclasses.asdict(cfg), sort_keys=True).encode()
    assert cfg.fingerprint() is first  # made once
    other = cfg.replace(image_min_pixels=cfg.image_min_pixels * 4)
    assert json.loads(other.fingerprint())["image_min_pixels"] == cfg.image_min_pixels * 4
    assert other == cfg.replace(
        image_min_pixels=cfg.image_min_pixels * 4
    )  # the kept bytes are no field
    assert pickle.loads(pickle.dumps(cfg)).fingerprint() == first
