"""`mmferry proxy` in embeds mode trusts nothing an encoder answers: a lying or broken encoder (a
real HTTP server answering what each case scripts: HTML, malformed or truncated safetensors,
other hashes, facts that do not fit the part, rows of the wrong shape or dtype) fails that
encoder for the item, which goes to its next choice or, with none left, to the engine as its
pixels. The engine here is a real HTTP server that records what the proxy forwards, so each
case shows exactly what would have reached vLLM; tests/proxy/test_epd.py shows one case through
the real vLLM."""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import io
import json
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import httpx
import pytest
import torch

from tests.engines.lying_service import Answer, LyingService, html, js, raw, rows
from tests.engines.tiny_vlm import build_checkpoint, image
from tests.proxy.conftest import first_choice, image_part
from tests.proxy.procs import Proc, encoder, proxy, scrape, send_json

TEXT = {"type": "text", "text": "describe the image"}
HASH = "h0"
FACTS = {
    "modality": "image",
    "hash": HASH,
    "grid_thw": [1, 4, 6],
    "num_tokens": 6,  # 1 * 4 * 6 / 2**2
    "timestamps": None,
    "second_per_grid_t": None,
    "held": True,
}
ROWS = torch.randn(6, 12, generator=torch.Generator().manual_seed(0))
ENGINE_ANSWER = {"id": "chatcmpl-recorded", "choices": []}


def facts(**change) -> Answer:
    """The encode answer with `change` applied to the item's facts."""
    return js({"items": [{**FACTS, **change}]})


def without(field: str) -> Answer:
    return js({"items": [{k: v for k, v in FACTS.items() if k != field}]})


def safetensors(tensors: dict[str, torch.Tensor]) -> bytes:
    return rows(tensors).body


# Every form of a bad /v1/cache/encode answer for one image part.
BAD_ENCODES = {
    "html_200": html(),
    "not_json": raw("items: h0"),
    "empty_body": raw(""),
    "duplicate_keys": raw('{"items": [], "items": ' + json.dumps([FACTS]) + "}"),
    "timestamps_nan": raw(json.dumps({"items": [FACTS]}).replace("null", "[NaN]", 1)),
    "no_items": js({"items": []}),
    "two_items": js({"items": [FACTS, {**FACTS, "hash": "h1"}]}),
    "items_not_a_list": js({"items": FACTS}),
    "item_not_an_object": js({"items": [HASH]}),
    "json_list": js([FACTS]),
    "no_hash": without("hash"),
    "hash_empty": facts(hash=""),
    "hash_an_int": facts(hash=5),
    "hash_too_long": facts(hash="h" * 129),
    "hash_with_a_newline": facts(hash="h0\n"),
    "no_grid": without("grid_thw"),
    "grid_of_two": facts(grid_thw=[4, 6], num_tokens=6),
    "grid_of_four": facts(grid_thw=[1, 1, 4, 6]),
    "grid_with_a_zero": facts(grid_thw=[1, 0, 6]),
    "grid_negative": facts(grid_thw=[1, -4, -6]),
    "grid_of_floats": facts(grid_thw=[1.0, 4.0, 6.0]),
    "grid_of_bools": facts(grid_thw=[True, 4, 6]),
    "grid_a_string": facts(grid_thw="1x4x6"),
    "modality_video_for_an_image": facts(modality="video"),
    "no_modality": without("modality"),
    "no_num_tokens": without("num_tokens"),
    "num_tokens_a_string": facts(num_tokens="6"),
    "num_tokens_a_float": facts(num_tokens=6.0),
    "num_tokens_a_bool": facts(num_tokens=True),
    "num_tokens_zero": facts(num_tokens=0),
    "num_tokens_not_the_grids": facts(num_tokens=7),
    "held_a_string": facts(held="yes"),
    "timestamps_for_two_patches": facts(timestamps=[0.0, 1.0]),
    "timestamps_not_numbers": facts(timestamps=["0"]),
    "status_204": Answer(204, b""),
    "status_302": Answer(302, b""),
    "no_such_route": Answer(404, b'{"detail": "Not Found"}'),
    "method_not_allowed": Answer(405, b'{"detail": "Method Not Allowed"}'),
}
# Every form of a bad /v1/cache/load answer after good facts.
BAD_LOADS = {
    "html_200": html(),
    "json_200": js({"items": {HASH: {}}}),
    "not_safetensors": raw(b"\x08\x00\x00\x00\x00\x00\x00\x00{}garbage", "application/x"),
    "empty_body": raw(b"", "application/x"),
    "truncated": raw(safetensors({HASH: ROWS})[:-8], "application/x"),
    "header_past_the_body": raw(b"\xff" * 8 + b"{}", "application/x"),
    "other_hash": rows({"h1": ROWS}),
    "another_hash_beside_it": rows({HASH: ROWS, "h1": ROWS.clone()}),
    "no_tensors": rows({}),
    "rows_3d": rows({HASH: ROWS[None]}),
    "rows_1d": rows({HASH: ROWS.flatten()}),
    "rows_too_few": rows({HASH: ROWS[:5]}),
    "rows_too_many": rows({HASH: torch.cat([ROWS, ROWS[:1]])}),
    "rows_of_no_width": rows({HASH: torch.zeros(6, 0)}),
    "rows_of_ints": rows({HASH: ROWS.to(torch.int64)}),
    "rows_float16_for_float32": rows({HASH: ROWS.half()}),
    "rows_bfloat16_for_float32": rows({HASH: ROWS.bfloat16()}),
    "rows_with_a_nan": rows({HASH: ROWS.index_fill(0, torch.tensor([3]), float("nan"))}),
    "rows_with_an_infinity": rows({HASH: ROWS.index_fill(1, torch.tensor([5]), float("inf"))}),
    "status_204": Answer(204, b""),
}


