"""`mmferry serve` on tiny Gemma 3 and GLM-4.1V checkpoints (the generic family), against
transformers itself: the rows a real service answers (safetensors, shared memory, the cache
routes; concurrent requests batched, repeats from the cache) equal transformers'
`get_image_features` on the same images, and what the generic family cannot carry is a 422.
One service per family, shared by its cases."""

from __future__ import annotations

import io
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
import torch
import transformers
from PIL import Image

from mmferry.server.client import EncodeError, EncoderClient, image_part, video_part
from mmferry.testing.families import save_family_checkpoint
from mmferry.testing.ports import free_port
from tests.engines.service import Service
from tests.engines.tiny_vlm import gradient, image
from tests.models.test_generic import hf_processor, hf_rows

# Measured max |service - transformers| was 0.0 (the same kernels); the bound leaves room for
# a BLAS that blocks another batch composition apart.
ATOL = 1e-5


def png(pixels: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


# Multiples of 28 inside GLM-4.1V's budget (no resampling there); Gemma 3 resizes them all.
IMAGES = [image(56, 84, 0), gradient(84, 56, 1), image(56, 56, 2)]


@pytest.fixture(scope="module", params=["gemma3", "glm4v"])
def served(request, tmp_path_factory):
    family = request.param
    folder = save_family_checkpoint(family, tmp_path_factory.mktemp(family))
    model = transformers.AutoModelForImageTextToText.from_pretrained(folder).eval()
    hf = hf_processor(folder)
    service = Service(folder, free_port(), args=["--max-batch-patches", "100000"]).start()
    try:
        yield family, service, model, hf
    finally:
        service.stop()


def transformers_rows(model, hf, pixels: np.ndarray) -> torch.Tensor:
    """transformers' rows for one image, from the PNG the service is sent (decoded by PIL)."""
    img = Image.open(io.BytesIO(png(pixels))).convert("RGB")
    batch = hf(text=[hf.image_token], images=[img], return_tensors="pt")
    return hf_rows(model, batch)


def check(got, want: torch.Tensor) -> float:
    assert tuple(got.shape) == tuple(want.shape)
    diff = float((got.float() - want).abs().max())
    assert diff <= ATOL, diff
    return diff


def test_rows_through_the_service_equal_transformers(served, record_property):
    family, service, model, hf = served
    want = [transformers_rows(model, hf, p) for p in IMAGES]
    parts = [image_part(png(p)) for p in IMAGES]
    worst = 0.0
    with EncoderClient(service.url) as client:
        # Safetensors over HTTP, every image in one request (one batch).
        items = client.encode(parts)
        assert [it.num_tokens for it in items] == [w.shape[0] for w in want]
        for it, w in zip(items, want, strict=True):
            worst = max(worst, check(it.embeds, w))
            assert it.deepstack == ()
        grids = [it.grid_thw for it in items]
        if family == "gemma3":
            assert grids == [None] * 3  # a fixed-size tower: no grid
        else:
            assert all(g is not None and g[0] == 1 for g in grids)
        # The same images through shared memory, from the cache now.
        before = scrape(service.url, "mmferry_cache_hits_total")
        shared = client.encode(parts, shm=True)
        for it, w in zip(shared, want, strict=True):
            worst = max(worst, check(it.embeds, w))
        assert scrape(service.url, "mmferry_cache_hits_total") == before + 3
        # Concurrent requests of one new image each (batched, the same image twice
        # deduplicated or cached): each its own rows.
        fresh = [gradient(56, 84, 7), image(84, 84, 8), gradient(56, 84, 7)]
        with ThreadPoolExecutor(3) as pool:
            answers = list(pool.map(lambda p: client.encode([image_part(png(p))])[0], fresh))
        for it, p in zip(answers, fresh, strict=True):
            worst = max(worst, check(it.embeds, transformers_rows(model, hf, p)))
        assert answers[0].hash == answers[2].hash != answers[1].hash
    # The cache routes: facts for a router (the engine needs the pixels), rows by hash.
    body = {"content": parts[:2]}
    r = httpx.post(f"{service.url}/v1/cache/encode", json=body, timeout=120)
    assert r.status_code == 200, r.text
    facts = r.json()["items"]
    assert [f["pixels"] for f in facts] == [True, True]
    assert [f["num_tokens"] for f in facts] == [w.shape[0] for w in want[:2]]
    hashes = [f["hash"] for f in facts]
    assert hashes == [it.hash for it in items[:2]]
    r = httpx.post(f"{service.url}/v1/cache/load", json={"hashes": hashes}, timeout=60)
    assert r.status_code == 200, r.text
    from safetensors.torch import load

    rows = load(r.content)
    for h, w in zip(hashes, want[:2], strict=True):
        worst = max(worst, check(rows[h], w))
    print(f"{family}: max |service - transformers| = {worst:.3g}")
    record_property(f"{family}_serve_max_abs_diff", worst)
    # The comparison can fail: two images' rows are far apart.
    n = min(it.num_tokens for it in items)
    assert float((items[0].embeds[:n] - items[2].embeds[:n]).abs().max()) > 100 * ATOL


def scrape(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name) and not line.startswith("#")
    )


def test_what_the_generic_family_cannot_carry_is_a_422(served):
    family, service, _, _ = served
    tiny_video = b"\x00\x00\x00\x18ftypmp42" + bytes(64)
    # GLM-4.1V's processor has a video processor where torchvision is installed (which
    # transformers' video processors need); mmferry carries its images only either way.
    with_video = family == "glm4v" and transformers.utils.is_torchvision_available()
    no_video = "videos through the generic family" if with_video else "takes no video"
    cases = [
        ({"content": [image_part(png(IMAGES[0])), video_part(tiny_video)]}, no_video),
        (
            {"content": [{**image_part(png(IMAGES[0])), "max_pixels": 50176}]},
            "per-item keys (max_pixels) are not applied",
        ),
        ({"content": [image_part(png(IMAGES[0]))], "layout": "compact-u8"}, "layout must be"),
    ]
    with EncoderClient(service.url) as client:
        for body, needle in cases:
            r = httpx.post(f"{service.url}/v1/encode", json=body, timeout=60)
            assert r.status_code == 422, r.text
            assert needle in r.json()["error"]["message"], r.text
        with pytest.raises(EncodeError) as e:
            client.encode([image_part(b"not an image")])
        assert e.value.status == 422
        # Nothing was lost: the service still answers.
        assert client.encode([image_part(png(IMAGES[1]))])[0].num_tokens > 0
    health = httpx.get(f"{service.url}/health", timeout=30).json()
    assert health["status"] == "ok" and "GenericVisionEncoder" in health["encoder"]
