"""The service over real HTTP: equal to an in-process encode, and every bad input refused."""

from __future__ import annotations

import asyncio
import base64
import io
import os
import re

import httpx
import pytest
import torch
from PIL import Image

import mmferry as mf
from mmferry.models import spec_for
from mmferry.preprocess.samples import sample_video
from mmferry.server.client import (
    AsyncEncoderClient,
    EncodeError,
    EncoderClient,
    image_part,
    open_handle,
    path_part,
    video_part,
)
from mmferry.server.encoded import from_bytes
from mmferry.server.service import ServiceConfig

from .conftest import API_KEY, DEPTH, IMAGE_MAX_PIXELS, png


def metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    found = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


@pytest.fixture(scope="module")
def reference():
    proc = mf.Processor.for_model("qwen3-vl", image_max_pixels=IMAGE_MAX_PIXELS)
    enc = mf.VisionEncoder.random(config=spec_for("qwen3-vl").random_config.with_depth(DEPTH))
    return proc, enc


@pytest.fixture
def client(server):
    with EncoderClient(server.url, api_key=API_KEY) as c:
        yield c


def _check_equal(got, want_items, want_outs):
    assert len(got) == len(want_items)
    for g, it, out in zip(got, want_items, want_outs):
        assert (g.modality, g.grid_thw, g.num_tokens, g.hash) == (
            it.modality,
            it.grid_thw,
            it.num_tokens,
            it.hash,
        )
        # The server batches differently from this one call, so float sums may differ in
        # their last bits; 1e-5 is far below the rows' scale (about 1).
        torch.testing.assert_close(g.embeds.float(), out.embeds, atol=1e-5, rtol=1e-5)
        assert len(g.deepstack) == len(out.deepstack) >= 1
        for a, b in zip(g.deepstack, out.deepstack):
            torch.testing.assert_close(a.float(), b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("shm", [False, True], ids=["safetensors", "shm"])
def test_responses_equal_an_in_process_encode(client, reference, media_dir, shm):
    proc, enc = reference
    img0 = (media_dir / "img0.png").read_bytes()
    parts = [
        image_part(img0, "image/png"),
        path_part(media_dir / "img1.png"),
        video_part(sample_video()),
        image_part(img0, "image/png"),  # a repeat in the same request
    ]
    got = client.encode(parts, shm=shm)
    items = [
        proc.image(img0, "compact-u8"),
        proc.image(str(media_dir / "img1.png"), "compact-u8"),
        proc.video(str(sample_video()), "compact-u8"),
    ]
    items.append(items[0])
    with torch.inference_mode():
        outs = enc(items)
    _check_equal(got, items, outs)
    if shm:  # zero-copy: every tensor's bytes lie in this process's mapping of the server's segment
        segment = client.health()["shm_segment"].lstrip("/")
        for g in got:
            for t in (g.embeds, *g.deepstack):
                assert _mapped_from(t.data_ptr(), segment), "not a view of the server's segment"


def _mapped_from(ptr: int, segment: str) -> bool:
    with open("/proc/self/maps") as maps:
        for line in maps:
            if line.rstrip().endswith(segment):
                lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
                if lo <= ptr < hi:
                    return True
    return False


def test_hf_layout_and_bfloat16_are_honoured(client, reference, media_dir):
    proc, enc = reference
    data = (media_dir / "img2.png").read_bytes()
    (got,) = client.encode([image_part(data, "image/png")], layout="hf", dtype="bfloat16")
    item = proc.image(data, "hf")
    with torch.inference_mode():
        (out,) = enc([item])
    assert got.embeds.dtype == torch.bfloat16 and got.hash == item.hash
    torch.testing.assert_close(got.embeds, out.embeds.to(torch.bfloat16))


def test_identical_items_in_flight_are_encoded_once(server):
    data = png(80, 80, seed=1234)  # never sent before
    before = metric(server.url, "mmferry_encoded_items_total")

    async def many():
        async with AsyncEncoderClient(server.url, api_key=API_KEY) as c:
            return await asyncio.gather(
                *(c.encode([image_part(data, "image/png")]) for _ in range(6))
            )

    results = asyncio.run(many())
    assert metric(server.url, "mmferry_encoded_items_total") - before == 1
    first = results[0][0]
    for (r,) in results[1:]:
        assert r.hash == first.hash and torch.equal(r.embeds, first.embeds)


def _post(url, body=None, *, key=API_KEY, content=None, ctype="application/json"):
    headers = {"content-type": ctype}
    if key is not None:
        headers["authorization"] = f"Bearer {key}"
    if content is None:
        import json

        content = json.dumps(body).encode()
    return httpx.post(f"{url}/v1/encode", content=content, headers=headers, timeout=60)


def _img(url: str) -> dict:
    return {"content": [{"type": "image_url", "image_url": {"url": url}}]}


def _msgs(content) -> dict:
    return {
        "messages": [
            {"role": "system", "content": "Describe."},
            {"role": "user", "content": content},
        ]
    }


def _data(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def _bad_requests(media_dir):
    big = _data(b"\0" * (3 << 20))
    buf = io.BytesIO()
    Image.new("RGB", (1200, 1000), (200, 30, 90)).save(buf, format="PNG")
    wide = buf.getvalue()  # 1.2 MP in a few KiB: over max_pixels, under max_request_bytes
    five = [{"type": "image_url", "image_url": {"url": _data(png(32, 32, 1))}}] * 6
    return {
        "corrupt image": (_img(_data((media_dir / "broken.png").read_bytes())), {}, 422, "image"),
        "oversize body": (_img(big), {}, 413, "limit_request_bytes"),
        "too many pixels": (_img(_data(wide)), {}, 422, "limit_pixels=1000000 (--limit-pixels)"),
        "too many items": ({"content": five}, {}, 422, "--limit-items"),
        "wrong request content type": (_img(_data(wide)), {"ctype": "text/plain"}, 415, "json"),
        "wrong data content type": (_img(_data(b"hello", "text/plain")), {}, 415, "image/*"),
        "missing content": ({"layout": "hf"}, {}, 422, "content"),
        "missing url": ({"content": [{"type": "image_url", "image_url": {}}]}, {}, 422, "url"),
        "unknown part type": ({"content": [{"type": "audio_url"}]}, {}, 422, "unknown type"),
        "bad base64": (_img("data:image/png;base64,@@not base64@@"), {}, 400, "base64"),
        "bad json": (None, {"content": b"{not json"}, 400, "JSON"),
        "bad layout": ({**_img(_data(wide)), "layout": "jpeg"}, {}, 422, "layout"),
        "disallowed path": (_img("/etc/hostname"), {}, 403, "allowed folders"),
        "path escaping": (_img(f"{media_dir}/../../etc/hostname"), {}, 403, "allowed folders"),
        "remote url": (_img("http://example.com/cat.png"), {}, 403, "--allow-host"),
        "missing file in an allowed folder": (_img(f"{media_dir}/nope.png"), {}, 404, "no such"),
        "a folder, not a file": (_img(str(media_dir)), {}, 404, "not a regular file"),
        "a relative path": (_img("img0.png"), {}, 422, "not absolute"),
        "a video key on an image": (
            {"content": [{**_img(_data(wide))["content"][0], "fps": 2}]},
            {},
            422,
            "'fps' is a video option",
        ),
        "content and messages": ({**_img(_data(wide)), "messages": []}, {}, 422, "not both"),
        "messages without media": (_msgs("hello"), {}, 422, "no image or video"),
        "a bad part in a message": (
            _msgs([{"type": "text", "text": "x"}, {"type": "audio_url"}]),
            {},
            422,
            "message 1 part 1: unknown part type 'audio_url'",
        ),
        "a message without a role": ({"messages": [{"content": "x"}]}, {}, 422, "'role'"),
        "a disallowed path in a message": (
            _msgs([{"type": "image", "image": "/etc/hostname"}]),
            {},
            403,
            "message 1 part 0: '/etc/hostname' is outside the allowed folders",
        ),
        "wrong api key": (_img(_data(wide)), {"key": "wrong"}, 401, "API key"),
        "no api key": (_img(_data(wide)), {"key": None}, 401, "API key"),
    }


def test_every_bad_input_gets_its_4xx_and_the_server_keeps_serving(server, client, media_dir):
    good = [image_part((media_dir / "img0.png").read_bytes(), "image/png")]
    for name, (body, kw, status, words) in _bad_requests(media_dir).items():
        r = _post(server.url, body, **kw)
        assert r.status_code == status, (name, r.status_code, r.text)
        message = r.json()["error"]["message"]
        assert words.lower() in message.lower(), (name, message)
        assert client.encode(good)[0].num_tokens > 0, name  # still serving
    assert metric(server.url, 'mmferry_errors_total{kind="unauthorized"}') >= 2


def test_client_raises_with_the_server_message(server, media_dir):
    with EncoderClient(server.url, api_key="nope") as c, pytest.raises(EncodeError) as e:
        c.encode([path_part(media_dir / "img0.png")])
    assert e.value.status == 401 and "API key" in e.value.message


def test_health_and_metrics(server, client, media_dir):
    for _ in range(2):  # the second is a cache hit whatever ran before
        client.encode([path_part(media_dir / "img1.png")])
    health = httpx.get(f"{server.url}/health").json()
    assert health["status"] == "ok" and "RANDOM" in health["encoder"]
    text = httpx.get(f"{server.url}/metrics").text
    for name in (
        "mmferry_queue_depth",
        "mmferry_batch_items_bucket",
        "mmferry_batch_patches_bucket",
        'mmferry_stage_seconds_bucket{le="0.001",stage="encode"}',
        'mmferry_stage_seconds_count{stage="preprocess"}',
        "mmferry_cache_hits_total",
        "mmferry_pool_fallbacks_total",
        "mmferry_errors_total",
        "mmferry_cache_bytes",
    ):
        assert name in text, name
    assert metric(server.url, "mmferry_cache_hits_total") >= 1
    # The encoder's rows for img1 at least, within the cache's default capacity.
    assert 0 < metric(server.url, "mmferry_cache_bytes") <= ServiceConfig().cache_bytes


def test_service_items_stand_in_for_local_items_in_prefill_step(client, reference, media_dir):
    from mmferry.embed.step import StepRequest, prefill_step

    proc, enc = reference
    img0 = (media_dir / "img0.png").read_bytes()
    remote = client.encode([image_part(img0, "image/png")])
    item = proc.image(img0, "compact-u8")
    tok = proc.config.tokens
    prompt = proc.expand_prompt([7, tok.vision_start, tok.image, tok.vision_end, 8], [item])
    width = enc.out_hidden_size

    def embed(ids: torch.Tensor) -> torch.Tensor:  # a text embedding: each id's own row
        return ids[:, None].float().expand(len(ids), width) / 1e6

    n = len(prompt.input_ids)
    with torch.inference_mode():
        local = prefill_step(
            [StepRequest(prompt, [item], 0, n)], embed_tokens=embed, encoder=enc, device="cpu"
        )
        served = prefill_step(
            [StepRequest(prompt, [remote[0].precomputed()], 0, n)], embed_tokens=embed, device="cpu"
        )
    assert served.encoded == 0 and local.encoded == 1
    torch.testing.assert_close(served.inputs_embeds, local.inputs_embeds, atol=1e-5, rtol=1e-5)
    assert served.vision_index.tolist() == local.vision_index.tolist()
    for a, b in zip(served.deepstack, local.deepstack, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_chat_messages_are_encoded_in_order_with_their_own_keys(server, reference, media_dir):
    """A `messages` body, OpenAI and Qwen part forms mixed, text ignored, qwen-vl-utils keys
    applied per item: the same items as the library makes of the same messages."""
    from mmferry.chat.media import build_item
    from mmferry.chat.parts import parse_messages

    proc, enc = reference
    img0 = (media_dir / "img0.png").read_bytes()
    clip = _data(sample_video().read_bytes(), "video/mp4")
    messages = [
        {"role": "system", "content": "You describe what you see."},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "What is here?"},
                {"type": "image_url", "image_url": {"url": _data(img0)}},
                {"type": "video", "video": clip, "nframes": 12},
                {"type": "image", "image": str(media_dir / "img1.png")},
            ],
        },
        {"role": "assistant", "content": "Noise, a clip and more noise."},
        {
            "role": "user",
            "content": [
                {"type": "input_text", "text": "And this one, stretched?"},
                {
                    "type": "image",
                    "path": str(media_dir / "img2.png"),
                    "resized_height": 40,
                    "resized_width": 160,
                },
                {"type": "video_url", "video_url": {"url": clip}, "fps": 1.0},
            ],
        },
    ]
    r = _post(server.url, {"messages": messages})
    assert r.status_code == 200, r.text
    got = from_bytes(r.content)
    items = [build_item(proc, p, "compact-u8", {}) for p in parse_messages(messages).media]
    assert [it.modality for it in items] == ["image", "video", "image", "image", "video"]
    with torch.inference_mode():
        outs = enc(items)
    _check_equal(got, items, outs)
    # The per-item keys took effect: sizes and frame counts differ from the plain items.
    plain_video = proc.video(str(sample_video()), "compact-u8")
    assert got[1].grid_thw[0] == 6 != plain_video.grid_thw[0]  # 12 frames: 6 temporal patches
    assert got[3].grid_thw != proc.image(str(media_dir / "img2.png"), "compact-u8").grid_thw
    assert got[4].grid_thw != plain_video.grid_thw


