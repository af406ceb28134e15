"""The prefill step against plain-torch formulas: a device mask, masked_scatter, dense buffers."""

from __future__ import annotations

import pytest
import torch

from mmferry.embed.cache import EncoderCache
from mmferry.embed.step import Precomputed, StepRequest, prefill_step
from mmferry.encoder.model import VisionEncoder
from mmferry.items import MultimodalItem
from mmferry.models import preset
from mmferry.prompt.expand import expand_prompt
from mmferry.prompt.mrope import decode_positions
from mmferry.testing.checkpoints import small_patch_qwen3

TINY = small_patch_qwen3()
CFG = preset("qwen2.5-vl").replace(patch_size=4)  # one span per video: no tokenizer needed
TOK = CFG.tokens
VOCAB = TOK.video + 1


@pytest.fixture(scope="module")
def enc():
    return VisionEncoder.random(config=TINY, seed=5)


def _item(modality, grid, seed, layout="compact-u8"):
    t, h, w = grid
    g = torch.Generator().manual_seed(seed)
    width = 3 * 4 * 4 * (1 if modality == "image" else 2)
    feat = torch.randint(0, 256, (t * h * w, width), generator=g, dtype=torch.uint8)
    if layout == "hf":  # the same pixels normalised with the tower's mean/std 0.5, T copies
        rows = t * h * w
        feat = feat.view(rows, 3, -1, 16).expand(rows, 3, 2, 16).reshape(rows, -1) / 127.5 - 1
    return MultimodalItem(modality, feat, grid, layout, f"{modality}{seed:028x}")


def _request(items, text=3):
    ids = []
    for k, it in enumerate(items):
        ids += [100 + k] * text + [TOK.vision_start]
        ids += [TOK.image if it.modality == "image" else TOK.video, TOK.vision_end]
    ids += [7] * text
    return expand_prompt(ids, items, CFG)


def _counting(enc):
    calls = []

    def encode(items):
        calls.append(len(items))
        return enc(items)

    encode.num_deepstack = enc.num_deepstack  # what the step reads from an encoder object
    return encode, calls


def _reference(prompt, outs, table):
    """Whole prompt: device-side mask of pad ids, masked_scatter, dense deepstack gathered."""
    ids = torch.tensor(prompt.input_ids)
    mask = torch.isin(ids, torch.tensor([TOK.image, TOK.video]))
    emb = table[ids].masked_scatter(mask[:, None], torch.cat([o.embeds for o in outs]))
    deep = [torch.cat([o.deepstack[k] for o in outs]) for k in range(len(outs[0].deepstack))]
    types = torch.where(ids == TOK.image, 1, 0) + torch.where(ids == TOK.video, 2, 0)
    return emb, mask, deep, types


@pytest.fixture(scope="module")
def batch():
    a = [_item("image", (1, 4, 6), 1), _item("video", (2, 4, 4), 2), _item("image", (1, 6, 2), 3)]
    b = [_item("video", (4, 2, 4), 4), _item("image", (1, 4, 6), 1, "hf")]  # repeat, other layout
    return [(_request(a), a), (_request(b), b)]


@pytest.mark.parametrize("chunk", [5, 11, 64])
def test_chunked_steps_equal_the_reference(enc, batch, chunk):
    table = torch.randn(VOCAB, 16)
    cache = EncoderCache(1 << 20)
    encode, calls = _counting(enc)
    got = {r: [] for r in range(len(batch))}
    starts = [0] * len(batch)
    while any(s < len(p.input_ids) for s, (p, _) in zip(starts, batch)):
        reqs, who = [], []
        for r, ((p, items), s) in enumerate(zip(batch, starts)):
            if s < len(p.input_ids):
                e = min(s + chunk, len(p.input_ids))
                reqs.append(StepRequest(p, items, s, e))
                who.append(r)
                starts[r] = e
        out = prefill_step(reqs, embed_tokens=table, encoder=encode, cache=cache)
        n = out.cu_seqlens[-1]
        assert out.inputs_embeds.shape == (n, 16) and out.positions.shape == (3, n)
        assert torch.equal(out.vision_mask.nonzero()[:, 0], out.vision_index)
        for level in out.deepstack:
            assert level.shape == (len(out.vision_index), 16)  # vision rows only
        for k, r in enumerate(who):
            a, b = out.cu_seqlens[k], out.cu_seqlens[k + 1]
            m = out.vision_mask[a:b]
            vi = out.vision_index
            pick = ((vi >= a) & (vi < b)).nonzero()[:, 0]  # this request's vision rows
            got[r].append(
                (
                    out.inputs_embeds[a:b],
                    out.positions[:, a:b],
                    m,
                    [d[pick] for d in out.deepstack],
                    out.mm_token_type_ids[a:b],
                )
            )
    # Every distinct item encoded exactly once over all steps; the repeat in both layouts too.
    assert sum(calls) == 4
    for r, (prompt, items) in enumerate(batch):
        emb, mask, deep, types = _reference(prompt, enc(items), table)
        parts = got[r]
        assert torch.allclose(torch.cat([p[0] for p in parts]), emb, atol=1e-6)
        assert torch.equal(torch.cat([p[1] for p in parts], 1), prompt.positions)
        assert torch.equal(torch.cat([p[2] for p in parts]), mask)
        for k in range(2):
            assert torch.allclose(torch.cat([p[3][k] for p in parts]), deep[k], atol=1e-6)
        assert torch.equal(torch.cat([p[4] for p in parts]).long(), types)


