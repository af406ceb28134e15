"""The generic family's rows against the installed vLLM's own towers: tiny Gemma 3 and GLM-4.1V.

vLLM's side comes from the engine itself: an encoder-cache producer with vLLM's built-in
shared-folder connector writes each item's encoder output, computed from the pixels by vLLM's
processor and tower, to `<folder>/<uuid>/encoder_cache.safetensors`. mmferry's side is
`Processor.from_pretrained` and `VisionEncoder.from_pretrained` on the same folder (the generic
family). One engine per family, one request holding every image.

vLLM 0.32 takes no precomputed rows for either family through `LLM.generate`: its Gemma 3
refuses `image_embeds` outright, and its GLM-4.1V parses images with the generic parser, which
takes no grid, while its prompt update needs one.
"""

from __future__ import annotations

import pytest
from PIL import Image

import mmferry as mf
from mmferry.testing.families import save_family_checkpoint
from tests.engines.conftest import needs_vllm
from tests.engines.tiny_vlm import gradient, image
from tests.engines.vllm_harness import VllmEngine

pytestmark = pytest.mark.slow
# Both towers run float32; they differ by float rounding only.
TOWER_ATOL = 1e-4
PLACEHOLDER = {
    "gemma3": " <start_of_image> ",
    "glm4v": "<|begin_of_image|><|image|><|end_of_image|>",
}


@pytest.fixture(scope="module", params=["gemma3", "glm4v"])
def run(request, tmp_path_factory):
    needs_vllm()
    family = request.param
    folder = save_family_checkpoint(family, tmp_path_factory.mktemp(family))
    proc = mf.Processor.from_pretrained(folder)
    enc = mf.VisionEncoder.from_pretrained(folder)
    # Multiples of 28 inside GLM-4.1V's budget: no resampling there; Gemma 3 resizes both.
    pixels = [image(56, 84, 0), gradient(84, 56, 1), image(56, 56, 2)]
    items = proc.images(pixels)
    work = tmp_path_factory.mktemp(f"vllm-{family}")
    producer = {
        "ec_connector": "ECExampleConnector",
        "ec_role": "ec_producer",
        "ec_connector_extra_config": {"shared_storage_path": str(work / "ec")},
    }
    engine = VllmEngine.start(folder, work, ec_transfer_config=producer)
    try:
        request = {
            "prompt": "describe" + PLACEHOLDER[family] * len(pixels) + "what",
            "multi_modal_data": {"image": [Image.fromarray(p) for p in pixels]},
            "multi_modal_uuids": {"image": [it.hash for it in items]},
        }
        answer = engine.generate([request], tokens=1)
        assert not isinstance(answer, dict), answer
    finally:
        engine.stop()
    return family, list(zip(items, enc(items), strict=True)), work / "ec"


def test_vllm_tower_equals_mmferry_rows(run, record_property):
    """Every image's rows; the max abs difference is printed and recorded."""
    from safetensors.torch import load_file

    family, pairs, ec = run
    worst = 0.0
    for it, out in pairs:
        theirs = load_file(ec / it.hash / "encoder_cache.safetensors")["ec_cache"]
        theirs = theirs.reshape(-1, theirs.shape[-1])
        assert theirs.shape == out.embeds.shape
        worst = max(worst, float((theirs - out.embeds).abs().max()))
    print(f"{family}: max |vLLM tower - mmferry rows| = {worst:.3g}")
    record_property(f"{family}_tower_max_abs_diff", worst)
    assert worst <= TOWER_ATOL
    # The comparison can fail: another image's rows are far from these.
    (a, out_a), (b, out_b) = pairs[0], pairs[1]
    assert a.num_tokens == b.num_tokens
    assert float((out_a.embeds - out_b.embeds).abs().max()) > 100 * TOWER_ATOL
