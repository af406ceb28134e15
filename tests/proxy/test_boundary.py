"""The proxy's media check is a boundary: nothing it refuses reaches the engine by another spelling
of the path, another route or another part form, and an item that falls back to pixels reaches
the engine only as what the encoder would have encoded. The engine is a real HTTP server that
records every request it gets, so each case shows exactly what would have reached vLLM; the
encoders' addresses refuse connections (every item falls back to pixels) unless a case gives
one."""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from urllib.parse import urlsplit

import httpx
import pytest

from mmferry.testing.ports import free_port
from tests.engines.lying_service import Answer, LyingService, html, js
from tests.engines.tiny_vlm import image
from tests.proxy.conftest import data_url
from tests.proxy.procs import Proc, RecordingEngine, proxy

ALLOWED = "media.test"
FORBIDDEN = "http://169.254.169.254/latest/meta-data/iam"
PNG = data_url(image(28, 28, 0))
CHAT = "/v1/chat/completions"


def body(*parts: object, field: str = "messages") -> dict:
    return {"model": "m", field: [{"role": "user", "content": list(parts)}]}


def post(front: Proc, path: str, doc: object, headers: dict | None = None) -> tuple[int, dict]:
    """POST `doc` to `path` spelled exactly as given (httpx would normalise it)."""
    raw = doc if isinstance(doc, bytes) else json.dumps(doc).encode()
    split = urlsplit(front.url)
    conn = http.client.HTTPConnection(split.hostname, split.port, timeout=60)
    try:
        conn.request("POST", path, raw, {"Content-Type": "application/json", **(headers or {})})
        r = conn.getresponse()
        text = r.read()
    finally:
        conn.close()
    try:
        return r.status, json.loads(text)
    except ValueError:
        return r.status, {"text": text.decode(errors="replace")}


@pytest.fixture(scope="module")
def engine() -> Iterator[RecordingEngine]:
    e = RecordingEngine()
    yield e
    e.close()


@pytest.fixture(scope="module")
def front(engine) -> Iterator[Proc]:
    """A connector-mode proxy whose one encoder is down: every item goes as pixels."""
    dead = f"http://127.0.0.1:{free_port()}"
    p = proxy(engine.url, [dead], "connector", "--allow-host", ALLOWED).start()
    yield p
    p.stop()


def refused(front: Proc, engine: RecordingEngine, path: str, doc: object) -> dict:
    """The proxy's 4xx for `doc` at `path`; nothing reached the engine."""
    engine.take()
    status, answer = post(front, path, doc)
    assert 400 <= status < 500, (status, answer)
    assert engine.take() == []
    return answer["error"]


# Spellings of the chat route that uvicorn, starlette and httpx take to /v1/chat/completions.
SPELLINGS = [
    "///v1/chat/completions",
    "//v1/chat/completions",
    "/v1//chat/completions",
    "//v1//chat//completions",
    "/v1/chat/completions/",
    "/v1/chat/completions//",
    "/v1/./chat/completions",
    "/./v1/chat/completions",
    "/v1/x/../chat/completions",
    "/../v1/chat/completions",
    "/v1/chat%2Fcompletions",
    "/v1%2Fchat%2Fcompletions",
    "/%76%31/chat/completions",
    "/v1/%2e/chat/completions",
    "/v1/x/%2E%2E/chat/completions",
]


@pytest.mark.parametrize("path", SPELLINGS)
def test_a_chat_route_spelled_otherwise_is_checked(front, engine, path):
    part = {"type": "image_url", "image_url": {"url": FORBIDDEN}}
    error = refused(front, engine, path, body(part))
    assert error["type"] == "forbidden_url" and "--allow-host" in error["message"]


@pytest.mark.parametrize("path", SPELLINGS)
def test_a_chat_route_spelled_otherwise_reaches_the_engine_as_the_chat_route(front, engine, path):
    engine.take()
    status, _ = post(front, path, body({"type": "image_url", "image_url": {"url": PNG}}))
    assert status == 200
    (got,) = engine.take()
    assert (got.method, got.path) == ("POST", CHAT)
    sent = got.json()["messages"][0]["content"]
    assert sent == [{"type": "image_url", "image_url": {"url": PNG}}]


@pytest.mark.parametrize(
    "url",
    [
        f"http://169.254.169.254\\@{ALLOWED}/x.png",  # the allowed host to urllib and httpx
        f"http://{ALLOWED}\\@169.254.169.254/x.png",
        f"https://{ALLOWED}/x\\y.png",
    ],
)
def test_a_url_with_a_backslash_is_a_400(front, engine, url):
    """Parsers disagree on a backslash (RFC 3986 reads it inside the user info, WHATWG as the
    end of the host): such a URL is refused, never handed on."""
    error = refused(front, engine, CHAT, body({"type": "image_url", "image_url": {"url": url}}))
    assert error["type"] == "bad_url" and "backslash" in error["message"], error


