"""Greedy generation with transformers' language models fed only by mmferry equals `generate`."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
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


def _cuts(prompt) -> list[int]:
    """Three chunks: the first boundary inside the image, the second inside the video."""
    (img,) = prompt.offsets[0]
    vid = prompt.offsets[1]
    a = (img[0] + img[1]) // 2
    b = (vid[0][0] + vid[-1][1]) // 2
    inside = any(s < b < e for s, e in vid)
    if not inside:  # Qwen3-VL frames have timestamp text between them: cut the last frame
        s, e = vid[-1]
        b = (s + e) // 2
    assert img[0] < a < img[1] and any(s < b < e for s, e in vid)
    return [a, b, len(prompt.input_ids)]


@pytest.mark.parametrize("family", ["qwen3", "qwen2_5"])
def test_generation_equals_transformers(family, request):
    tiny = request.getfixturevalue(family)
    media = [("image", images([(70, 45)])[0]), ("video", video_frames(64, 96))]
    case = make_case(tiny, media, "what happens ?")
    items = mmferry_items(tiny, case, ["compact-u8", "compact-u8"])
    prompt = tiny.proc.expand_prompt(case.text_ids, items, mrope_advance=advance(tiny))
    assert prompt.input_ids == case.hf_inputs["input_ids"][0].tolist()
    ref = run_transformers(tiny, case, new_tokens=16)
    whole = run_mmferry(tiny, prompt, items, [len(prompt.input_ids)], new_tokens=16)
    cuts = _cuts(prompt)
    chunked = run_mmferry(tiny, prompt, items, cuts, new_tokens=16)
    assert len(ref.tokens) == 16
    assert whole.tokens == ref.tokens
    assert chunked.tokens == ref.tokens
    assert close(whole.logits, ref.logits) and close(chunked.logits, ref.logits)
    # The example's loop, chunked every 7 tokens, gives the same tokens.
    example = _load_example()
    tokens = example.greedy_generate(
        tiny.model,
        tiny.proc,
        tiny.enc,
        case.text_ids,
        items,
        max_new_tokens=16,
        chunk_size=7,
        mrope_advance=advance(tiny),
    )
    assert tokens == ref.tokens


def _load_example():
    path = Path(__file__).resolve().parents[2] / "examples" / "generate.py"
    spec = importlib.util.spec_from_file_location("generate_example", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
