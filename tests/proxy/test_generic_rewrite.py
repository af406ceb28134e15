"""The proxy's side of the generic family without an engine: an encoder's facts that say the
engine needs the pixels (`pixels: true`, a grid or none) are checked and kept, connector mode
sends such an item as its pixels named by its hash, and one that has no URL vLLM reads is a
422 naming why. The engines' helpers refuse such items too (they would build parts vLLM 0.32
refuses). Against the real vLLM: tests/proxy/test_generic_epd.py."""

from __future__ import annotations

import json

import pytest
import torch

from mmferry.engines.vllm import to_vllm, to_vllm_refs
from mmferry.proxy.answers import BadEncoderAnswer, encode_facts
from mmferry.proxy.media import Encoded, find_media, rewrite
from mmferry.server.encoded import EncodedItem
from mmferry.server.limits import Limits, RequestError
from mmferry.server.sources import source_policy

DATA = "data:image/png;base64,iVBORw0KGgo="


def answer(**facts) -> bytes:
    base = {"modality": "image", "hash": "h1", "num_tokens": 4, "held": True}
    return json.dumps({"items": [{**base, **facts}]}).encode()


def test_facts_that_need_the_pixels_are_checked_and_kept():
    gemma = encode_facts(answer(grid_thw=None, pixels=True), ["image"])[0]
    assert gemma["grid_thw"] is None and gemma["pixels"] is True
    glm = encode_facts(answer(grid_thw=[1, 4, 4], pixels=True), ["image"])[0]
    assert glm["grid_thw"] == [1, 4, 4] and glm["pixels"] is True
    native = encode_facts(answer(grid_thw=[1, 4, 4]), ["image"])[0]  # a service without the field
    assert native["pixels"] is False
    bad = [
        (answer(grid_thw=None), "image"),  # no grid, and nothing says the pixels go
        (answer(grid_thw=None, pixels="yes"), "image"),
        (answer(grid_thw=[1, 4, 4], pixels=True, modality="video"), "video"),
        (answer(grid_thw=[1, 4, 4], pixels=True, num_tokens=3), "image"),
        (answer(grid_thw=None, pixels=True, timestamps=[0.0]), "image"),
    ]
    for body, modality in bad:
        with pytest.raises(BadEncoderAnswer):
            encode_facts(body, [modality])


def body(*urls: str) -> dict:
    parts = [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, *parts]}]}


def test_connector_mode_sends_the_pixels_named_by_the_hash(tmp_path):
    req = body(DATA, DATA)
    media = find_media(req, source_policy(Limits()))
    facts = [
        encode_facts(answer(grid_thw=None, pixels=True, hash=h), ["image"])[0] for h in ("h1", "h2")
    ]
    out = rewrite(req, media, [Encoded(f) for f in facts], "connector")
    parts = out["messages"][0]["content"][1:]
    assert [p["type"] for p in parts] == ["image_url", "image_url"]
    assert [p["image_url"]["url"] for p in parts] == [DATA, DATA]
    assert [p["uuid"].split("@")[0] for p in parts] == ["h1", "h2"]
    # A local path has no URL vLLM reads: the request is refused, saying why.
    (tmp_path / "a.png").write_bytes(b"")
    req = body((tmp_path / "a.png").as_uri())
    media = find_media(req, source_policy(Limits(allow_paths=(str(tmp_path),))))
    with pytest.raises(RequestError) as e:
        rewrite(req, media, [Encoded(facts[0])], "connector")
    assert e.value.status == 422 and "from their pixels only" in e.value.message


def test_the_engine_helpers_refuse_items_vllm_takes_as_pixels_only():
    facts = {"modality": "image", "hash": "h1", "grid_thw": None, "pixels": True}
    with pytest.raises(ValueError, match="as pixels only"):
        to_vllm_refs([facts])
    item = EncodedItem("image", torch.zeros(4, 8), (), None, 4, "h1")
    with pytest.raises(ValueError, match="MmferryECConnector loads its rows"):
        to_vllm([item])


def test_the_proxy_over_a_generic_encoder(tmp_path):
    """A real `mmferry serve` on a tiny Gemma 3 and `mmferry proxy` in both modes, in front of
    a recording engine: connector mode forwards the image's own data: URL named by the
    encoder's hash; embeds mode answers 501 naming connector mode, and forwards nothing."""
    import httpx

    from mmferry.testing.families import save_family_checkpoint
    from tests.engines.tiny_vlm import image
    from tests.proxy.conftest import chat_body, image_part
    from tests.proxy.procs import RecordingEngine, encoder, proxy

    model = save_family_checkpoint("gemma3", tmp_path / "gemma3")
    engine = RecordingEngine()
    started = []
    try:
        enc = encoder(model).start()
        started.append(enc)
        connector = proxy(engine.url, [enc.url], "connector").start()
        started.append(connector)
        embeds = proxy(engine.url, [enc.url], "embeds").start()
        started.append(embeds)
        part = image_part(image(56, 84, 0))
        body = chat_body([{"type": "text", "text": "hi"}, part, part])
        r = httpx.post(f"{connector.url}/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        (sent,) = [x.json() for x in engine.take() if x.path.endswith("/chat/completions")]
        parts = sent["messages"][0]["content"][1:]
        facts = httpx.post(
            f"{enc.url}/v1/cache/encode", json={"content": [part]}, timeout=60
        ).json()["items"][0]
        for p in parts:
            assert p["type"] == "image_url" and p["image_url"] == part["image_url"]
            assert p["uuid"].split("@")[0] == facts["hash"]
        r = httpx.post(f"{embeds.url}/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 501, r.text
        assert "--mode connector" in r.json()["error"]["message"]
        assert not [x for x in engine.take() if x.path.endswith("/chat/completions")]
    finally:
        for p in reversed(started):
            p.stop()
        engine.close()
