"""`mmferry proxy --name-ahead`: the proxy names each image (hash and grid) from its header and
the encoders' settings, and sends the request to the engine beside the encode, not after it.
The engine here is a real HTTP server that records what it gets (so each case shows what would
have reached vLLM); the encoder a real `mmferry serve`, or a lying one for the failures: an
encode that does not hold the items under the proxy's names sends the request again the usual
way, an encoder's refusal of an item is the client's answer, an engine that fails the request
before its output gets the pixels. tests/proxy/test_epd.py runs it through the real vLLM."""

from __future__ import annotations

import base64
import dataclasses
import time
from collections.abc import Iterator

import httpx
import pytest

import mmferry as mf
from mmferry.routing import Router, parse_item_name
from tests.engines.lying_service import LyingService, js
from tests.engines.tiny_vlm import build_checkpoint, image
from tests.proxy.conftest import data_url, image_part, video_part
from tests.proxy.procs import Proc, RecordingEngine, encoder, proxy, scrape

TEXT = {"type": "text", "text": "describe the image"}


def chat(front: Proc, content: list[dict]) -> httpx.Response:
    body = {"model": "m", "messages": [{"role": "user", "content": content}], "max_tokens": 4}
    return httpx.post(f"{front.url}/v1/chat/completions", json=body, timeout=120)


def names_ahead(front: Proc, timeout_s: float = 60) -> None:
    """Waits until the proxy has learnt its encoders' settings (it names items from then on)."""
    deadline = time.monotonic() + timeout_s
    while not httpx.get(f"{front.url}/health", timeout=10).json()["names_ahead"]:
        assert time.monotonic() < deadline, "the proxy never named items ahead"
        time.sleep(0.1)


def parts(received) -> list[dict]:
    return received.json()["messages"][0]["content"]


def png_bytes(part: dict) -> bytes:
    return base64.b64decode(part["image_url"]["url"].split(",", 1)[1])


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_checkpoint("qwen2_5_vl", tmp_path_factory.mktemp("name-ahead") / "model")


@pytest.fixture
def engine() -> Iterator[RecordingEngine]:
    e = RecordingEngine({"id": "recorded", "choices": []})
    yield e
    e.close()


def test_named_items_reach_the_engine_before_their_encode_ends(model, engine):
    """A real encoder whose tower waits 3 s: the engine gets the request at once, each image as
    its grid and a `<hash>@<key>+<rank>` uuid, the hash and grid the encoder's own (as its
    Processor finds them); the encode carries those names and holds the items under them."""
    slow = encoder(model)
    slow.args += ["--batch-wait-ms", "3000"]
    slow.start()
    front = proxy(engine.url, [slow.url], "connector", "--name-ahead").start()
    try:
        names_ahead(front)
        pics = [image_part(image(56, 84, 1)), image_part(image(84, 56, 2))]
        started = time.monotonic()
        r = chat(front, [*pics, TEXT])
        assert r.status_code == 200, r.text
        assert time.monotonic() - started < 2.5, "the engine waited for the encode"
        (got,) = engine.take()
        proc = mf.Processor.from_pretrained(model)
        router = Router([slow.url])
        for sent, pic in zip(parts(got), pics):
            item = proc.image(png_bytes(pic))
            h, key, rank = parse_item_name(sent["uuid"])
            assert (h, rank) == (item.hash, 0) and router.choices(key) == [slow.url]
            assert sent["image_embeds"] == {"image_grid_thw": list(item.grid_thw)}
        deadline = time.monotonic() + 60
        while scrape(front.url, "mmferry_proxy_named_ahead_total", outcome="held") < 2:
            assert time.monotonic() < deadline, "the encode never held the items"
            time.sleep(0.1)
        hashes = [parse_item_name(p["uuid"])[0] for p in parts(got)[:2]]
        r = httpx.post(f"{slow.url}/v1/cache/lookup", json={"hashes": hashes}, timeout=30)
        assert r.json()["present"] == [True, True]
        assert scrape(front.url, "mmferry_proxy_named_ahead_total", outcome="redone") == 0
    finally:
        front.stop()
        slow.stop()


# --- against a lying encoder ---------------------------------------------------------------

SETTINGS = dataclasses.asdict(mf.Processor.for_model("qwen2.5-vl").config)


def found(body: dict, **change: object) -> list[dict]:
    """An encoder's facts for the items of an encode call, each as it was named (`change`
    applied)."""
    return [
        {
            "modality": "image",
            "hash": a["hash"],
            "grid_thw": a["grid_thw"],
            "num_tokens": a["grid_thw"][1] * a["grid_thw"][2] // 4,
            "timestamps": None,
            "second_per_grid_t": None,
            "held": True,
            **change,
        }
        for a in body.get("announced") or [{"hash": "usual", "grid_thw": [1, 4, 4]}]
    ]


def honest(body: dict) -> object:
    """The encode answer of an encoder that finds each item to be what it was named."""
    return js({"items": found(body)})


@pytest.fixture
def liar() -> Iterator[LyingService]:
    with LyingService() as s:
        s.answer("processor", js({"processor": SETTINGS}))
        yield s


@pytest.fixture
def front(engine, liar) -> Iterator[Proc]:
    p = proxy(engine.url, [liar.url], "connector", "--name-ahead").start()
    try:
        names_ahead(p)
        yield p
    finally:
        p.stop()


PIC = image_part(image(56, 56, 7))


