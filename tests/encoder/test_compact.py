"""compact-u8 input (normalisation and the image T copy folded into the patch embedding)
against the same patches in HF layout, normalised and repeated here in plain torch."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from mmferry.encoder.model import VisionEncoder
from mmferry.items import MultimodalItem

IMAGE_MEAN, IMAGE_STD = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)
VIDEO_MEAN, VIDEO_STD = (0.3, 0.5, 0.7), (0.2, 0.25, 0.3)


def _normalise(u8: torch.Tensor, mean, std) -> torch.Tensor:
    """[N, C, ...] uint8 -> (x/255 - mean)/std in float32, per channel."""
    shape = (1, -1) + (1,) * (u8.dim() - 2)
    return (u8.float() / 255 - torch.tensor(mean).view(shape)) / torch.tensor(std).view(shape)


def _checkpoint_with_stats(src, dst):
    for f in src.iterdir():
        shutil.copy(f, dst / f.name)
    (dst / "preprocessor_config.json").write_text(
        json.dumps({"image_mean": IMAGE_MEAN, "image_std": IMAGE_STD, "patch_size": 16})
    )
    (dst / "video_preprocessor_config.json").write_text(
        json.dumps({"image_mean": VIDEO_MEAN, "image_std": VIDEO_STD})
    )
    return dst


def test_compact_u8_matches_hf_layout(qwen3_ckpt, tmp_path):
    path = _checkpoint_with_stats(qwen3_ckpt[0], tmp_path)
    enc = VisionEncoder.from_pretrained(path)
    gen = torch.Generator().manual_seed(0)
    c, t, p = 3, 2, 16
    image_grids = [(1, 4, 6), (1, 8, 8)]
    video_grid = (2, 6, 4)
    compact, hf = [], []
    for g in image_grids:
        n = g[0] * g[1] * g[2]
        u8 = torch.randint(0, 256, (n, c, p, p), generator=gen, dtype=torch.uint8)
        compact.append(MultimodalItem("image", u8.view(n, -1), g, "compact-u8", "c"))
        rows = _normalise(u8, IMAGE_MEAN, IMAGE_STD)[:, :, None].expand(n, c, t, p, p)
        hf.append(MultimodalItem("image", rows.reshape(n, -1), g, "hf", "h"))
    n = video_grid[0] * video_grid[1] * video_grid[2]
    u8 = torch.randint(0, 256, (n, c, t, p, p), generator=gen, dtype=torch.uint8)
    compact.append(MultimodalItem("video", u8.view(n, -1), video_grid, "compact-u8", "c"))
    rows = _normalise(u8, VIDEO_MEAN, VIDEO_STD)
    hf.append(MultimodalItem("video", rows.reshape(n, -1), video_grid, "hf", "h"))

    got = enc(compact)
    want = enc(hf)
    for a, b in zip(got, want):
        assert (a.embeds - b.embeds).abs().max().item() < 1e-4
        for x, y in zip(a.deepstack, b.deepstack):
            assert (x - y).abs().max().item() < 1e-4
    # Mixed layouts in one call give the same rows, in input order.
    mixed = enc([hf[0], compact[1], compact[2], hf[1]])
    assert (mixed[1].embeds - want[1].embeds).abs().max().item() < 1e-4
    assert (mixed[3].embeds - want[1].embeds).abs().max().item() < 1e-4
    # forward_packed tells compact images from videos by width.
    packed = enc.forward_packed(
        torch.cat([x.feature for x in compact[:2]]), image_grids, layout="compact-u8"
    )
    assert (packed[1].embeds - want[1].embeds).abs().max().item() < 1e-4


def test_compact_u8_rejects_wrong_width(qwen3_ckpt):
    enc = VisionEncoder.from_pretrained(qwen3_ckpt[0])
    bad = MultimodalItem(
        "image", torch.zeros(24, 1536, dtype=torch.uint8), (1, 4, 6), "compact-u8", "x"
    )
    with pytest.raises(ValueError, match="768"):
        enc([bad])
