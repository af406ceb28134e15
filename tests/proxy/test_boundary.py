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

import pytest

from tests.engines.service import free_port
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


def test_a_path_with_a_control_character_is_a_400(front, engine):
    error = refused(front, engine, "/v1/chat%0A/completions", body())
    assert error["type"] == "bad_path"


def test_other_routes_reach_the_engine_by_their_canonical_path(front, engine):
    engine.take()
    status, _ = post(front, "//v1//completions/?x=1", {"model": "m", "prompt": "hi"})
    assert status == 200
    (got,) = engine.take()
    assert got.path == "/v1/completions?x=1"