def test_batch_dedups_across_requests_and_layouts_in_one_call(enc, batch):
    encode, calls = _counting(enc)
    reqs = [StepRequest(p, items, 0, len(p.input_ids)) for p, items in batch]
    out = prefill_step(reqs, embed_tokens=torch.randn(VOCAB, 16), encoder=encode)
    assert calls == [4] and out.encoded == 4  # 5 items, one repeated: one call, images+videos


def test_precomputed_outputs_stand_in_for_items(enc, batch):
    prompt, items = batch[0]
    table = torch.randn(VOCAB, 16)
    outs = enc(items)
    pre = [Precomputed(it.modality, o) for it, o in zip(items, outs)]
    encode, calls = _counting(enc)
    got = prefill_step(
        [StepRequest(prompt, pre, 0, len(prompt.input_ids))], embed_tokens=table, encoder=encode
    )
    emb, *_ = _reference(prompt, outs, table)
    assert calls == [] and torch.equal(got.inputs_embeds, emb)
    short = [pre[0], Precomputed("video", outs[0]), pre[2]]  # wrong row count for item 1
    with pytest.raises(ValueError, match="item 1: vision rows of shape"):
        prefill_step([StepRequest(prompt, short, 0, 30)], embed_tokens=table)


def test_a_cache_hit_of_the_wrong_length_is_reencoded(enc, batch):
    prompt, items = batch[0]
    cache = EncoderCache(1 << 20)
    wrong = enc([items[2]])[0]
    cache.put(items[0].hash, wrong)  # a stale entry under item 0's hash with 3 rows, not 6
    encode, calls = _counting(enc)
    reqs = [StepRequest(prompt, items, 0, len(prompt.input_ids))]
    prefill_step(reqs, embed_tokens=torch.randn(VOCAB, 16), encoder=encode, cache=cache)
    assert calls == [3] and cache.length_mismatches == 1


def test_the_step_asks_the_device_nothing(batch):
    """On `meta` every data-dependent read (.item(), mask indexing, nonzero) raises."""
    enc = VisionEncoder.random(config=TINY, device="meta")
    embed = torch.nn.Embedding(VOCAB, 16, device="meta")
    cache = EncoderCache(1 << 20)
    for s, e in [(0, 9), (9, 30), (30, 10**9)]:
        reqs = [
            StepRequest(p, it, min(s, len(p.input_ids)), min(e, len(p.input_ids)))
            for p, it in batch
        ]
        out = prefill_step(reqs, embed_tokens=embed, encoder=enc, cache=cache)
        assert out.inputs_embeds.device.type == "meta" and out.vision_index.device.type == "meta"
        assert len(out.deepstack) == 2
    with pytest.raises((NotImplementedError, RuntimeError)):
        out.vision_mask.nonzero()  # the check itself can fail: meta refuses data questions


def test_bad_ranges_and_item_counts_are_errors(batch):
    prompt, items = batch[0]
    with pytest.raises(ValueError, match="at least one request"):
        prefill_step([], embed_tokens=torch.zeros(VOCAB, 16))
    with pytest.raises(ValueError, match="not inside the prompt"):
        StepRequest(prompt, items, 5, len(prompt.input_ids) + 1)
    with pytest.raises(ValueError, match="2 items given but the prompt has 3"):
        StepRequest(prompt, items[:2], 0, 4)


def test_decode_positions_continue_after_the_prompt(batch):
    prompt, _ = batch[0]
    L, delta = len(prompt.input_ids), prompt.mrope_delta
    assert delta != 0
    pos = decode_positions([L, L + 3], [delta, delta])
    assert pos.shape == (3, 2)
    # The prompt's next text position is its largest position + 1 (the delta's definition).
    assert pos[:, 0].tolist() == [int(prompt.positions.max()) + 1] * 3
    assert pos[:, 1].tolist() == [int(prompt.positions.max()) + 4] * 3
    dev = decode_positions(torch.tensor([L]), torch.tensor([delta]))
    assert torch.equal(dev, pos[:, :1])
