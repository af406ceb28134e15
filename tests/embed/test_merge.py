from __future__ import annotations

import pytest
import torch

from mmferry.embed.merge import merge_vision_embeddings
from mmferry.encoder.model import VisionOutput

H = 8
# An image span and a two-frame video (one span per frame, timestamp text between them).
OFFSETS = [[(3, 7)], [(10, 12), (14, 16)]]
L = 20


def _outputs(levels: int, seed: int = 0) -> list[VisionOutput]:
    g = torch.Generator().manual_seed(seed)
    outs = []
    for spans in OFFSETS:
        n = sum(b - a for a, b in spans)
        outs.append(
            VisionOutput(
                torch.randn(n, H, generator=g),
                tuple(torch.randn(n, H, generator=g) for _ in range(levels)),
            )
        )
    return outs


def _reference(inputs: torch.Tensor, outs: list[VisionOutput]):
    """transformers' formula: a boolean placeholder mask and masked_scatter, in order."""
    mask = torch.zeros(L, dtype=torch.bool)
    for spans in OFFSETS:
        for a, b in spans:
            mask[a:b] = True
    emb = torch.cat([o.embeds for o in outs])
    merged = inputs.masked_scatter(mask[:, None].expand_as(inputs), emb)
    deep = []
    for lvl in range(len(outs[0].deepstack)):
        buf = torch.zeros_like(inputs)
        buf[mask] = torch.cat([o.deepstack[lvl] for o in outs])
        deep.append(buf)
    return merged, deep


@pytest.mark.parametrize("levels", [0, 3])
def test_merge_equals_masked_scatter(levels):
    inputs = torch.randn(L, H)
    outs = _outputs(levels)
    got = merge_vision_embeddings(inputs, OFFSETS, outs)
    ref, ref_deep = _reference(inputs, outs)
    assert torch.equal(got.inputs_embeds, ref)
    assert len(got.deepstack) == levels
    for a, b in zip(got.deepstack, ref_deep):
        assert torch.equal(a, b)
    assert not torch.equal(inputs, got.inputs_embeds)  # input left untouched


@pytest.mark.parametrize("chunk", [1, 3, 5, 7, 20])
def test_chunked_prefill_equals_whole_prompt(chunk):
    inputs = torch.randn(L, H)
    outs = _outputs(2)
    whole = merge_vision_embeddings(inputs, OFFSETS, outs)
    parts = [
        merge_vision_embeddings(inputs[s : s + chunk], OFFSETS, outs, chunk_start=s)
        for s in range(0, L, chunk)
    ]
    assert torch.equal(torch.cat([p.inputs_embeds for p in parts]), whole.inputs_embeds)
    for lvl in range(2):
        got = torch.cat([p.deepstack[lvl] for p in parts])
        assert torch.equal(got, whole.deepstack[lvl])


def test_length_mismatch_is_an_error_not_a_trim():
    outs = _outputs(1)
    outs[0] = VisionOutput(torch.zeros(5, H), (torch.zeros(5, H),))
    with pytest.raises(ValueError, match="item 0: embeds has shape"):
        merge_vision_embeddings(torch.zeros(L, H), OFFSETS, outs)
    with pytest.raises(ValueError, match="2 items in the prompt but 1"):
        merge_vision_embeddings(torch.zeros(L, H), OFFSETS, outs[:1])


def test_merge_runs_on_meta_without_sync():
    outs = [
        VisionOutput(o.embeds.to("meta"), tuple(d.to("meta") for d in o.deepstack))
        for o in _outputs(2)
    ]
    got = merge_vision_embeddings(torch.empty(L, H, device="meta"), OFFSETS, outs)
    assert got.inputs_embeds.device.type == "meta" and len(got.deepstack) == 2


@pytest.mark.parametrize(
    "offsets, match",
    [
        ([[(3, 7)], [(18, 22)]], "outside the prompt"),  # runs past the 20 tokens
        ([[(3, 7)], [(30, 34)]], "outside the prompt"),  # wholly past: used to vanish
        ([[(-2, 2)], [(10, 12), (14, 16)]], "outside the prompt"),  # negative: partial write
        ([[(3, 7)], [(5, 7), (14, 16)]], "overlap"),  # overwrites item 0
        ([[(7, 3)], [(10, 12), (14, 16)]], "empty or reversed"),
    ],
)
def test_bad_spans_are_errors(offsets, match):
    outs = [
        VisionOutput(torch.zeros(max(0, sum(b - a for a, b in s)), H), (torch.zeros(4, H),))
        for s in offsets
    ]
    with pytest.raises(ValueError, match=match):
        merge_vision_embeddings(torch.zeros(L, H), offsets, outs)


def test_chunk_spans_are_checked_against_the_prompt_length():
    outs = _outputs(1)
    # A later chunk's items are fine while chunking...
    merge_vision_embeddings(torch.zeros(5, H), OFFSETS, outs, chunk_start=0)
    # ...but not when they run past the whole prompt.
    with pytest.raises(ValueError, match="outside the prompt"):
        merge_vision_embeddings(torch.zeros(5, H), OFFSETS, outs, chunk_start=0, prompt_len=15)
