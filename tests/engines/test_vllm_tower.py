"""vLLM's vision tower against mmferry's, on the same checkpoint and pixels.

vLLM's side comes from the installed engine itself: an encoder-cache producer with vLLM's
built-in shared-folder connector writes each item's encoder output (deepstack concatenated) to
`<folder>/<uuid>/encoder_cache.safetensors`. mmferry's side is its tower on compact-u8 items.
"""

from __future__ import annotations

import pytest
import torch

from tests.engines.cases import cases, items, pixel_request
from tests.engines.conftest import start_engines

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def producers(models, tmp_path_factory):
    started = start_engines(
        models,
        tmp_path_factory,
        "vllm-producer",
        ec_transfer_config=lambda work: {
            "ec_connector": "ECExampleConnector",
            "ec_role": "ec_producer",
            "ec_connector_extra_config": {"shared_storage_path": str(work / "ec")},
        },
    )
    yield started
    for e in started.values():
        e.stop()


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_tower_outputs_match(family, models, producers, record_property):
    """Every item of every test prompt; the max abs difference is printed and recorded."""
    from safetensors.torch import load_file

    m, engine = models[family], producers[family]
    pairs = []
    reqs = []
    for case in cases(m.proc.config.factor).values():
        its = items(m.proc, case)
        pairs += list(zip(its, m.enc(its)))
        reqs.append(pixel_request(case, [it.hash for it in its]))
    answer = engine.generate(reqs, tokens=1)
    assert not isinstance(answer, dict), answer
    worst = 0.0
    for it, out in pairs:
        path = engine.workdir / "ec" / it.hash / "encoder_cache.safetensors"
        theirs = load_file(path)["ec_cache"]
        ours = torch.cat([out.embeds, *out.deepstack], dim=-1)
        assert theirs.shape == ours.shape
        worst = max(worst, float((theirs - ours).abs().max()))
    print(f"{family}: max |vLLM tower - mmferry tower| = {worst:.3g}")
    record_property(f"{family}_tower_max_abs_diff", worst)
    assert worst < 1e-4