def test_bare_parts_take_qwen_forms_and_keys_too(client, reference, media_dir):
    proc, enc = reference
    part = {"type": "image", "url": (media_dir / "img2.png").as_uri()}
    keyed = {**image_part((media_dir / "img2.png").read_bytes(), "image/png")}
    keyed.update(resized_height=40, resized_width=160)
    plain, stretched = client.encode([part, keyed])
    assert plain.hash == proc.image(str(media_dir / "img2.png"), "compact-u8").hash
    assert stretched.grid_thw != plain.grid_thw


def test_a_raw_http_client_opens_shm_answers_with_open_handle(server, media_dir):
    body = {"content": [{"type": "image", "image": str(media_dir / "img0.png")}]}
    r = _post(server.url, {**body, "response": "shm"})
    assert r.status_code == 200 and r.headers["content-type"] == "application/json", r.text
    (doc,) = r.json()["items"]
    embeds = open_handle(doc["embeds"])
    deepstack = [open_handle(h) for h in doc["deepstack"]]
    (want,) = from_bytes(_post(server.url, body).content)
    assert (doc["modality"], tuple(doc["grid_thw"]), doc["hash"]) == (
        want.modality,
        want.grid_thw,
        want.hash,
    )
    assert torch.equal(embeds, want.embeds)
    assert all(torch.equal(a, b) for a, b in zip(deepstack, want.deepstack, strict=True))


