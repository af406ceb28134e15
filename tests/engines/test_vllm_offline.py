"""vLLM (the installed engine) generates the same tokens from mmferry's embeddings as from its
own preprocessing and tower: greedy 16 tokens and the top-5 logprobs of every step.

Negative controls show the comparison can fail: Qwen3-VL's deepstack columns zeroed, or one
image's rows standing in for another's, change the tokens.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mmferry.engines.vllm import to_vllm
from tests.engines.cases import cases, items, pixel_request

pytestmark = pytest.mark.slow
# The two towers (vLLM's and mmferry's, compact-u8 input) differ by float rounding only.
LOGPROB_ATOL = 1e-4


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl"])
def runs(request, models, engines):
    """Every request of the module for one family, in one batch through its engine."""
    m, engine = models[request.param], engines[request.param]
    all_cases = cases(m.proc.config.factor)
    reqs, keys = [], []
    inputs = {}
    for name, case in all_cases.items():
        its = items(m.proc, case)
        outs = m.enc(its)
        inputs[name] = (its, outs)
        reqs += [pixel_request(case), to_vllm(its, outs).prompt(case.text)]
        keys += [(name, "pixels"), (name, "mmferry")]
    # Negative controls on the two-image prompt. NOTE: vLLM trusts a uuid as the item's cache
    # key, so altered rows sent under the true hashes would be answered from its encoder cache;
    # they get uuids of their own.
    its, outs = inputs["images"]
    text = all_cases["images"].text
    swapped = [outs[1], outs[1]]  # image 1's rows in image 0's place (same token count)
    reqs.append(to_vllm(its, swapped, uuids=["swapped-0", "swapped-1"]).prompt(text))
    keys.append(("images", "other_rows"))
    if outs[0].deepstack:
        flat = [
            dataclasses.replace(o, deepstack=tuple(torch.zeros_like(d) for d in o.deepstack))
            for o in outs
        ]
        reqs.append(to_vllm(its, flat, uuids=["flat-0", "flat-1"]).prompt(text))
        keys.append(("images", "no_deepstack"))
    answer = engine.generate(reqs)
    assert not isinstance(answer, dict), answer
    return m, dict(zip(keys, answer))


@pytest.mark.parametrize("case", ["images", "same_twice", "image_video"])
def test_mmferry_embeddings_equal_vllm_pixels(runs, case):
    _, res = runs
    ours, theirs = res[(case, "mmferry")], res[(case, "pixels")]
    assert len(theirs.tokens) == 16
    assert ours.tokens == theirs.tokens
    assert ours.max_logprob_diff(theirs) <= LOGPROB_ATOL


def test_negative_controls_change_tokens(runs):
    m, res = runs
    base = res[("images", "pixels")].tokens
    assert res[("images", "other_rows")].tokens != base
    if m.enc.num_deepstack:
        assert res[("images", "no_deepstack")].tokens != base
