"""The tower FLOP count against torch's own FLOP counter and a closed form written out."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from mmferry.encoder.flops import bf16_peak, tower_flops, utilisation
from mmferry.encoder.model import VisionEncoder
from mmferry.models import spec_for


def _explicit_attention(q, k, v, batch):
    """softmax(q k^T / sqrt d) v per sequence with plain matmuls, which the counter sees."""
    out, start = [], 0
    for n in batch.cu_seqlens.diff().tolist():
        qs, ks, vs = (x[start : start + n].transpose(0, 1) for x in (q, k, v))  # [H, n, d]
        p = torch.softmax(qs @ ks.transpose(1, 2) / qs.shape[-1] ** 0.5, dim=-1)
        out.append((p @ vs).transpose(0, 1).reshape(n, -1))
        start += n
    return torch.cat(out)


@pytest.mark.parametrize("model", ["qwen3-vl", "qwen2.5-vl", "qwen2-vl", "qwen3.5"])
def test_count_equals_torch_flop_counter(model):
    cfg = spec_for(model).tiny_config
    enc = VisionEncoder.random(config=cfg)
    grids = [(1, 8, 12), (1, 6, 6), (2, 4, 8)]
    cols = cfg.in_channels * cfg.temporal_patch_size * cfg.patch_size**2
    x = torch.randn(sum(t * h * w for t, h, w in grids), cols)
    meta = enc.tower.metadata(grids)
    with FlopCounterMode(display=False) as counter, torch.inference_mode():
        enc.tower([(("hf", None), x)], meta, _explicit_attention)
    assert tower_flops(cfg, grids) == counter.get_total_flops()


def test_qwen3_vl_2b_448_image_closed_form():
    # One 448x448 image through the Qwen3-VL-2B tower: 28 x 28 = 784 patches of 16 px.
    n, d, i, out, layers, taps = 784, 1024, 4096, 2048, 24, 3
    embed = 2 * n * (3 * 2 * 16 * 16) * d
    layer = 2 * n * d * (4 * d + 2 * i) + 4 * n * n * d
    merger = 2 * (n // 4) * (4 * d) * (4 * d + out)
    want = embed + layers * layer + (1 + taps) * merger
    assert tower_flops(spec_for("qwen3-vl").random_config, [(1, 28, 28)]) == want


def test_peaks_and_utilisation():
    assert bf16_peak("NVIDIA H100 80GB HBM3") == 989e12
    assert bf16_peak("NVIDIA H100 PCIe") == 756e12
    assert bf16_peak("NVIDIA H200") == 989e12
    assert bf16_peak("a CPU") is None
    assert utilisation(500e12, 1.0, 1000e12) == pytest.approx(0.5)
