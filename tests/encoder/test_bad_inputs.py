"""Bad grids and bad checkpoints are clear `ValueError`s, raised before any allocation."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from mmferry.encoder import metadata
from mmferry.encoder.model import VisionEncoder
from mmferry.models import load_model_config, spec_for

TINY = spec_for("qwen3_vl").tiny_config
WIDTH = TINY.in_channels * TINY.temporal_patch_size * TINY.patch_size**2


@pytest.fixture(scope="module")
def enc():
    return VisionEncoder.random(config=TINY, seed=0)


@pytest.mark.parametrize(
    "grids, match",
    [
        ([(1, 0, 4)], "positive"),
        ([(0, 4, 4)], "positive"),
        ([(1, -2, 2), (1, 2, 4)], "positive"),  # rows add up to a valid count
        ([(1, 3, 4)], "multiples of the merge size"),
        ([(1.5, 4, 4)], "integers"),
        ([(1, 4.0, 4)], "integers"),
        ([(1, 4)], "three"),
    ],
)
def test_forward_packed_refuses_bad_grids(enc, grids, match):
    rows = 16
    with pytest.raises(ValueError, match=match):
        enc.forward_packed(torch.zeros(rows, WIDTH), grids)


def test_forward_packed_huge_grid_fails_on_rows_not_memory(enc):
    # One frame of 2^17 x 2^17 patches would need terabytes; the row check comes first.
    with pytest.raises(ValueError, match="patch rows"):
        enc.forward_packed(torch.zeros(16, WIDTH), [(1, 1 << 17, 1 << 17)])


def test_grid_metadata_cache_is_bounded_in_bytes():
    metadata.clear_caches()
    # 11 frame shapes of 300 x 300 to 400 x 400 patches: about 90 MB uncapped.
    for side in range(300, 410, 10):
        metadata.build_metadata([(1, side, side)], merge=2, head_dim=16, position_side=16)
    assert 0 < metadata.cache_bytes() <= metadata.CACHE_BYTES


# -- checkpoints ----------------------------------------------------------------------------


@pytest.fixture
def ckpt(qwen3_ckpt, tmp_path):
    path = tmp_path / "ckpt"
    shutil.copytree(qwen3_ckpt[0], path)
    return path


def test_truncated_safetensors_names_the_file(ckpt):
    f = ckpt / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-1000])
    with pytest.raises(ValueError, match="model.safetensors"):
        VisionEncoder.from_pretrained(ckpt)


def test_index_without_weight_map(ckpt):
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}}))
    with pytest.raises(ValueError, match=r"index\.json.*weight_map"):
        VisionEncoder.from_pretrained(ckpt)


@pytest.mark.parametrize("shard", ["/etc/passwd", "../outside.safetensors"])
def test_shard_paths_stay_inside_the_folder(ckpt, shard):
    index = {"weight_map": {"model.visual.pos_embed.weight": shard}}
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="outside"):
        VisionEncoder.from_pretrained(ckpt)


def test_config_that_is_a_list(tmp_path):
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="config.json"):
        load_model_config(tmp_path)


def test_zero_heads_names_file_and_field(ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["vision_config"]["num_heads"] = 0
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"config\.json.*num_heads"):
        load_model_config(ckpt)


def test_integer_weights_are_refused(ckpt):
    from safetensors.torch import load_file, save_file

    f = ckpt / "model.safetensors"
    tensors = load_file(f)
    key = "model.visual.blocks.0.attn.qkv.weight"
    tensors[key] = tensors[key].to(torch.int32)
    save_file(tensors, f, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.safetensors.*qkv\.weight"):
        VisionEncoder.from_pretrained(ckpt)