def test_a_path_with_a_control_character_is_a_400(front, engine):
    error = refused(front, engine, "/v1/chat%0A/completions", body())
    assert error["type"] == "bad_path"


def test_other_routes_reach_the_engine_by_their_canonical_path(front, engine):
    engine.take()
    status, _ = post(front, "//v1//completions/?x=1", {"model": "m", "prompt": "hi"})
    assert status == 200
    (got,) = engine.take()
    assert got.path == "/v1/completions?x=1"


ROUTES_WITH_MEDIA = {
    "/v1/responses": {
        "model": "m",
        "input": [{"role": "user", "content": [{"type": "input_image", "image_url": FORBIDDEN}]}],
    },
    "/tokenize": body({"type": "image_url", "image_url": {"url": FORBIDDEN}}),
    "/v1/chat/completions/render": body({"type": "image_url", "image_url": {"url": FORBIDDEN}}),
    "/v1/embeddings": body({"type": "image_url", "image_url": {"url": FORBIDDEN}}),
    "/pooling": body({"type": "image_url", "image_url": {"url": FORBIDDEN}}),
    "/classify": body({"type": "image_url", "image_url": {"url": FORBIDDEN}}),
    "/v1/messages": {
        "model": "m",
        "max_tokens": 8,
        "messages": [
            {
                "role": "user",
                "content": [{"type": "image", "source": {"type": "url", "url": FORBIDDEN}}],
            }
        ],
    },
    "/v2/rerank": {
        "model": "m",
        "query": "q",
        "documents": {"content": [{"type": "image_url", "image_url": {"url": FORBIDDEN}}]},
    },
    "/v1/score": {
        "model": "m",
        "queries": "q",
        "documents": {"content": [{"type": "image_url", "image_url": {"url": FORBIDDEN}}]},
    },
    "/v2/embed": {"model": "m", "input_type": "image", "images": [FORBIDDEN]},
    "/invocations": body({"type": "image_url", "image_url": {"url": FORBIDDEN}}),
    "/inference/v1/generate": {
        "token_ids": [1],
        "sampling_params": {},
        "content_parts": [{"type": "image_url", "image_url": {"url": FORBIDDEN}}],
    },
}


@pytest.mark.parametrize("route", ROUTES_WITH_MEDIA)
def test_a_route_the_engine_reads_media_from_is_refused(front, engine, route):
    error = refused(front, engine, "/" + route, ROUTES_WITH_MEDIA[route])
    assert error["type"] == "route_refused"
    assert f"--pass-route {route}" in error["message"]


def test_an_operator_passes_a_media_route_unchecked(engine):
    dead = f"http://127.0.0.1:{free_port()}"
    p = proxy(engine.url, [dead], "connector", "--pass-route", "/v1/responses/").start()
    try:
        engine.take()
        status, _ = post(p, "/v1/responses", ROUTES_WITH_MEDIA["/v1/responses"])
        assert status == 200
        (got,) = engine.take()
        assert got.path == "/v1/responses"
        assert got.json() == ROUTES_WITH_MEDIA["/v1/responses"]
        status, _ = post(p, "/tokenize", ROUTES_WITH_MEDIA["/tokenize"])
        assert status == 403 and engine.take() == []
    finally:
        p.stop()


