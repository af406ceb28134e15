"""The general guard of the proxy's media boundary: generated requests (paths in many spellings,
the engine's routes, messages in every role holding parts of every type and key combination,
with and without a uuid, nested and malformed) sent to real proxies in front of a recording
engine, with an allow-list of hosts, an operator-passed route, and an encoder that refuses
some items, fails others and holds the rest. Whatever the request:
- the proxy never answers 500, and a 5xx is only its documented 503 for an item that can
  neither be encoded nor sent as pixels;
- a refused request reaches the engine not at all, and no route the engine reads media from
  reaches it unless the operator passed it;
- every part of every message the engine gets that vLLM reads as media (tests/proxy/vllm_reads.py,
  held to vLLM's own parser by test_vllm_parts.py) is one the proxy built from a checked source:
  an `image_url` / `video_url` of a data: payload or an allowed host's URL, or a grid-and-uuid
  part of an item an encoder holds, with no key of the client's and no uuid the client chose.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any
from urllib.parse import unquote

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mmferry.proxy.paths import MEDIA_ROUTES
from mmferry.testing.ports import free_port
from tests.engines.lying_service import Answer, LyingService, html, js
from tests.proxy.procs import Proc, RecordingEngine, proxy
from tests.proxy.test_boundary import post
from tests.proxy.vllm_reads import CORPUS_KEYS, TYPES, reads

ALLOWED = "media.test"
PASSED = "/tokenize"
PNG = "data:image/png;base64,iVBORw0KGgo="
# Sources the encoder refuses (422) or fails on (the item goes as pixels), by a marker.
REFUSED_BY_ENCODER = "data:image/png;base64,cmVmdXNl"
FAILED_BY_ENCODER = "data:image/png;base64,ZmFpbGVk"
CLIENT_UUID = "client-chosen"
CHAT = "/v1/chat/completions"
ROUTES = [
    CHAT,
    "/v1/completions",
    "/v1/models",
    PASSED,
    "/v1/responses",
    "/v1/embeddings",
    "/pooling",
    "/v1/chat/completions/render",
    "/v1/messages",
    "/invocations",
    "/inference/v1/generate",
    "/health",
]
QWEN_KEYS = ["resized_height", "resized_width", "min_pixels", "max_pixels", "fps", "nframes"]
UUID = re.compile(r"^h[0-9]+@[0-9a-f]{32}$")


def _encoder(body: dict) -> Answer:
    """The encoder's answer to one item: a refusal, a failure, or the item held."""
    text = json.dumps(body)
    if REFUSED_BY_ENCODER in text:
        return js({"error": {"kind": "bad_media", "message": "part 0: cannot decode"}}, 422)
    if FAILED_BY_ENCODER in text:
        return html()
    (part,) = body["content"]
    video = "video" in json.dumps(sorted(part))  # the modality the proxy parsed it as
    facts = {
        "modality": "video" if video else "image",
        "hash": "h1",
        "grid_thw": [2, 4, 4] if video else [1, 4, 4],
        "num_tokens": 8 if video else 4,
        "timestamps": [0.0] if video else None,
        "second_per_grid_t": 1.0 if video else None,
        "held": True,
    }
    return js({"items": [facts]})


@pytest.fixture(scope="module")
def stack() -> Iterator[tuple[RecordingEngine, list[Proc]]]:
    engine = RecordingEngine()
    fronts: list[Proc] = []
    try:
        with LyingService() as encoder:
            encoder.answer("encode", _encoder)
            allow = ("--allow-host", ALLOWED, "--pass-route", PASSED)
            fronts.append(proxy(engine.url, [encoder.url], "connector", *allow).start())
            dead = f"http://127.0.0.1:{free_port()}"
            fronts.append(proxy(engine.url, [dead], "embeds", *allow).start())
            yield engine, fronts
    finally:
        for p in fronts:
            p.stop()
        engine.close()


# Sources: accepted, refused by the proxy (hosts, paths, schemes, types), refused or failed by
# the encoder, malformed, and no Unicode text.
SOURCES = st.sampled_from(
    [
        PNG,
        "data:video/mp4;base64,AAAA",
        "data:video/jpeg;base64,AAAA",
        f"http://{ALLOWED}/a.png",
        f"https://{ALLOWED.upper()}/v.mp4",
        "http://169.254.169.254/latest/meta-data",
        "http://media.test.evil/a.png",
        "/etc/hostname",
        "file:///etc/hostname",
        "ftp://media.test/a.png",
        "data:text/plain;base64,AAAA",
        REFUSED_BY_ENCODER,
        FAILED_BY_ENCODER,
        "\ud800",
        "",
    ]
)
VALUES = st.one_of(
    SOURCES,
    st.builds(lambda u: {"url": u}, SOURCES),
    st.builds(lambda u: {"url": {"url": u}}, SOURCES),
    st.lists(SOURCES, min_size=1, max_size=3),
    st.sampled_from([None, 5, 1.5, True, {}, [], {"data": "AAAA", "format": "wav"}]),
)


