"""Checkpoint loading: prefixes, shards and key errors (every model type: tests/models)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from mmferry.encoder.loader import iter_vision_tensors
from mmferry.encoder.model import VisionEncoder
from mmferry.items import MultimodalItem
from mmferry.models import spec_for
from mmferry.testing.checkpoints import save_tiny_checkpoint

GRIDS = [(1, 4, 6), (1, 8, 8), (2, 4, 4)]


def _check_against(enc, ref_model, seed=0):
    gen = torch.Generator().manual_seed(seed)
    feats = [torch.randn(t * h * w, 1536, generator=gen) for t, h, w in GRIDS]
    items = [
        MultimodalItem("image" if g[0] == 1 else "video", f, g, "hf", "x")
        for f, g in zip(feats, GRIDS)
    ]
    outs = enc(items)
    with torch.no_grad():
        ref = ref_model(torch.cat(feats), grid_thw=torch.tensor(GRIDS))
    sizes = [t * h * w // 4 for t, h, w in GRIDS]
    for out, want in zip(outs, ref.pooler_output.split(sizes)):
        assert (out.embeds - want).abs().max().item() < 1e-4
    ref_ds = getattr(ref, "deepstack_features", None) or []
    assert enc.num_deepstack == len(ref_ds)
    for j, tap in enumerate(ref_ds):
        for out, want in zip(outs, tap.split(sizes)):
            assert (out.deepstack[j] - want).abs().max().item() < 1e-4


def _rewrite(src, dst, edit):
    for f in src.iterdir():
        if f.suffix == ".json":
            (dst / f.name).write_text(f.read_text())
    tensors = load_file(src / "model.safetensors")
    edit(tensors)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def test_missing_key_is_named(qwen3_ckpt, tmp_path):
    path = _rewrite(qwen3_ckpt[0], tmp_path, lambda t: t.pop("model.visual.blocks.1.norm2.bias"))
    with pytest.raises(ValueError, match=r"missing vision keys: blocks\.1\.norm2\.bias"):
        VisionEncoder.from_pretrained(path)


def test_unexpected_key_is_named(qwen3_ckpt, tmp_path):
    def add(t):
        t["model.visual.blocks.7.attn.qkv.weight"] = torch.zeros(2, 2)

    path = _rewrite(qwen3_ckpt[0], tmp_path, add)
    with pytest.raises(ValueError, match=r"unexpected vision keys: blocks\.7\.attn\.qkv\.weight"):
        VisionEncoder.from_pretrained(path)


def test_legacy_visual_prefix_loads(qwen3_ckpt, tmp_path):
    # Original Qwen2/2.5-VL releases store the tower under `visual.` rather than `model.visual.`.
    def strip(t):
        for k in [k for k in t if k.startswith("model.visual.")]:
            t[k[len("model.") :]] = t.pop(k)

    path = _rewrite(qwen3_ckpt[0], tmp_path, strip)
    _check_against(VisionEncoder.from_pretrained(path), qwen3_ckpt[1])


def test_sharded_checkpoint_reads_only_vision_shards(tmp_path):
    path, ref_model = save_tiny_checkpoint("qwen3_vl", tmp_path, max_shard_size="40KB")
    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    shards = set(index.values())
    vision_shards = {f for k, f in index.items() if k.startswith("model.visual.")}
    assert len(vision_shards) > 1
    text_only = shards - vision_shards
    assert text_only, "the tiny checkpoint should have language-only shards"
    for name in text_only:  # a loader that opened these would fail
        (path / name).write_bytes(b"not a safetensors file")
    _check_against(VisionEncoder.from_pretrained(path), ref_model, seed=1)
    keys = [
        k
        for k, _ in iter_vision_tensors(
            path, spec_for("qwen3_vl"), device=torch.device("cpu"), dtype=torch.float32
        )
    ]
    assert len(keys) == sum(k.startswith("model.visual.") for k in index)