class _Engine(BaseHTTPRequestHandler):
    """The engine's place: keeps each chat body the proxy forwards, answers ENGINE_ANSWER."""

    seen: ClassVar[list[dict]] = []

    def do_POST(self) -> None:  # noqa: N802 - the stdlib's name
        self.seen.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
        send_json(self, json.dumps(ENGINE_ANSWER).encode())

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def engine() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Engine)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def liar() -> Iterator[LyingService]:
    with LyingService() as s:
        yield s


@pytest.fixture(scope="module")
def alone(engine, liar) -> Iterator[Proc]:
    """An embeds-mode proxy whose one encoder is the liar."""
    p = proxy(engine, [liar.url], "embeds").start()
    yield p
    p.stop()


def forwarded(front: Proc, part: dict) -> dict:
    """The one media part the engine received for a chat request with `part` in it; the
    client must have had the engine's own answer."""
    _Engine.seen.clear()
    body = {"model": "m", "messages": [{"role": "user", "content": [part, TEXT]}]}
    r = httpx.post(f"{front.url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json() == ENGINE_ANSWER
    (sent,) = _Engine.seen
    content = sent["messages"][0]["content"]
    assert content[1] == TEXT
    return content[0]


def sent_rows(part: dict) -> torch.Tensor:
    payload = base64.b64decode(part["image_embeds"]["image_embeds"])
    return torch.load(io.BytesIO(payload), weights_only=True)


def failures(front: Proc, url: str) -> tuple[float, float]:
    return (
        scrape(front.url, "mmferry_proxy_encoder_failures_total", encoder=url, reason="bad_answer"),
        scrape(front.url, "mmferry_proxy_items_fallback_total", reason="no_encoder"),
    )


def test_an_honest_answer_is_forwarded_as_its_rows(alone, liar):
    # The control: the same harness sees rows when the answer is the protocol's.
    liar.answer("encode", facts())
    liar.answer("load", rows({HASH: ROWS}))
    part = forwarded(alone, image_part(image(28, 28, 0)))
    assert part["type"] == "image_embeds" and part["uuid"] == HASH
    assert part["image_embeds"]["image_grid_thw"] == [1, 4, 6]
    assert torch.equal(sent_rows(part), ROWS)


def _goes_as_pixels(alone: Proc, liar: LyingService) -> None:
    before = failures(alone, liar.url)
    client = image_part(image(28, 28, 0))
    assert forwarded(alone, client) == client  # the client's own part: vLLM reads the pixels
    after = failures(alone, liar.url)
    assert (after[0] - before[0], after[1] - before[1]) == (1, 1)


@pytest.mark.parametrize("case", BAD_ENCODES)
def test_a_bad_encode_answer_sends_the_pixels(alone, liar, case):
    liar.answer("encode", BAD_ENCODES[case])
    liar.answer("load", rows({HASH: ROWS}))
    _goes_as_pixels(alone, liar)


@pytest.mark.parametrize("case", BAD_LOADS)
def test_a_bad_load_answer_sends_the_pixels(alone, liar, case):
    liar.answer("encode", facts())
    liar.answer("load", BAD_LOADS[case])
    _goes_as_pixels(alone, liar)


def test_a_bad_answer_goes_to_the_items_next_encoder(engine, liar, tmp_path):
    """The liar first among two: its bad rows are passed over and the real encoder's go."""
    model = build_checkpoint("qwen2_5_vl", tmp_path / "model")
    real = encoder(model).start()
    front = None
    try:
        urls = [liar.url, real.url]
        # An image whose key ranks the liar first (about every other one does).
        candidates = (image_part(image(56, 84, s)) for s in range(64))
        client = next(p for p in candidates if first_choice(urls, p) == liar.url)
        liar.answer("encode", facts(grid_thw=[1, 4, 6]))
        liar.answer("load", rows({HASH: ROWS[:5]}))
        front = proxy(engine, urls, "embeds").start()
        encoded = scrape(real.url, "mmferry_encoded_items_total")
        asked = len(liar.calls("load"))
        part = forwarded(front, client)
        assert len(liar.calls("load")) == asked + 1  # the liar was asked first, and answered
        assert scrape(real.url, "mmferry_encoded_items_total") == encoded + 1
        assert part["type"] == "image_embeds" and part["uuid"] != HASH
        assert part["image_embeds"]["image_grid_thw"] == [1, 4, 6]  # 56 x 84 in 14-px patches
        assert sent_rows(part).shape == (6, 64)  # the tiny checkpoint's width, not the liar's
        assert failures(front, liar.url)[0] == 1
    finally:
        if front is not None:
            front.stop()
        real.stop()


def _first_for(urls: list[str], url: str) -> dict:
    """An image part whose key ranks `url` first among `urls` (about every other one does)."""
    candidates = (image_part(image(56, 84, s)) for s in range(64))
    return next(p for p in candidates if first_choice(urls, p) == url)


def _refusal(status: int, retry_after: str | None = None) -> Answer:
    """An encoder's timeout or overload answer, in `mmferry serve`'s error shape."""
    doc = {"error": {"kind": "overloaded", "message": f"status {status}"}}
    return Answer(
        status,
        json.dumps(doc).encode(),
        headers={} if retry_after is None else {"Retry-After": retry_after},
    )


@pytest.mark.parametrize("status", [408, 429])
def test_an_encoders_timeout_or_overload_goes_to_the_items_next_choice(engine, status):
    """A 408 (the encoder timed out) or 429 (it is overloaded) is that encoder's failure: the
    item goes to its next choice, and the client never sees the status."""
    with LyingService() as busy, LyingService() as honest:
        urls = [busy.url, honest.url]
        client = _first_for(urls, busy.url)
        busy.answer("encode", _refusal(status))
        honest.answer("encode", facts())
        honest.answer("load", rows({HASH: ROWS}))
        front = proxy(engine, urls, "embeds").start()
        try:
            part = forwarded(front, client)
            assert len(busy.calls("encode")) == 1  # asked first, and it refused
            assert part["type"] == "image_embeds" and part["uuid"] == HASH
            assert torch.equal(sent_rows(part), ROWS)  # the next choice's rows
            failed = scrape(
                front.url,
                "mmferry_proxy_encoder_failures_total",
                encoder=busy.url,
                reason=f"http_{status}",
            )
            assert failed == 1
        finally:
            front.stop()


def test_an_encoder_that_trickles_its_answer_is_cut_at_the_encoder_timeout(engine):
    """An encoder that sends its answer a byte every 0.3 s, each byte well within any read
    timeout, but the whole (about 100 bytes) in half a minute: the call is cut at
    --encoder-timeout and the item goes to its next choice, the client answered at once."""
    limit_s = 2.0
    with LyingService() as slow, LyingService() as honest:
        urls = [slow.url, honest.url]
        client = _first_for(urls, slow.url)
        slow.answer("encode", dataclasses.replace(facts(), trickle_s=0.3))
        honest.answer("encode", facts())
        honest.answer("load", rows({HASH: ROWS}))
        front = proxy(engine, urls, "embeds", "--encoder-timeout", str(limit_s)).start()
        try:
            t0 = time.monotonic()
            part = forwarded(front, client)
            took = time.monotonic() - t0
            assert len(slow.calls("encode")) == 1  # asked first
            assert part["type"] == "image_embeds" and torch.equal(sent_rows(part), ROWS)
            assert limit_s <= took < limit_s + 5.0, took
            failed = scrape(
                front.url,
                "mmferry_proxy_encoder_failures_total",
                encoder=slow.url,
                reason="timeout",
            )
            assert failed == 1
        finally:
            front.stop()


def test_an_encoder_that_trickles_its_health_stays_down(engine):
    """A down encoder whose /health answers 200 a byte every 0.4 s (each byte well within the
    connect timeout, the whole in about 6 s) fails each probe at --connect-timeout and stays
    down, its items going elsewhere."""
    with LyingService() as slow, LyingService() as honest:
        urls = [slow.url, honest.url]
        client = _first_for(urls, slow.url)
        slow.answer("encode", _refusal(503))
        slow.answer("health", Answer(200, b'{"status": "ok"}', trickle_s=0.4))
        honest.answer("encode", facts())
        honest.answer("load", rows({HASH: ROWS}))
        front = proxy(engine, urls, "embeds", "--connect-timeout", "1").start()
        try:
            assert forwarded(front, client)["uuid"] == HASH  # the slow one failed, marked down
            time.sleep(9.0)  # a whole trickled answer, probes due at 0.5, 1, 2 and 4 s
            assert httpx.get(f"{front.url}/health", timeout=10).json()["encoders"] == {
                "up": 1,
                "down": 1,
            }
            assert forwarded(front, client)["uuid"] == HASH
            assert len(slow.calls("encode")) == 1  # still passed over
        finally:
            front.stop()


def test_an_overloaded_encoder_is_left_alone_for_its_retry_after(engine):
    """A 429's Retry-After keeps the encoder out of the routing that long (not the 0.5 s of a
    first failure's probe), then it is asked again."""
    retry_after_s = 3
    with LyingService() as busy, LyingService() as honest:
        urls = [busy.url, honest.url]
        client = _first_for(urls, busy.url)
        busy.answer("encode", _refusal(429, str(retry_after_s)))
        honest.answer("encode", facts())
        honest.answer("load", rows({HASH: ROWS}))
        front = proxy(engine, urls, "embeds").start()
        try:
            t0 = time.monotonic()
            assert forwarded(front, client)["uuid"] == HASH
            assert len(busy.calls("encode")) == 1
            time.sleep(retry_after_s / 2)  # probes are due every 0.25 s; /health answers 200
            assert forwarded(front, client)["uuid"] == HASH
            assert len(busy.calls("encode")) == 1  # passed over: still within its Retry-After
            time.sleep(max(0.0, t0 + retry_after_s + 1 - time.monotonic()))
            assert forwarded(front, client)["uuid"] == HASH
            assert len(busy.calls("encode")) == 2  # back in the routing once it elapsed
        finally:
            front.stop()


# -- a request's items routed to one encoder go to it in one call -----------------------------


def _hash_of(part: dict) -> str:
    return "h" + hashlib.sha256(json.dumps(part, sort_keys=True).encode()).hexdigest()[:12]


def _rows_of(h: str) -> torch.Tensor:
    return torch.randn(6, 12, generator=torch.Generator().manual_seed(int(h[1:], 16)))


def _each_part(body: dict) -> Answer:
    """The protocol's answer to a call of any number of parts: each part's facts, in order."""
    items = [{**FACTS, "hash": _hash_of(p)} for p in body["content"]]
    return js({"items": items})


def _their_rows(lost: frozenset[str] = frozenset()) -> Callable[[dict], Answer]:
    """The load answer for the asked hashes; a load asking for a hash in `lost` is a 404."""

    def answer(body: dict) -> Answer:
        gone = [h for h in body["hashes"] if h in lost]
        if gone:
            return js({"error": {"kind": "not_found", "message": f"not held: {gone[0]}"}}, 404)
        return rows({h: _rows_of(h) for h in body["hashes"]})

    return answer


def _chat(front: Proc, content: list[dict]) -> httpx.Response:
    _Engine.seen.clear()
    body = {"model": "m", "messages": [{"role": "user", "content": content}]}
    return httpx.post(f"{front.url}/v1/chat/completions", json=body, timeout=60)


def _forwarded_all(front: Proc, content: list[dict]) -> list[dict]:
    r = _chat(front, content)
    assert r.status_code == 200, r.text
    (sent,) = _Engine.seen
    return sent["messages"][0]["content"]


PARTS = [image_part(image(28, 28, s)) for s in (11, 12, 13)]


def test_a_requests_items_go_to_their_encoder_in_one_call(alone, liar):
    liar.answer("encode", _each_part)
    liar.answer("load", _their_rows())
    encodes, loads = len(liar.calls("encode")), len(liar.calls("load"))
    sent = _forwarded_all(alone, [TEXT, *PARTS])
    assert [b["content"] for _, b in liar.calls("encode")[encodes:]] == [PARTS]
    hashes = [_hash_of(p) for p in PARTS]
    assert [b["hashes"] for _, b in liar.calls("load")[loads:]] == [hashes]
    assert sent[0] == TEXT
    for part, h in zip(sent[1:], hashes):
        assert part["type"] == "image_embeds" and part["uuid"] == h
        assert torch.equal(sent_rows(part), _rows_of(h))


def test_the_same_item_twice_in_a_call_is_loaded_once(alone, liar):
    liar.answer("encode", _each_part)
    liar.answer("load", _their_rows())
    loads = len(liar.calls("load"))
    sent = _forwarded_all(alone, [PARTS[0], PARTS[0], TEXT])
    h = _hash_of(PARTS[0])
    assert [b["hashes"] for _, b in liar.calls("load")[loads:]] == [[h]]
    assert [p["uuid"] for p in sent[:2]] == [h, h]
    assert torch.equal(sent_rows(sent[1]), _rows_of(h))


def test_a_call_refused_as_a_whole_is_sent_one_by_one(alone, liar):
    """An encoder whose limits refuse the call (too many items, too large a body), naming no
    part: each item goes to it alone."""

    def one_at_a_time(body: dict) -> Answer:
        if len(body["content"]) > 1:
            return js({"error": {"kind": "too_many_items", "message": "at most 1 item"}}, 422)
        return _each_part(body)

    liar.answer("encode", one_at_a_time)
    liar.answer("load", _their_rows())
    encodes = len(liar.calls("encode"))
    sent = _forwarded_all(alone, [*PARTS, TEXT])
    sizes = sorted(len(b["content"]) for _, b in liar.calls("encode")[encodes:])
    assert sizes == [1, 1, 1, 3]
    assert [p["uuid"] for p in sent[:3]] == [_hash_of(p) for p in PARTS]


def test_an_encoders_refusal_of_one_part_names_the_clients_part(alone, liar):
    refusal = {"error": {"kind": "bad_media", "message": "part 1: cannot identify image file"}}
    liar.answer("encode", js(refusal, 422))
    r = _chat(alone, [TEXT, *PARTS])
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert error["type"] == "bad_media"
    # The encoder's part 1 is the client's message 0 part 2 (the text is part 0).
    assert error["message"] == "message 0 part 2: cannot identify image file"
    assert _Engine.seen == []


def test_an_answer_for_fewer_parts_than_the_call_sends_their_pixels(alone, liar):
    short = js({"items": [{**FACTS, "hash": _hash_of(p)} for p in PARTS[:2]]})
    liar.answer("encode", short)
    liar.answer("load", _their_rows())
    before = failures(alone, liar.url)
    assert _forwarded_all(alone, [*PARTS, TEXT]) == [*PARTS, TEXT]  # every item's pixels
    after = failures(alone, liar.url)
    assert (after[0] - before[0], after[1] - before[1]) == (1, 3)  # one call failed, 3 items


def test_an_item_lost_before_the_load_is_loaded_alone_and_goes_as_pixels(alone, liar):
    """One lost item fails the call's load; the others are loaded one by one. The request then
    goes as pixels all the same: vLLM refuses raw and embedding parts of one modality."""
    lost = _hash_of(PARTS[1])
    liar.answer("encode", _each_part)
    liar.answer("load", _their_rows(frozenset({lost})))
    loads = len(liar.calls("load"))
    sent = _forwarded_all(alone, [*PARTS, TEXT])
    asked = [b["hashes"] for _, b in liar.calls("load")[loads:]]
    assert asked[0] == [_hash_of(p) for p in PARTS]  # one load first, then each alone
    assert sorted(map(tuple, asked[1:])) == sorted((_hash_of(p),) for p in PARTS)
    assert sent == [*PARTS, TEXT]


@pytest.mark.parametrize(
    ("mode", "extra", "part", "wait"),
    [
        ("connector", ["--encode-ahead"], image_part(image(28, 28, 21)), False),
        ("connector", [], image_part(image(28, 28, 21)), None),
        ("embeds", ["--encode-ahead"], image_part(image(28, 28, 21)), None),
        # An item vLLM could not be sent as pixels must not be answered ahead of its rows: a
        # failed encode behind the answer would have no pixels to fall back on.
        (
            "connector",
            ["--encode-ahead"],
            {**image_part(image(28, 28, 21)), "max_pixels": 50176},
            None,
        ),
    ],
    ids=["encode-ahead", "connector", "embeds", "not-as-pixels"],
)
def test_the_encode_asks_for_the_answer_ahead_of_the_rows_in_connector_mode(
    engine, liar, mode, extra, part, wait
):
    """Connector mode with --encode-ahead asks the encoder to answer once the items are
    preprocessed (`"wait": false`), so vLLM reads the request while the tower runs; never by
    default, in embeds mode (the rows come through the proxy), or for a request an item of
    which could not follow as pixels."""
    liar.answer("encode", facts())
    liar.answer("load", rows({HASH: ROWS}))
    front = proxy(engine, [liar.url], mode, *extra).start()
    try:
        encodes = len(liar.calls("encode"))
        forwarded(front, part)
        ((_, body),) = liar.calls("encode")[encodes:]
        assert body.get("wait") is wait
    finally:
        front.stop()