@st.composite
def parts(draw: st.DrawFn) -> Any:
    if draw(st.integers(0, 9)) == 0:
        return draw(st.sampled_from(["plain text", 5, None, ["nested"], [{"image_url": PNG}]]))
    part: dict[str, Any] = {}
    kind = draw(st.sampled_from(TYPES))
    if kind is not None:
        part["type"] = kind
    for key in draw(st.lists(st.sampled_from(CORPUS_KEYS), max_size=2, unique=True)):
        part[key] = draw(st.text(max_size=5) if key == "text" else VALUES)
    if draw(st.booleans()):
        part["uuid"] = draw(st.sampled_from([CLIENT_UUID, None, "h1@" + "0" * 32]))
    for key in draw(st.lists(st.sampled_from(QWEN_KEYS), max_size=2, unique=True)):
        part[key] = draw(st.sampled_from([56, 1.0, 0, -1, float("inf"), "2"]))
    if draw(st.integers(0, 5)) == 0:
        part["detail"] = "auto"
    return part


MESSAGES = st.lists(
    st.fixed_dictionaries(
        {
            "role": st.sampled_from(["user", "system", "assistant", "tool", "developer", "x"]),
            "content": st.one_of(st.lists(parts(), max_size=3), st.text(max_size=5)),
        }
    ),
    min_size=1,
    max_size=3,
)


@st.composite
def paths(draw: st.DrawFn) -> str:
    """A route in one of the spellings uvicorn, starlette and httpx take to it: extra slashes,
    `.` and `..` segments, a character or a slash percent-encoded, a trailing slash."""
    out = []
    for seg in draw(st.sampled_from(ROUTES)).strip("/").split("/"):
        out += draw(st.lists(st.sampled_from([".", "x/..", ""]), max_size=2))
        if draw(st.integers(0, 3)) == 0:
            i = draw(st.integers(0, len(seg) - 1))
            seg = seg[:i] + f"%{ord(seg[i]):02X}" + seg[i + 1 :]
        out.append(seg)
    sep = draw(st.sampled_from(["/", "//", "%2F"]))
    path = "/" * draw(st.integers(1, 3)) + out[0] + "".join(sep + s for s in out[1:])
    return path + "/" * draw(st.integers(0, 2))


def _route(received_path: str) -> str:
    """The route the engine runs for a path it received (as uvicorn and starlette route)."""
    return unquote(received_path.split("?")[0])


def _check_forwarded_part(part: Any, mode: str) -> None:
    kind = reads(part)
    if kind is None:
        return
    assert kind in ("image_url", "video_url", "image_embeds", "video_embeds"), part
    uuid = part.get("uuid")
    assert uuid is None or UUID.match(uuid), part  # never a uuid the client chose
    assert part.get("type") == kind and set(part) <= {"type", kind, "uuid"}, part
    if kind.endswith("_embeds"):
        payload = part[kind]
        if mode == "connector":
            assert uuid is not None and isinstance(payload, dict), part
            assert set(payload) <= {f"{kind[:5]}_grid_thw", "timestamps"}, part
        else:
            assert isinstance(payload, dict) and uuid is not None, part
        return
    url = part[kind]["url"]
    modality = kind.split("_")[0]
    assert isinstance(url, str), part
    if url.startswith("data:"):
        assert url.startswith(f"data:{modality}/"), part
        assert not url.startswith("data:video/jpeg"), part
    else:
        assert re.match(rf"^https?://{re.escape(ALLOWED)}/", url, re.IGNORECASE), part


@settings(
    max_examples=300,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(path=paths(), messages=MESSAGES, which=st.integers(0, 1), extra=st.booleans())
def test_nothing_the_proxy_refuses_reaches_the_engine(stack, path, messages, which, extra):
    engine, fronts = stack
    front, mode = fronts[which], ("connector", "embeds")[which]
    doc: dict[str, Any] = {"model": "m", "messages": messages}
    if extra:
        doc["input"] = messages  # the Responses API's and the embeddings' field
    engine.take()
    status, answer = post(front, path, json.dumps(doc).encode())
    got = engine.take()
    assert status != 500, answer
    if status >= 500:
        assert status == 503 and answer["error"]["type"] == "no_encoder", answer
    if status >= 400:
        assert got == [], (status, answer, got)
    for request in got:
        route = _route(request.path)
        assert route not in MEDIA_ROUTES or route == PASSED, route
        if route != CHAT:
            continue  # a route vLLM reads no media from, or one the operator passed
        body = request.json()
        for message in body.get("messages") or []:
            content = message.get("content") if isinstance(message, dict) else None
            for part in content if isinstance(content, list) else []:
                _check_forwarded_part(part, mode)
