"""`mmferry proxy` in front of the real vLLM OpenAI server and real `mmferry serve` encoders, all
processes on loopback: the same greedy tokens (and logprobs) as vLLM given the pixels, in both
modes, streamed and not; routing by item key; failover to other encoders and to vLLM's own
encoding; the encoders' refusals, an unreachable vLLM and a client gone mid-stream."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

import mmferry as mf
from mmferry.testing.ports import free_port
from tests.engines.lying_service import LyingService, js, raw, rows
from tests.engines.tiny_vlm import VIDEO_FPS, gradient, image, video
from tests.proxy.conftest import Answer, chat, chat_body, first_choice, image_part, video_part
from tests.proxy.procs import cpu_seconds, proxy, scrape

pytestmark = pytest.mark.slow
TEXT = {"type": "text", "text": "describe the image"}


def media(stack, n: int = 2) -> list:
    """Seeded images whose sizes are multiples of the resize factor (no resampling, so vLLM's
    processor and mmferry start from the same pixels); noise and ramps, far apart."""
    f = stack.factor
    out = []
    for i in range(n):
        maker = image if i % 2 == 0 else gradient
        out.append(maker((2 + i % 2) * f, (3 - i % 2) * f, i))
    return out


@pytest.fixture(scope="module")
def proxies(stack):
    """An embeds-mode and a connector-mode proxy over the three encoders (vLLM's connector
    reads them all, each item where the proxy's routing put it)."""
    urls = [e.url for e in stack.encoders]
    started = {}
    try:
        started["embeds"] = proxy(stack.vllm.url, urls, "embeds").start()
        started["connector"] = proxy(stack.vllm.url, urls, "connector").start()
        yield started
    finally:
        for p in started.values():
            p.stop()


def reference(stack, content: list[dict]) -> Answer:
    """vLLM's own answer: the pixels sent to it directly."""
    want = chat(stack.vllm.url, stack.model, content)
    assert want.status == 200, want.text
    assert len(want.tokens) > 0
    return want


@pytest.mark.parametrize("mode", ["embeds", "connector"])
def test_same_tokens_as_vllm_given_the_pixels(stack, proxies, mode):
    a, b = media(stack)
    url = proxies[mode].url
    before = scrape(url, "mmferry_proxy_items_fallback_total")
    # An MP4 both read whole and as they are: NUM_FRAMES frames at VIDEO_FPS (vLLM's loader and
    # mmferry both keep every frame at that rate), lossless, each side a multiple of the
    # resize factor within the video budget (no resampling on either side).
    clip = video_part(video(2 * stack.factor, 2 * stack.factor), int(VIDEO_FPS))
    for content in (
        [image_part(a), image_part(b), TEXT],  # two images
        [image_part(a), TEXT, image_part(a)],  # an image twice
        [image_part(b), clip, TEXT],  # an image and a video
    ):
        want = reference(stack, content)
        chat(url, stack.model, content).same_as(want)
        chat(url, stack.model, content, stream=True).same_as(want)
    # Every item went through an encoder: none fell back to vLLM's own encoding.
    assert scrape(url, "mmferry_proxy_items_fallback_total") == before
    # Text-only requests and other routes pass through unchanged.
    text_only = [TEXT]
    chat(url, stack.model, text_only).same_as(reference(stack, text_only))
    models = httpx.get(f"{url}/v1/models", timeout=30)
    assert models.status_code == 200
    assert models.json()["data"][0]["id"] == str(stack.model)


# Routing and failure handling do not depend on the family: they run on one family's stack
# (the engine it already started; pytest keeps each module-scoped stack's tests together).
only_qwen2_5 = pytest.mark.parametrize("stack", ["qwen2_5_vl"], indirect=True)


def encoded(urls: list[str]) -> list[float]:
    """Items each encoder has encoded (its own /metrics)."""
    return [scrape(u, "mmferry_encoded_items_total") for u in urls]


def _logs(*procs) -> str:
    """The last lines each process wrote, for an assertion's message."""
    return " | ".join(f"{p.args[0]}: {''.join(p.lines[-15:])}" for p in procs)


def delta(after: list[float], before: list[float]) -> list[int]:
    return [int(a - b) for a, b in zip(after, before)]


@only_qwen2_5
def test_items_go_to_the_encoder_their_key_routes_to(stack, proxies):
    urls = [e.url for e in stack.encoders]
    first = proxies["embeds"].url
    f = stack.factor

    # The same image in 10 requests: encoded once, on one encoder.
    same = [image_part(image(2 * f, 2 * f, 100)), TEXT]
    before = encoded(urls)
    for _ in range(10):
        assert chat(first, stack.model, same).status == 200
    moved = delta(encoded(urls), before)
    assert sorted(moved) == [0, 0, 1], moved

    # 30 distinct images, one per request: every encoder gets some.
    images = [[image_part(image(2 * f, 2 * f, 200 + i)), TEXT] for i in range(30)]
    before = encoded(urls)
    for content in images:
        assert chat(first, stack.model, content).status == 200
    per_encoder = delta(encoded(urls), before)
    assert sum(per_encoder) == 30 and min(per_encoder) > 0, per_encoder

    # A second replica (encoders listed in another order) picks the same encoder for every
    # item: all 30 are cache hits where they were encoded.
    started = []
    try:
        replica = proxy(stack.vllm.url, urls[::-1], "embeds").start()
        started.append(replica)
        hits = [scrape(u, "mmferry_cache_hits_total") for u in urls]
        before = encoded(urls)
        for content in images:
            assert chat(replica.url, stack.model, content).status == 200
        assert delta(encoded(urls), before) == [0, 0, 0]
        assert delta([scrape(u, "mmferry_cache_hits_total") for u in urls], hits) == per_encoder

        # A fourth encoder takes about a quarter of the items, and only those move.
        from tests.proxy.procs import encoder

        fourth = encoder(stack.model).start()
        started.append(fourth)
        wider = proxy(stack.vllm.url, [*urls, fourth.url], "embeds").start()
        started.append(wider)
        before = encoded([*urls, fourth.url])
        for content in images:
            assert chat(wider.url, stack.model, content).status == 200
        moved = delta(encoded([*urls, fourth.url]), before)
        # NOTE: the processes' own words on a failure: once in a full run the fourth took
        # none of its items (every encoder encoded nothing), and passed alone and in its module.
        seen = f"{moved}; {_logs(fourth, wider)}"
        assert moved[:3] == [0, 0, 0], seen
        assert 3 <= moved[3] <= 13, seen  # 7.5 expected of 30
    finally:
        for p in started:
            p.stop()


@only_qwen2_5
def test_encoder_refusals_are_the_clients_answer(stack, proxies):
    a = media(stack, 1)[0]
    broken = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
    for mode in ("embeds", "connector"):
        r = chat(proxies[mode].url, stack.model, [image_part(a), broken, TEXT])
        assert r.status == 422, r.text
        error = httpx.Response(422, content=r.text).json()["error"]
        assert error["type"] == "bad_media"
        assert error["message"].startswith("message 0 part 1"), error
    # A part the proxy's own parser refuses: a URL on a host nobody allowed.
    remote = {"type": "image_url", "image_url": {"url": "http://example.com/cat.png"}}
    r = chat(proxies["embeds"].url, stack.model, [remote, TEXT])
    assert r.status == 403, r.text
    assert "allowed hosts" in r.text


@only_qwen2_5
def test_a_lying_encoder_is_passed_over(stack):
    """An encoder that answers the encode well and the load with truncated safetensors: the
    item's next encoder serves it, or with none left vLLM reads its pixels; the client gets
    vLLM's own answer either way (tests/proxy/test_answers.py has every other lie)."""
    import torch

    with LyingService() as liar:
        facts = {"modality": "image", "hash": "h0", "grid_thw": [1, 4, 6], "num_tokens": 6}
        liar.answer("encode", js({"items": [{**facts, "timestamps": None, "held": True}]}))
        body = rows({"h0": torch.zeros(6, 64)}).body
        liar.answer("load", raw(body[: len(body) // 2], "application/vnd.mmferry.safetensors"))
        urls = [liar.url, stack.encoders[0].url]
        f = stack.factor
        candidates = (image_part(image(2 * f, 3 * f, 400 + s)) for s in range(64))
        part = next(p for p in candidates if first_choice(urls, p) == liar.url)
        content = [part, TEXT]
        want = reference(stack, content)
        fronts = []
        try:
            for encoders in (urls, urls[:1]):
                fronts.append(proxy(stack.vllm.url, encoders, "embeds").start())
                asked = len(liar.calls("load"))
                chat(fronts[-1].url, stack.model, content).same_as(want)
                assert len(liar.calls("load")) == asked + 1
            bad = [
                scrape(p.url, "mmferry_proxy_encoder_failures_total", reason="bad_answer")
                for p in fronts
            ]
            assert bad == [1, 1]
            to_pixels = [scrape(p.url, "mmferry_proxy_items_fallback_total") for p in fronts]
            assert to_pixels == [0, 1]
        finally:
            for p in fronts:
                p.stop()


@only_qwen2_5
def test_an_unreachable_vllm_is_a_502(stack):
    dead = f"http://127.0.0.1:{free_port()}"
    front = proxy(dead, [stack.encoders[0].url], "embeds").start()
    try:
        for content in ([image_part(media(stack, 1)[0]), TEXT], [TEXT]):
            r = chat(front.url, stack.model, content)
            assert r.status == 502, r.text
            assert "did not answer" in r.text and dead in r.text
        assert httpx.get(f"{front.url}/health", timeout=10).json()["in_flight"] == 0
    finally:
        front.stop()


@only_qwen2_5
def test_a_client_gone_mid_stream_cancels_the_upstream_request(stack, proxies):
    url, metric = proxies["embeds"].url, stack.vllm.metric
    finished = metric("vllm:request_success_total", finished_reason="length")
    generated = metric("vllm:generation_tokens_total")
    body = chat_body([image_part(media(stack, 1)[0]), TEXT], stream=True, tokens=1500)
    body["model"], body["ignore_eos"] = str(stack.model), True
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        for _ in range(3):  # a few tokens have streamed: the request runs in vLLM
            next(lines)
        assert metric("vllm:num_requests_running") == 1
    # The client closed its connection: vLLM stops the request long before its 1500 tokens
    # (it does not count aborts as finished requests).
    deadline = time.monotonic() + 20
    while metric("vllm:num_requests_running") != 0:
        assert time.monotonic() < deadline, "vLLM still runs the request"
        time.sleep(0.1)
    time.sleep(1.0)
    assert metric("vllm:request_success_total", finished_reason="length") == finished
    assert metric("vllm:generation_tokens_total") - generated < 1000
    assert httpx.get(f"{url}/health", timeout=10).json()["in_flight"] == 0


@only_qwen2_5
def test_vllms_connector_asks_first_the_encoder_the_proxy_chose(stack, proxies):
    """Connector mode: vLLM's connector ranks the encoders by the key the proxy routed each
    item by (carried in its uuid), so its one lookup per item finds the item at once."""
    urls = [e.url for e in stack.encoders]
    f = stack.factor

    def lookups(answer: str) -> list[float]:
        return [scrape(u, "mmferry_cache_lookups_total", answer=answer) for u in urls]

    present, absent, before = lookups("present"), lookups("absent"), encoded(urls)
    for i in range(12):
        content = [image_part(image(2 * f, 2 * f, 700 + i)), TEXT]
        assert chat(proxies["connector"].url, stack.model, content).status == 200
    per_encoder = delta(encoded(urls), before)
    assert sum(per_encoder) == 12, per_encoder
    assert delta(lookups("present"), present) == per_encoder
    assert delta(lookups("absent"), absent) == [0, 0, 0]


@only_qwen2_5
@pytest.mark.parametrize("mode", ["embeds", "connector"])
def test_failover_to_other_encoders_and_to_vllm(stack, proxies, mode):
    url = proxies[mode].url
    f = stack.factor
    contents = [
        [image_part(image(2 * f, 3 * f, 300 + i)), image_part(gradient(3 * f, 2 * f, i)), TEXT]
        for i in range(5)
    ]
    want = [reference(stack, c) for c in contents]
    victim = stack.encoders[1]
    up = lambda u: scrape(url, "mmferry_proxy_encoder_up", encoder=u)  # noqa: E731

    # One encoder killed (SIGKILL) in the middle of 50 requests at concurrency 8.
    done, lock = [], threading.Lock()

    def one(i: int) -> tuple[int, Answer]:
        with lock:
            if len(done) >= 10 and victim.proc.poll() is None:
                victim.kill()
        answer = chat(url, stack.model, contents[i % 5])
        with lock:
            done.append(i)
        return i, answer

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(one, range(50)))
    assert victim.proc.poll() is not None
    for i, answer in answers:
        answer.same_as(want[i % 5])
    assert up(victim.url) == 0
    assert scrape(url, "mmferry_proxy_encoder_failures_total", encoder=victim.url) > 0
    # Back up after it restarts (the probe's backoff is at most a few seconds here).
    victim.start()
    deadline = time.monotonic() + 30
    while up(victim.url) != 1:
        assert time.monotonic() < deadline, "the restarted encoder was not marked up"
        time.sleep(0.2)

    # Every encoder killed: vLLM encodes the pixels itself, and the answers stay the same.
    fallback = scrape(url, "mmferry_proxy_items_fallback_total")
    health = [httpx.get(f"{e.url}/health", timeout=10).json() for e in stack.encoders]
    segments = [h["shm_segment"] for h in health]
    for e in stack.encoders:
        e.kill()
    try:
        for content, w in zip(contents[:2], want):
            chat(url, stack.model, content).same_as(w)
        assert scrape(url, "mmferry_proxy_items_fallback_total") >= fallback + 4
        health = httpx.get(f"{url}/health", timeout=10).json()
        assert health["encoders"] == {"up": 0, "down": len(stack.encoders)}
        # No shared-memory segment outlives a killed encoder (its reaper unlinks it).
        deadline = time.monotonic() + 10
        while any(os.path.exists(f"/dev/shm{s}") for s in segments if s):
            assert time.monotonic() < deadline, segments
            time.sleep(0.1)
    finally:
        for e in stack.encoders:
            with contextlib.suppress(RuntimeError):
                e.start()


@only_qwen2_5
def test_vllm_waits_for_rows_its_encoder_is_still_encoding(stack):
    """Connector mode with --encode-ahead: the encoder answers once the item is preprocessed
    and encodes behind the answer (its tower held back here by a 3 s batch wait), so vLLM reads
    the request first; its connector finds the item pending, vLLM defers the request (no
    failure, no pixels sent again) and runs it once the rows are held: the same tokens as vLLM
    given the pixels."""
    from tests.proxy.procs import Proc

    urls = [e.url for e in stack.encoders]
    k = 2
    slow_url = urls[k]
    f = stack.factor
    seed = next(
        s
        for s in range(900, 1000)
        if first_choice(urls, image_part(image(2 * f, 2 * f, s))) == slow_url
    )
    content = [image_part(image(2 * f, 2 * f, seed)), TEXT]
    want = reference(stack, content)
    original = stack.encoders[k]
    original.stop()
    slow = Proc([*original.args, "--batch-wait-ms", "3000"]).start()
    assert slow.url == slow_url
    front = None
    try:
        front = proxy(stack.vllm.url, urls, "connector", "--encode-ahead").start()
        started = time.monotonic()
        chat(front.url, stack.model, content).same_as(want)
        assert time.monotonic() - started >= 3.0  # the rows were waited for
        assert scrape(slow.url, "mmferry_cache_lookups_total", answer="pending") > 0
        assert scrape(slow.url, "mmferry_cache_lookups_total", answer="present") == 1
        assert scrape(front.url, "mmferry_proxy_items_fallback_total") == 0
        assert scrape(slow.url, "mmferry_encoded_items_total") == 1
    finally:
        if front is not None:
            front.stop()
        slow.stop()
        original.start()


@only_qwen2_5
def test_vllm_plans_items_the_proxy_named_and_waits_for_their_rows(stack):
    """`--name-ahead`: the proxy names each image itself and vLLM gets the request beside the
    encode; the encoder's tower is held back 3 s here, so vLLM plans the request before the
    encoder holds the items: its connector waits for them and vLLM answers its own tokens,
    streamed or not, with nothing sent again."""
    from tests.proxy.procs import Proc

    urls = [e.url for e in stack.encoders]
    k = 1
    slow_url = urls[k]
    f = stack.factor
    routed = [
        p
        for p in (image(2 * f, 3 * f, s) for s in range(700, 900))
        if first_choice(urls, image_part(p)) == slow_url
    ]
    requests = [
        [image_part(routed[0]), image_part(routed[1]), TEXT],
        [image_part(routed[2]), TEXT],
    ]
    wants = [reference(stack, content) for content in requests]
    original = stack.encoders[k]
    original.stop()
    slow = Proc([*original.args, "--batch-wait-ms", "3000"]).start()
    assert slow.url == slow_url
    others = sum(encoded(urls))  # the slow one starts with none
    front = None
    try:
        front = proxy(stack.vllm.url, urls, "connector", "--name-ahead").start()
        deadline = time.monotonic() + 60
        while not httpx.get(f"{front.url}/health", timeout=10).json()["names_ahead"]:
            assert time.monotonic() < deadline, "the proxy never named items ahead"
            time.sleep(0.1)
        for stream, content, want in zip((False, True), requests, wants):
            engine = lambda: cpu_seconds(stack.vllm.proc.pid, "VLLM::EngineCor")  # noqa: E731
            started, cpu = time.monotonic(), engine()
            chat(front.url, stack.model, content, stream=stream).same_as(want)
            waited = time.monotonic() - started
            assert waited >= 3.0  # the rows were waited for
            # ... without vLLM's engine loop stepping at once again and again meanwhile (a
            # core): its steps with nothing to run wait for the encoder's change instead.
            # (Its worker process polls for steps for 1 s after each, whatever the steps.)
            assert engine() - cpu < 0.3 * waited
        assert scrape(front.url, "mmferry_proxy_named_ahead_total", outcome="held") == 3
        assert scrape(front.url, "mmferry_proxy_named_ahead_total", outcome="redone") == 0
        assert scrape(front.url, "mmferry_proxy_items_fallback_total") == 0
        assert scrape(slow.url, "mmferry_cache_lookups_total", answer="pending") > 0
        assert scrape(slow.url, "mmferry_cache_lookups_total", answer="present") > 0
        # Each item encoded once (bounded load may pass one to its next encoder).
        assert sum(encoded(urls)) - others == 3
    finally:
        if front is not None:
            front.stop()
        slow.stop()
        original.start()


def _holds_nowhere(stack, pics: list):
    """An encode answer saying each of `pics` is held, under a hash no encoder holds."""
    proc = mf.Processor.from_pretrained(stack.model)
    facts = {}
    for i, p in enumerate(pics):
        item = proc.image(p)
        facts[image_part(p)["image_url"]["url"]] = {
            "modality": "image",
            "hash": f"held-nowhere-{i}",
            "grid_thw": list(item.grid_thw),
            "num_tokens": item.num_tokens,
            "held": True,
        }
    return lambda body: js({"items": [facts[p["image_url"]["url"]] for p in body["content"]]})


@only_qwen2_5
def test_items_vllm_cannot_find_are_sent_again_as_pixels(stack):
    """Connector mode: an encoder says it holds each item, but vLLM's connector finds them on
    no encoder (the one that held them died or dropped them between the encode and vLLM's
    lookup). vLLM fails that request alone, before running it, and the proxy sends it again
    with pixels: the client gets vLLM's own answer, streamed or not, and vLLM keeps serving."""
    f = stack.factor
    pics = [image(2 * f, 3 * f, 500), gradient(3 * f, 2 * f, 501)]
    content = [image_part(p) for p in pics] + [TEXT]
    want = reference(stack, content)
    with LyingService() as lying:
        lying.answer("encode", _holds_nowhere(stack, pics))
        front = proxy(stack.vllm.url, [lying.url], "connector").start()
        try:
            for stream in (False, True):
                chat(front.url, stack.model, content, stream=stream).same_as(want)
            assert [len(b["content"]) for _, b in lying.calls("encode")] == [2, 2]  # a call each
            lacked = scrape(front.url, "mmferry_proxy_items_fallback_total", reason="engine_lacked")
            assert lacked == 4
        finally:
            front.stop()
    assert httpx.get(f"{stack.vllm.url}/health", timeout=10).status_code == 200


@only_qwen2_5
def test_items_vllm_cannot_find_are_encoded_again_by_their_next_encoder(stack):
    """Connector mode: the encoder the items route to first says it holds them, but vLLM's
    connector finds them nowhere (as when that encoder dies or is cut off right after its
    answer). The proxy has the items encoded again by their next encoders, left out those that
    said they held them, and sends them by reference again: vLLM's answer comes from a real
    encoder's rows (it has no pixels to encode), the same as for the pixels. When the next
    encoder lies too, the request goes as pixels, its third form."""
    f = stack.factor
    urls = [e.url for e in stack.encoders]
    with LyingService() as lying, LyingService() as other:
        # Images whose first choice, among the lying service and the real encoders, is the
        # lying one: their next choices are real encoders.
        ranked = [lying.url, *urls]
        pics = [image(2 * f, 2 * f, 700 + seed) for seed in range(40)]
        pics = [p for p in pics if first_choice(ranked, image_part(p)) == lying.url][:2]
        assert len(pics) == 2
        content = [image_part(p) for p in pics] + [TEXT]
        want = reference(stack, content)
        answer = _holds_nowhere(stack, pics)
        lying.answer("encode", answer)
        other.answer("encode", answer)
        front = proxy(stack.vllm.url, ranked, "connector").start()
        try:
            for stream in (False, True):
                chat(front.url, stack.model, content, stream=stream).same_as(want)
            assert len(lying.calls("encode")) == 2  # each request's first form alone
            assert scrape(front.url, "mmferry_proxy_items_moved_total") == 4
            assert scrape(front.url, "mmferry_proxy_items_fallback_total") == 0
        finally:
            front.stop()

        # Both encoders the proxy knows lie: the item moves once, then goes as pixels.
        one = [image_part(pics[0]), TEXT]
        want = reference(stack, one)
        front = proxy(stack.vllm.url, [lying.url, other.url], "connector").start()
        try:
            chat(front.url, stack.model, one).same_as(want)
            assert scrape(front.url, "mmferry_proxy_items_moved_total") == 1
            lacked = scrape(front.url, "mmferry_proxy_items_fallback_total", reason="engine_lacked")
            assert lacked == 1
            assert len(lying.calls("encode")) + len(other.calls("encode")) == 2 + 2
        finally:
            front.stop()
    assert httpx.get(f"{stack.vllm.url}/health", timeout=10).status_code == 200


@only_qwen2_5
def test_api_key_admission_and_drain(stack):
    key = "proxy-key-0123456789"
    front = proxy(
        stack.vllm.url,
        [stack.encoders[0].url],
        "embeds",
        "--max-in-flight",
        "1",
        MMFERRY_API_KEY=key,
    ).start()
    auth = {"Authorization": f"Bearer {key}"}
    content = [image_part(media(stack, 1)[0]), TEXT]
    try:
        body = chat_body(content)
        body["model"] = str(stack.model)
        r = httpx.post(f"{front.url}/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 401, r.text
        r = httpx.get(f"{front.url}/v1/models", timeout=60)
        assert r.status_code == 401, r.text
        r = httpx.post(f"{front.url}/v1/chat/completions", json=body, headers=auth, timeout=60)
        assert r.status_code == 200, r.text

        # One request in flight (a stream being read) fills --max-in-flight 1: the next is a
        # 503 with Retry-After. SIGTERM then drains: new requests get 503, the open stream
        # runs to its end, and the proxy exits 0.
        long = chat_body(content, stream=True, tokens=400)
        long["model"], long["ignore_eos"] = str(stack.model), True
        with httpx.stream(
            "POST", f"{front.url}/v1/chat/completions", json=long, headers=auth, timeout=60
        ) as stream:
            assert stream.status_code == 200
            lines = stream.iter_lines()
            next(lines)
            r = httpx.post(f"{front.url}/v1/chat/completions", json=body, headers=auth)
            assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
            front.proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 10
            while httpx.get(f"{front.url}/health", timeout=10).status_code != 503:
                assert time.monotonic() < deadline, "the proxy did not start draining"
                time.sleep(0.05)
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]", rest[-3:]
        chunks = [json.loads(line[6:]) for line in rest if line.startswith("data: {")]
        steps = [c["choices"][0].get("logprobs") or {} for c in chunks]
        assert sum(len(s.get("content") or ()) for s in steps) == 400  # every token came
        assert front.proc.wait(timeout=30) == 0
        assert any("drained" in line for line in front.lines)
    finally:
        front.stop()