def test_the_readme_curl_body_is_accepted(server, media_dir):
    """The encoder service guide's curl example: its headers, and its body with the path made
    one of ours."""
    import json
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "docs/guides/encoder-service.md").read_text()
    command = re.search(r"curl -s (.*?)'\n  ```", readme, re.S).group(1)
    assert "-H 'Content-Type: application/json'" in command
    body = json.loads(command.split(" -d '", 1)[1])
    text = json.dumps(body).replace("/data/media/cat.jpg", str(media_dir / "img0.png"))
    r = _post(server.url, content=text.encode())
    assert r.status_code == 200, r.text
    (item,) = from_bytes(r.content)
    assert item.modality == "image" and item.num_tokens > 0


def test_preprocessing_threads_default_to_the_cores(monkeypatch):
    from mmferry.server.service import ServiceConfig

    monkeypatch.delenv("MMFERRY_PREPROCESS_THREADS", raising=False)
    assert ServiceConfig().preprocess_threads == len(os.sched_getaffinity(0))
    monkeypatch.setenv("MMFERRY_PREPROCESS_THREADS", "3")
    assert ServiceConfig().preprocess_threads == 3
    assert ServiceConfig(preprocess_threads=1).preprocess_threads == 1
    with pytest.raises(ValueError, match="preprocess_threads"):
        ServiceConfig(preprocess_threads=0)
