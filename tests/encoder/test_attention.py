"""Packed attention against a per-sequence softmax(QK^T/sqrt(d))V written out in plain torch."""

from __future__ import annotations

import pytest
import torch

from mmferry.encoder import attention
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


def _qkv(lengths, seed=0):
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(sum(lengths), 3, 3, 8, generator=gen)
    return qkv.unbind(1)


@pytest.mark.parametrize(
    "lengths", [[5, 9, 9, 7], [16, 4, 4, 4, 12], [6, 0, 6, 3], [1, 2, 3, 4, 5]]
)
@pytest.mark.parametrize("fn", [attention.sdpa_varlen, attention.sdpa_block_diagonal])
def test_one_call_matches_per_sequence_formula(lengths, fn):
    q, k, v = _qkv(lengths)
    got = fn(q, k, v, varlen_batch(lengths))
    assert torch.allclose(got, _reference(q, k, v, [n for n in lengths if n]), atol=1e-5)


def test_mixed_lengths_make_one_sdpa_call(monkeypatch):
    calls = []
    real = attention.F.scaled_dot_product_attention
    monkeypatch.setattr(
        attention.F,
        "scaled_dot_product_attention",
        lambda *a, **kw: calls.append(1) or real(*a, **kw),
    )
    lengths = [5, 9, 9, 7, 6, 8]
    q, k, v = _qkv(lengths, seed=1)
    got = attention.sdpa_varlen(q, k, v, varlen_batch(lengths))
    assert len(calls) == 1
    assert torch.allclose(got, _reference(q, k, v, lengths), atol=1e-5)
    # One long sequence beside many short ones: padding would cost over PAD_COST_LIMIT times
    # the exact work, so each run of equal lengths is one call instead.
    calls.clear()
    lengths = [64, 4, 4, 4, 4]
    q, k, v = _qkv(lengths, seed=2)
    got = attention.sdpa_varlen(q, k, v, varlen_batch(lengths))
    assert len(calls) == 2
    assert torch.allclose(got, _reference(q, k, v, lengths), atol=1e-5)


def test_sequence_ids_skip_empty_sequences():
    cu = varlen_batch([2, 0, 3, 0]).cu_seqlens
    assert attention.sequence_ids(cu, 5).tolist() == [0, 0, 2, 2, 2]


@pytest.mark.parametrize("fn", [attention.sdpa_varlen, attention.sdpa_block_diagonal])
def test_one_call_runs_on_meta(fn):
    # On `meta` any read of a tensor's value raises: the row bookkeeping stays on the device.
    lengths = [5, 9, 9, 7]
    batch = varlen_batch(lengths).to(torch.device("meta"))
    q, k, v = (torch.empty(30, 3, 8, device="meta") for _ in range(3))
    assert fn(q, k, v, batch).shape == (30, 24)
