"""Packed attention against a per-sequence softmax(QK^T/sqrt(d))V written out in plain torch."""

from __future__ import annotations

import pytest
import torch

from mmferry.encoder.attention import get_attention, varlen_batch


def _reference(q, k, v, lengths):
    out, start = [], 0
    for n in lengths:
        qs, ks, vs = (x[start : start + n].transpose(0, 1).double() for x in (q, k, v))
        p = torch.softmax(qs @ ks.transpose(1, 2) / qs.shape[-1] ** 0.5, dim=-1)
        out.append((p @ vs).transpose(0, 1).reshape(n, -1))
        start += n
    return torch.cat(out).float()


@pytest.mark.parametrize("lengths", [[7], [5, 5, 5], [3, 8, 8, 2, 2, 2, 9]])
def test_sdpa_varlen_matches_formula(lengths):
    gen = torch.Generator().manual_seed(0)
    n, h, d = sum(lengths), 3, 8
    qkv = torch.randn(n, 3, h, d, generator=gen)
    q, k, v = qkv.unbind(1)  # strided views, as the towers pass them
    got = get_attention("sdpa", torch.device("cpu"))(q, k, v, varlen_batch(lengths))
    assert got.shape == (n, h * d)
    assert torch.allclose(got, _reference(q, k, v, lengths), atol=1e-5)


def test_runs_group_equal_neighbours():
    b = varlen_batch([4, 4, 6, 4, 4, 4])
    assert b.runs == ((0, 2, 4), (8, 1, 6), (14, 3, 4))
    assert b.cu_seqlens.tolist() == [0, 4, 8, 14, 18, 22, 26]
    assert (b.max_seqlen, b.total) == (6, 26)


def test_flash_attn_needs_cuda():
    with pytest.raises(ValueError, match="CUDA"):
        get_attention("flash_attn", torch.device("cpu"))
