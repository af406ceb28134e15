"""vLLM fed the generic family's rows: tiny Gemma 3 and GLM-4.1V, token for token.

One stack per family: a `mmferry serve` encoder (the generic family: the checkpoint's own
transformers processor and `get_image_features`), vLLM's OpenAI server with
`MmferryECConnector` toward it, and `mmferry proxy` in connector and in embeds mode. vLLM's
answer on the pixels alone (its own processor and tower; the connector finds nothing under
vLLM's own hash) is the reference for one image, two images and the same image twice:

- the pixels with mmferry's hash as uuid, straight to vLLM: the connector loads the rows;
- the same request through `mmferry proxy --mode connector`, which does that itself.

Both give the same greedy tokens and top logprobs (1e-4). The rows are the encoder's: an
image's pixels named by another image's hash give other tokens. vLLM 0.32 takes no
precomputed rows of these models (its own 400 is checked), so `mmferry proxy --mode embeds`
answers 501 saying to use connector mode instead of letting vLLM encode behind its back.
166 s on a 2-core machine alone, 473 s beside other vLLM servers (vLLM's start is most of it).
"""

from __future__ import annotations

import httpx
import pytest

from mmferry.testing.families import save_family_checkpoint
from tests.engines.conftest import needs_vllm
from tests.engines.tiny_vlm import gradient, image
from tests.proxy.conftest import LOGPROB_ATOL, chat, image_part
from tests.proxy.procs import VllmServer, encoder, proxy, scrape

pytestmark = pytest.mark.slow
# Multiples of 28 (no resampling in GLM-4.1V's processor); both give the same token count.
A, B, C = image(56, 84, 0), gradient(84, 56, 1), image(56, 84, 5)


@pytest.fixture(scope="module", params=["gemma3", "glm4v"])
def stack(request, tmp_path_factory):
    needs_vllm()
    family = request.param
    model = save_family_checkpoint(family, tmp_path_factory.mktemp(family))
    started = []
    try:
        enc = encoder(model).start()
        started.append(enc)
        # The checkpoint's own chat template writes the model's placeholder with the spacing
        # its word-level tokenizer and vLLM's prompt update expect.
        work = tmp_path_factory.mktemp(f"vllm-{family}")
        vllm = VllmServer(model, work, {"url": enc.url}, template=None)
        started.append(vllm.start())
        connector = proxy(vllm.url, [enc.url], "connector").start()
        started.append(connector)
        embeds = proxy(vllm.url, [enc.url], "embeds").start()
        started.append(embeds)
        yield family, model, enc, vllm, connector, embeds
    finally:
        for p in reversed(started):
            p.stop()


def encoded(enc, pixels) -> dict:
    """The encoder's facts for one image (held for the connector)."""
    r = httpx.post(
        f"{enc.url}/v1/cache/encode", json={"content": [image_part(pixels)]}, timeout=120
    )
    assert r.status_code == 200, r.text
    (facts,) = r.json()["items"]
    assert facts["pixels"] is True and facts["held"] is True
    return facts


def named(pixels, uuid: str) -> dict:
    return {**image_part(pixels), "uuid": uuid}


def content(text: str, parts: list[dict]) -> list[dict]:
    return [{"type": "text", "text": text}, *parts, {"type": "text", "text": "what ?"}]


CASES = {"one": [A], "two": [A, B], "same_twice": [A, A]}
# vLLM 0.32's own words for the two embeds parts below (the rows alone; the rows with the grid
# where the processor gives one). Gemma 3's processor takes pixel items only; GLM-4.1V's parser
# is vLLM's generic one, which reads a bare `[tokens, width]` tensor as that many one-row
# images and takes no grid.
VLLM_REFUSES = {
    "gemma3": (
        "but found type: <class 'vllm.multimodal.parse.ImageEmbeddingItems'>",
        "Failed to apply Gemma3Processor",
    ),
    "glm4v": (
        "At most 4 image(s) may be provided in one prompt",
        "JSON arrays are only supported for metadata: image_grid_thw",
    ),
}


def test_connector_rows_give_vllms_own_tokens(stack):
    family, model, enc, vllm, connector, _ = stack
    present = lambda: scrape(enc.url, "mmferry_cache_lookups_total", answer="present")  # noqa: E731
    # The rows are the encoder's: A's pixels named by C's hash (vLLM never saw that uuid, so
    # nothing of its own stands in) give other tokens than A's pixels alone.
    c = encoded(enc, C)
    before = present()
    alone = chat(vllm.url, model, content("describe", [image_part(A)]))
    swapped = chat(vllm.url, model, content("describe", [named(A, c["hash"])]))
    assert alone.status == 200 and swapped.status == 200, (alone.text, swapped.text)
    assert present() > before  # the connector found C's rows in the service
    assert (
        swapped.tokens != alone.tokens
        or max(abs(x - y) for a, b in zip(swapped.top, alone.top) for (_, x), (_, y) in zip(a, b))
        > 100 * LOGPROB_ATOL
    )
    for name, images in CASES.items():
        text = f"{name}: describe"
        want = chat(vllm.url, model, content(text, [image_part(p) for p in images]))
        assert want.status == 200, want.text
        hashes = [encoded(enc, p)["hash"] for p in images]
        direct = chat(vllm.url, model, content(text, [named(p, h) for p, h in zip(images, hashes)]))
        direct.same_as(want)
        through = chat(connector.url, model, content(text, [image_part(p) for p in images]))
        through.same_as(want)
    health = httpx.get(f"{vllm.url}/health", timeout=10)
    assert health.status_code == 200


def test_embeds_are_refused_by_vllm_and_by_the_proxy(stack):
    """vLLM 0.32's own refusal of precomputed rows of these models (the parts mmferry's
    `content_part` writes for native families, with or without a grid), and the proxy's 501."""
    from mmferry.engines.vllm import _b64
    from mmferry.server.client import EncoderClient

    family, model, enc, vllm, _, embeds = stack
    with EncoderClient(enc.url) as client:
        (item,) = client.encode([image_part(A)])
    payload = {"image_embeds": _b64(item.embeds)}
    if item.grid_thw is not None:
        payload["image_grid_thw"] = list(item.grid_thw)
    parts = [
        {"type": "image_embeds", "image_embeds": _b64(item.embeds)},
        {"type": "image_embeds", "image_embeds": payload},
    ]
    for part, why in zip(parts, VLLM_REFUSES[family], strict=True):
        refused = chat(vllm.url, model, content("describe", [part]))
        print(f"{family}: vLLM answers {refused.status}: {refused.text[:400]}")
        assert refused.status == 400 and why in refused.text, refused.text
    answer = chat(embeds.url, model, content("describe", [image_part(A)]))
    assert answer.status == 501, answer.text
    assert "--mode connector" in answer.text and "generic family" in answer.text
    # vLLM still serves the pixels.
    assert chat(vllm.url, model, content("describe", [image_part(A)])).status == 200
