"""The whole path against transformers on tiny checkpoints: ids, positions, logits, decode.

Each check has a negative control that must fail the same comparison, so the test can fail.
"""

from __future__ import annotations

import pytest
import torch
from e2e_helpers import (
    advance,
    close,
    images,
    make_case,
    mmferry_items,
    run_mmferry,
    run_transformers,
    video_frames,
)

from mmferry.embed.cache import EncoderCache

FAMILIES = ["qwen3", "qwen2_5"]
CASES = {
    "odd_images": lambda: [("image", im) for im in images([(50, 70), (90, 41), (33, 97)])],
    "image_video": lambda: [("image", images([(61, 75)])[0]), ("video", video_frames(64, 96))],
    "video_repeated_image": lambda: (
        lambda im: [("image", im), ("video", video_frames(70, 50, seed=3)), ("image", im)]
    )(images([(45, 66)], seed=9)[0]),
}
_REFS: dict = {}


def _setup(tiny, case_name):
    key = (tiny.family, case_name)
    if key not in _REFS:
        case = make_case(tiny, CASES[case_name]())
        _REFS[key] = (case, run_transformers(tiny, case, new_tokens=4))
    return _REFS[key]


def _prompt(tiny, case, layouts):
    items = mmferry_items(tiny, case, layouts)
    return tiny.proc.expand_prompt(case.text_ids, items, mrope_advance=advance(tiny)), items


@pytest.mark.parametrize("case_name", CASES)
@pytest.mark.parametrize("family", FAMILIES)
def test_ids_and_positions_equal_transformers(family, case_name, request):
    tiny = request.getfixturevalue(family)
    case, _ = _setup(tiny, case_name)
    prompt, _ = _prompt(tiny, case, ["compact-u8"] * len(case.media))
    hf = case.hf_inputs
    assert prompt.input_ids == hf["input_ids"][0].tolist()
    kwargs = {
        k: hf[k] for k in ("image_grid_thw", "video_grid_thw", "second_per_grid_ts") if k in hf
    }
    pos, delta = tiny.model.model.get_rope_index(
        hf["input_ids"], mm_token_type_ids=hf["mm_token_type_ids"], **kwargs
    )
    assert torch.equal(prompt.positions, pos[:, 0]) and prompt.mrope_delta == int(delta)


@pytest.mark.parametrize("case_name", CASES)
@pytest.mark.parametrize("family", FAMILIES)
def test_logits_equal_transformers_for_each_layout_and_chunking(family, case_name, request):
    tiny = request.getfixturevalue(family)
    case, ref = _setup(tiny, case_name)
    n = len(case.media)
    L = case.hf_inputs["input_ids"].shape[1]
    # hf layout and compact-u8, the whole prompt in one step, then the decode steps.
    for layout in ("hf", "compact-u8"):
        prompt, items = _prompt(tiny, case, [layout] * n)
        got = run_mmferry(tiny, prompt, items, [L], new_tokens=4)
        assert got.tokens == ref.tokens and close(got.logits, ref.logits), layout
    # Mixed layouts through one cache: the second pass is served from the first's entries
    # (the same media in the other layout) and encodes nothing.
    cache = EncoderCache(1 << 24)
    mixed = [("hf", "compact-u8")[k % 2] for k in range(n)]
    flipped = [("compact-u8", "hf")[k % 2] for k in range(n)]
    run_mmferry(tiny, *_prompt(tiny, case, mixed), [L], new_tokens=1, cache=cache)
    misses = cache.misses
    got = run_mmferry(tiny, *_prompt(tiny, case, flipped), [L], new_tokens=4, cache=cache)
    assert cache.misses == misses and cache.hits > 0
    assert got.tokens == ref.tokens and close(got.logits, ref.logits)
    # Chunked prefill: four chunks, boundaries wherever they fall (through vision spans too).
    prompt, items = _prompt(tiny, case, ["compact-u8"] * n)
    bounds = [L // 4, L // 2, 3 * L // 4, L]
    got = run_mmferry(tiny, prompt, items, bounds, new_tokens=4)
    assert got.tokens == ref.tokens and close(got.logits, ref.logits)


def _text_positions(step):
    """Negative control: every token at its plain index, as if there were no vision."""
    n = step.positions.shape[1]
    start = int(step.positions[0, 0])  # the first chunk starts at 0
    plain = torch.arange(start, start + n).expand(3, n)
    return step.inputs_embeds, plain, step.vision_mask, step.deepstack


def _no_deepstack(step):
    return step.inputs_embeds, step.positions, step.vision_mask, ()


def _rows_reversed(step):
    emb = step.inputs_embeds.clone()
    idx = step.vision_index
    emb[idx] = emb[idx.flip(0)]
    deep = tuple(d.flip(0) for d in step.deepstack)
    return emb, step.positions, step.vision_mask, deep


@pytest.mark.parametrize(
    "family, tamper",
    [
        ("qwen3", _text_positions),
        ("qwen2_5", _text_positions),
        ("qwen3", _no_deepstack),
        ("qwen3", _rows_reversed),
        ("qwen2_5", _rows_reversed),
    ],
)
def test_negative_controls_fail_the_comparison(family, tamper, request):
    tiny = request.getfixturevalue(family)
    case, ref = _setup(tiny, "image_video")
    prompt, items = _prompt(tiny, case, ["compact-u8"] * len(case.media))
    L = len(prompt.input_ids)
    honest = run_mmferry(tiny, prompt, items, [L], new_tokens=4)
    assert close(honest.logits, ref.logits)
    broken = run_mmferry(tiny, prompt, items, [L], new_tokens=4, tamper=tamper)
    assert not close(broken.logits[:L], ref.logits[:L])