# Part forms vLLM 0.32's chat parser reads as media (renderers/chat_utils.py), each naming a URL
# the proxy refuses, or media it does not read.
FORMS = {
    "untyped_video_url": {"video_url": {"url": FORBIDDEN}},
    "untyped_image_url_string": {"image_url": FORBIDDEN},
    "input_image": {"type": "input_image", "image_url": FORBIDDEN},
    "text_with_uuid_and_image_url": {
        "type": "text",
        "text": "hi",
        "image_url": FORBIDDEN,
        "uuid": "u",
    },
    "video_url_with_uuid_read_by_image_url": {
        "type": "video_url",
        "video_url": {"url": PNG},
        "image_url": FORBIDDEN,
        "uuid": "u",
    },
    "unknown_type_with_uuid": {"type": "picture", "video_url": FORBIDDEN, "uuid": "u"},
    "audio_url": {"type": "audio_url", "audio_url": {"url": FORBIDDEN}},
    "untyped_audio_url": {"audio_url": FORBIDDEN},
    "input_audio": {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
    "image_pil_uuid_only": {"type": "image_pil", "image_pil": None, "uuid": "cafe@00"},
    "image_pil_string": {"image_pil": FORBIDDEN},
    "image_url_uuid_only": {"image_url": None, "uuid": "cafe@00"},
    "video_url_uuid_only": {"type": "video_url", "video_url": None, "uuid": "cafe@00"},
    "image_embeds": {
        "type": "image_embeds",
        "image_embeds": {"image_grid_thw": [1, 4, 4]},
        "uuid": "cafe@00",
    },
    "untyped_video_embeds": {"video_embeds": "AAAA", "uuid": "cafe@00"},
    "audio_embeds": {"type": "audio_embeds", "audio_embeds": "AAAA"},
    "prompt_embeds": {"type": "prompt_embeds", "data": "AAAA"},
    "untyped_prompt_embeds": {"prompt_embeds": "AAAA", "uuid": "u"},
}


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("role", ["user", "system", "assistant", "tool"])
def test_every_part_form_the_engine_reads_as_media_is_checked(front, engine, form, role):
    doc = {"model": "m", "messages": [{"role": role, "content": [FORMS[form]]}]}
    refused(front, engine, CHAT, doc)


def test_client_embeds_pass_when_the_operator_allows_them(engine):
    dead = f"http://127.0.0.1:{free_port()}"
    p = proxy(engine.url, [dead], "embeds", "--allow-client-embeds").start()
    try:
        engine.take()
        doc = body(FORMS["image_embeds"])
        assert post(p, CHAT, doc)[0] == 200
        (got,) = engine.take()
        assert got.json()["messages"] == doc["messages"]
    finally:
        p.stop()


SURROGATE = "\\ud800"  # valid JSON, no Unicode character


@pytest.mark.parametrize(
    "part",
    [
        '{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA%s"}}',
        '{"type": "image_url", "image_url": {"url": "http://media.test/%s.png"}}',
        '{"type": "image", "image": "/data/%s.png"}',
        '{"type": "image", "image": "file:///data/%s.png"}',
        '{"type": "video", "video": ["/data/a.png", "/data/%s.png"]}',
        '{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}, "x%s": 1}',
        '{"image_url": "data:image/png;base64,AAAA", "uuid": "%s"}',
    ],
)
def test_a_lone_surrogate_in_a_media_part_is_a_400(front, engine, part):
    raw = '{"model": "m", "messages": [{"role": "user", "content": [%s]}]}' % (part % SURROGATE)
    error = refused(front, engine, CHAT, raw.encode())
    assert error["code"] == 400 and "surrogate" in error["message"]


def test_a_number_that_is_not_finite_is_a_400(front, engine):
    raw = b'{"model": "m", "messages": [{"role": "user", "content": [{"type": "image", '
    raw += b'"image": "data:image/png;base64,AAAA", "max_pixels": Infinity}]}]}'
    error = refused(front, engine, CHAT, raw)
    assert error["code"] == 400


@pytest.mark.parametrize(
    ("part", "why"),
    [
        ({"type": "video", "video": [PNG, PNG]}, "a list of frames"),
        ({"type": "image", "image": "/data/cat.png"}, "local paths"),
        ({"type": "image", "image": "file:///data/cat.png"}, "local paths"),
        (
            {
                "type": "image_url",
                "image_url": {"url": PNG},
                "resized_height": 56,
                "resized_width": 56,
            },
            "resized_height, resized_width",
        ),
        (
            {
                "type": "video_url",
                "video_url": {"url": FORBIDDEN.replace("169.254.169.254", ALLOWED)},
                "fps": 1.0,
            },
            "fps",
        ),
    ],
)
def test_an_item_vllm_cannot_read_as_the_encoder_does_never_reaches_it(front, engine, part, why):
    """Every encoder is down: the item would go as pixels, and these cannot."""
    engine.take()
    status, answer = post(front, CHAT, body(part))
    assert status == 503, answer
    assert answer["error"]["type"] == "no_encoder" and why in answer["error"]["message"]
    assert engine.take() == []


@pytest.mark.parametrize(
    ("part", "url"),
    [
        ({"type": "image", "image": PNG}, PNG),
        (
            {"type": "image", "base64": PNG.split(",")[1]},
            "data:image/*;base64," + PNG.split(",")[1],
        ),
        ({"image_url": PNG, "uuid": "client", "detail": "low"}, PNG),
        ({"type": "input_image", "image_url": PNG}, PNG),
        (
            {"type": "image_url", "image_url": {"url": "DATA:Image/PNG;charset=x;BASE64,AAAA"}},
            "data:image/png;base64,AAAA",
        ),
        (
            {"type": "video_url", "video_url": {"url": "data:video/jpeg;base64,AAAA"}},
            "data:video/*;base64,AAAA",
        ),
        (
            {"type": "image_url", "image_url": {"url": f"http://{ALLOWED}/a.png"}},
            f"http://{ALLOWED}/a.png",
        ),
    ],
)
def test_an_item_as_pixels_is_built_from_its_checked_source_alone(front, engine, part, url):
    engine.take()
    status, answer = post(front, CHAT, body(part))
    assert status == 200, answer
    (got,) = engine.take()
    (sent,) = got.json()["messages"][0]["content"]
    kind = "video_url" if "video" in url else "image_url"
    assert sent == {"type": kind, kind: {"url": url}}


def test_health_is_open_and_names_no_address_and_metrics_can_ask_for_the_key(engine):
    dead = f"http://127.0.0.1:{free_port()}"
    p = proxy(engine.url, [dead], "connector", "--private-metrics", MMFERRY_API_KEY="k").start()
    try:
        r = httpx.get(f"{p.url}/health", timeout=10)
        assert r.status_code == 200
        assert r.json()["encoders"] == {"up": 1, "down": 0} or r.json()["encoders"] == {
            "up": 0,
            "down": 1,
        }
        assert engine.url.split("//")[1] not in r.text and dead.split("//")[1] not in r.text
        assert httpx.get(f"{p.url}/metrics", timeout=10).status_code == 401
        r = httpx.get(f"{p.url}/metrics", headers={"Authorization": "Bearer k"}, timeout=10)
        assert r.status_code == 200 and "mmferry_proxy_requests_total" in r.text
    finally:
        p.stop()


def _held_unless_marked(body: dict) -> Answer:
    """An encoder that holds every image (4 tokens) except the one marked "unserved", for which
    it answers what no encoder would (that item then has no encoder left). It takes one part a
    call: a call of several is refused as a whole (as an encoder's item limit would), so the
    proxy sends them one by one."""
    if len(body["content"]) > 1:
        return js({"error": {"kind": "too_many_items", "message": "1 item a request"}}, 422)
    (part,) = body["content"]
    if "unserved" in json.dumps(part):
        return html()
    facts = {"modality": "image", "hash": "h0", "grid_thw": [1, 4, 4], "num_tokens": 4}
    return js({"items": [{**facts, "timestamps": None, "second_per_grid_t": None, "held": True}]})


@pytest.fixture(scope="module")
def half_held(engine) -> Iterator[Proc]:
    with LyingService() as liar:
        liar.answer("encode", _held_unless_marked)
        p = proxy(engine.url, [liar.url], "connector").start()
        yield p
        p.stop()


UNSERVED = {"type": "image_url", "image_url": {"url": data_url(image(28, 28, 1)) + "/unserved"}}


def test_a_held_item_with_keys_never_goes_as_pixels_under_its_uuid(half_held, engine):
    """The held item's uuid names rows at its keyed size (4 tokens); vLLM would plan its own
    size from the pixels, without the keys, and its connector's load would not fit."""
    engine.take()
    keyed = {"type": "image", "image": PNG, "resized_height": 28, "resized_width": 28}
    status, answer = post(half_held, CHAT, body(keyed, UNSERVED))
    assert status == 503, answer
    message = answer["error"]["message"]
    assert "message 0 part 1 could not be encoded" in message
    assert "message 0 part 0 cannot go to the engine as pixels" in message
    assert "resized_height, resized_width" in message
    assert engine.take() == []


def test_a_held_item_without_keys_goes_as_pixels_under_its_uuid(half_held, engine):
    engine.take()
    status, answer = post(half_held, CHAT, body({"type": "image", "image": PNG}, UNSERVED))
    assert status == 200, answer
    (got,) = engine.take()
    held, unserved = got.json()["messages"][0]["content"]
    assert held["type"] == "image_url" and held["image_url"] == {"url": PNG}
    assert held["uuid"].startswith("h0@") and set(held) == {"type", "image_url", "uuid"}
    assert unserved == UNSERVED


@pytest.mark.parametrize(
    "options",
    [{"mm_processor_kwargs": {"max_pixels": 3136}}, {"media_io_kwargs": {"video": {"fps": 1}}}],
)
def test_engine_media_options_the_encoders_do_not_apply_are_a_422(front, engine, options):
    doc = {**body({"type": "image_url", "image_url": {"url": PNG}}), **options}
    error = refused(front, engine, CHAT, doc)
    assert error["code"] == 422 and next(iter(options)) in error["message"]
