"""CUDA graphs per token budget: replays equal the eager tower (skipped without CUDA)."""

from __future__ import annotations

import pytest
import torch

from mmferry.encoder.model import VisionEncoder
from tests.encoder.test_batched import FAMILIES, items_for, max_diff

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need CUDA")


@pytest.mark.parametrize("fixture", list(FAMILIES))
def test_replays_equal_eager_for_every_family(fixture, request):
    path, _ = request.getfixturevalue(fixture)
    grids, cols = FAMILIES[fixture]
    eager = VisionEncoder.from_pretrained(path, device="cuda")
    graphs = VisionEncoder.from_pretrained(path, device="cuda", cuda_graphs=True)
    assert graphs.graph_memory() == {}
    # Two different mixes at the 1k budget: the second replay must read its own inputs.
    for seed, batch in ((0, grids), (1, grids[::-1][:2])):
        _, items = items_for(batch, cols, seed=seed)
        want, got = eager(items), graphs(items)
        for g, w in zip(got, want):
            assert g.embeds.shape == w.embeds.shape
            assert max_diff(g.embeds, w.embeds) < 1e-4
            assert all(max_diff(a, b) < 1e-4 for a, b in zip(g.deepstack, w.deepstack))
    memory = graphs.graph_memory()
    assert list(memory) == [1024] and memory[1024] > 0


def test_outputs_survive_the_next_replay(qwen3_ckpt):
    path, _ = qwen3_ckpt
    enc = VisionEncoder.from_pretrained(path, device="cuda", cuda_graphs=True)
    grids, cols = FAMILIES["qwen3_ckpt"]
    _, first = items_for(grids, cols, seed=2)
    _, second = items_for(grids, cols, seed=3)
    a = enc(first)
    kept = [o.embeds.clone() for o in a]
    enc(second)
    assert all(torch.equal(o.embeds, k) for o, k in zip(a, kept))


def test_memory_limit_refuses_the_capture_and_runs_eagerly(qwen2_5_ckpt):
    path, _ = qwen2_5_ckpt
    grids, cols = FAMILIES["qwen2_5_ckpt"]
    _, items = items_for(grids, cols, seed=4)
    want = VisionEncoder.from_pretrained(path, device="cuda")(items)
    enc = VisionEncoder.from_pretrained(path, device="cuda", cuda_graphs=True, graph_memory_limit=0)
    got = enc(items)
    assert enc.graph_memory() == {}
    assert all(max_diff(g.embeds, w.embeds) < 1e-4 for g, w in zip(got, want))


def test_bfloat16_graphs_match_eager_bfloat16(qwen3_ckpt):
    path, _ = qwen3_ckpt
    grids, cols = FAMILIES["qwen3_ckpt"]
    _, items = items_for(grids, cols, seed=5)
    kw = dict(device="cuda", dtype=torch.bfloat16)
    want = VisionEncoder.from_pretrained(path, **kw)(items)
    got = VisionEncoder.from_pretrained(path, cuda_graphs=True, **kw)(items)
    for g, w in zip(got, want):
        scale = w.embeds.float().abs().max().item()
        # Another attention kernel (block-diagonal mask) rounds differently in bfloat16.
        assert max_diff(g.embeds, w.embeds) < 0.02 * scale + 1e-2
