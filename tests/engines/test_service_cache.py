"""The service's lookup by hash and its pins (server/ec.py), and `CacheClient` against a real
`mmferry serve`: the rows it loads are mmferry's encoder output in the engines' layout."""

from __future__ import annotations

import io

import httpx
import pytest
import torch
from PIL import Image

from mmferry.embed.cache import EncoderCache
from mmferry.encoder.model import VisionOutput
from mmferry.engines.cache_client import CacheClient, ServiceUnavailable
from mmferry.server.client import image_part
from mmferry.server.ec import Pins
from tests.engines.service import Service, free_port
from tests.engines.tiny_vlm import image


def out(rows: int, fill: float) -> VisionOutput:
    return VisionOutput(torch.full((rows, 4), fill), (torch.full((rows, 4), -fill),))


def test_pin_outlives_eviction_until_taken():
    cache = EncoderCache(capacity_bytes=64)  # room for one 2-row entry with its deepstack
    cache.put("a", out(2, 1.0))
    pins = Pins(cache, ttl_s=10.0, max_bytes=1 << 20)
    assert pins.lookup(["a", "b"], now=0.0) == [True, False]
    cache.put("c", out(2, 3.0))  # evicts "a" from the LRU
    assert cache.peek("a") is None
    taken = pins.take("a", now=1.0)
    assert taken is not None and float(taken.embeds[0, 0]) == 1.0
    assert pins.take("a", now=1.0) is None and len(pins) == 0 and pins.used_bytes == 0
    pins.lookup(["c"], now=2.0)
    with pytest.raises(KeyError):
        pins.take_all(["c", "gone"], now=2.0)
    assert len(pins) == 1  # a failed load releases nothing
    assert set(pins.take_all(["c", "c"], now=2.0)) == {"c"} and len(pins) == 0


def test_pin_expires_and_is_bounded():
    cache = EncoderCache(capacity_bytes=1 << 20)
    cache.put("a", out(2, 1.0))
    cache.put("b", out(2, 2.0))
    pins = Pins(cache, ttl_s=5.0, max_bytes=64)  # one entry's worth
    assert pins.lookup(["a", "b"], now=0.0) == [True, False]  # "b" would pass the bound
    cache._drop("a")
    assert pins.take("a", now=6.0) is None  # expired: the pin no longer holds it
    assert pins.used_bytes == 0


@pytest.fixture(scope="module")
def service(models):
    s = Service(models["qwen3_vl"].path, free_port()).start()
    yield s
    s.stop()


def png(pixels) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


@pytest.mark.parametrize("shm", [False, True])
def test_client_loads_packed_rows(service, models, shm):
    m = models["qwen3_vl"]
    pixels = image(64, 96, 3 + shm)
    body = {"content": [image_part(png(pixels))]}
    (facts,) = httpx.post(f"{service.url}/v1/cache/encode", json=body, timeout=60).json()["items"]
    client = CacheClient(service.url, None, 30.0, shm)
    try:
        assert client.lookup([facts["hash"], "never-seen"]) == [True, False]
        rows = client.load([facts["hash"]], torch.float32)[facts["hash"]]
        ref = m.enc([m.proc.image(pixels)])[0]
        assert rows.shape == (facts["num_tokens"], ref.embeds.shape[1] * 3)
        want = torch.cat([ref.embeds, *ref.deepstack], dim=-1)
        assert torch.allclose(rows, want, atol=1e-5)
        with pytest.raises(ServiceUnavailable, match="404"):
            client.load(["never-seen"], torch.float32)
    finally:
        client.close()


def test_cache_routes_ask_for_the_api_key(models):
    key = "engine-test-key-0123"
    s = Service(models["qwen2_5_vl"].path, free_port(), env={"MMFERRY_API_KEY": key}).start()
    try:
        r = httpx.post(f"{s.url}/v1/cache/lookup", json={"hashes": ["x"]}, timeout=30)
        assert r.status_code == 401
        bad = httpx.post(
            f"{s.url}/v1/cache/lookup",
            json={"hashes": "x"},
            timeout=30,
            headers={"Authorization": f"Bearer {key}"},
        )
        assert bad.status_code == 422
        client = CacheClient(s.url, key, 30.0, shm=False)
        assert client.lookup(["x"]) == [False]
        client.close()
    finally:
        s.stop()


def test_cache_routes_refuse_hostile_json_with_a_400(service):
    """The cache routes parse bodies as /v1/encode does: deep nesting and a 5,000-digit
    integer are a 400, not a 500."""
    for raw in (b"[" * 100_000, b'{"hashes": [' + b"9" * 5000 + b"]}"):
        for route in ("lookup", "load", "encode"):
            r = httpx.post(
                f"{service.url}/v1/cache/{route}",
                content=raw,
                headers={"content-type": "application/json"},
                timeout=60,
            )
            assert r.status_code == 400, (route, r.status_code, r.text[:200])
            assert r.json()["error"]["kind"] == "bad_json"