def test_items_held_as_named_leave_the_engines_answer_standing(front, engine, liar):
    liar.answer("encode", honest)
    r = chat(front, [PIC, TEXT])
    assert r.status_code == 200, r.text
    (got,) = engine.take()
    ((_, body),) = liar.calls("encode")
    named = parts(got)[0]
    assert parse_item_name(named["uuid"])[0] == body["announced"][0]["hash"]
    assert named["image_embeds"]["image_grid_thw"] == body["announced"][0]["grid_thw"]


def named_ahead(part: dict) -> bool:
    """Whether the part carries a name the proxy gave ahead of the encoder (index 0 of one)."""
    return "uuid" in part and parse_item_name(part["uuid"])[2] == 0


@pytest.mark.parametrize(
    "answer",
    [
        lambda body: js({"items": found(body, hash="other")}),
        lambda body: js({"items": found(body, held=False)}),
        lambda body: js({"error": {"kind": "overloaded", "message": "busy"}}, status=503),
    ],
    ids=["other-hash", "not-held", "encoder-failed"],
)
def test_items_not_held_as_named_send_the_request_again_the_usual_way(front, engine, liar, answer):
    """The encoder answers before the engine (which takes 1 s here) with other facts, with
    the items not held, or fails: the engine's first request is dropped and the request goes
    the usual way (the encoder's own facts by reference, or the pixels)."""
    engine.delay_s = 1.0
    liar.answer("encode", answer)
    r = chat(front, [PIC, TEXT])
    assert r.status_code == 200, r.text
    # Two connections: which of them the engine's threads record first is not the proxy's
    # to decide (an encoder that fails at once has the second sent before the first is read).
    named, again = sorted((parts(r)[0] for r in engine.take()), key=named_ahead, reverse=True)
    assert named_ahead(named)
    assert not named_ahead(again)
    assert scrape(front.url, "mmferry_proxy_named_ahead_total", outcome="redone") == 1


def test_the_encoders_refusal_of_an_item_is_the_clients_answer(front, engine, liar):
    engine.delay_s = 1.0
    refusal = {"error": {"kind": "bad_media", "message": "part 0: cannot decode image"}}
    liar.answer("encode", js(refusal, status=422))
    r = chat(front, [PIC, TEXT])
    assert r.status_code == 422, r.text
    assert "message 0 part 0" in r.json()["error"]["message"]


def test_an_engine_that_fails_the_request_before_its_output_gets_the_pixels(front, engine, liar):
    """The engine's connector gave up on the items (it fails the request before any output):
    the encoder held them as named, so the proxy sends the request again with its pixels."""
    liar.answer("encode", honest)
    engine.fail_chats = 1
    r = chat(front, [PIC, TEXT])
    assert r.status_code == 200, r.text
    first, second = engine.take()
    assert parse_item_name(parts(first)[0]["uuid"])[2] == 0
    assert parts(second)[0] == PIC


@pytest.mark.parametrize(
    "content",
    [
        [{**PIC, "max_pixels": 50176}, TEXT],  # a per-item key
        [{"type": "image_url", "image_url": {"url": "http://127.0.0.1:9/a.png"}}, TEXT],
        [video_part(image(28, 28, 3)[None].repeat(4, 0), 2), TEXT],
        [{"type": "image_url", "image_url": {"url": data_url(image(28, 28, 4))[:40]}}, TEXT],
    ],
    ids=["keys", "remote", "video", "unreadable-header"],
)
def test_items_the_proxy_cannot_name_go_the_usual_way(front, liar, content):
    liar.answer("encode", js({"error": {"kind": "bad_media", "message": "part 0: no"}}, 422))
    chat(front, content)
    for _, body in liar.calls("encode"):
        assert "announced" not in body


@pytest.mark.parametrize(
    "settings",
    [
        js({"processor": None}),
        js({"processor": {**SETTINGS, "patch_size": 16}}),
        js({"error": "no such route"}, status=404),
    ],
    ids=["generic", "different", "no-route"],
)
def test_encoders_that_name_items_otherwise_turn_naming_off(engine, settings):
    """A generic-family encoder (the engine plans its items from pixels), two encoders whose
    settings differ, or an encoder without the route (an older one): the proxy names nothing
    and says so, once."""
    with LyingService() as a, LyingService() as b:
        a.answer("processor", js({"processor": SETTINGS}))
        b.answer("processor", settings)
        front = proxy(engine.url, [a.url, b.url], "connector", "--name-ahead").start()
        try:
            time.sleep(1.5)
            assert httpx.get(f"{front.url}/health", timeout=10).json()["names_ahead"] is False
            assert sum("--name-ahead is off" in line for line in front.lines) == 1
        finally:
            front.stop()


@pytest.mark.parametrize(
    "change",
    [
        {"patch_size": 14.0},
        {"patch_size": True},
        {"patch_size": "14"},
        {"image_max_pixels": None},
        {"family": ""},
        {"tokens": 5},
        {"extra": 1},
    ],
    ids=["float", "bool", "text", "none", "no-family", "tokens", "unknown-key"],
)
def test_settings_that_are_not_the_protocols_are_refused(change):
    """An encoder's settings answer that would name items by other numbers than its own (a
    float patch size makes float grids) is refused: naming stays off for it."""
    from mmferry.proxy.ahead import processor_config

    assert processor_config({"processor": SETTINGS}) == mf.Processor.for_model("qwen2.5-vl").config
    with pytest.raises(ValueError):
        processor_config({"processor": {**SETTINGS, **change}})
