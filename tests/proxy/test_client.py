"""The proxy's HTTP client toward the engine (proxy/http.py): it keeps nothing of one client's
request for another's (no cookie jar), follows no redirect, and the body it writes carries the
client's values as they came (NaN, integers past 64 bits, lone surrogates: what orjson would
write otherwise or refuse)."""

from __future__ import annotations

import json
import math
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from typing import Any

import httpx
import pytest

from mmferry.testing.ports import free_port
from tests.proxy.procs import Proc, loopback_server, proxy

CHAT = "/v1/chat/completions"


class Engine(BaseHTTPRequestHandler):
    """Answers every request with a cookie (a chat request) or a redirect (any other path), and
    records each request's Cookie header and body."""

    seen: list[tuple[str, str | None, bytes]] = []

    def do_POST(self) -> None:  # noqa: N802
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        Engine.seen.append((self.path, self.headers.get("Cookie"), body))
        if self.path == CHAT:
            answer = b'{"id": "x"}'
            self.send_response(200)
            self.send_header("Set-Cookie", "session=first-clients-secret; Path=/")
            self.send_header("Content-Type", "application/json")
        else:
            answer = b""
            self.send_response(307)
            self.send_header("Location", CHAT)
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def log_message(self, *args: Any) -> None:
        pass


def _front(engine_handler: type[BaseHTTPRequestHandler]) -> Iterator[Proc]:
    """The proxy in front of an engine answering with `engine_handler` (no encoder up)."""
    with loopback_server(engine_handler) as engine:
        dead = f"http://127.0.0.1:{free_port()}"
        p = proxy(f"http://{engine}", [dead], "connector").start()
        try:
            yield p
        finally:
            p.stop()


@pytest.fixture(scope="module")
def front() -> Iterator[Proc]:
    yield from _front(Engine)


def text_body(**extra: Any) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **extra}


def test_no_cookie_of_one_client_reaches_another_clients_request(front):
    Engine.seen.clear()
    first = httpx.post(front.url + CHAT, json=text_body(), timeout=30)
    assert first.status_code == 200
    assert "first-clients-secret" in first.headers.get("set-cookie", "")  # the client's own
    second = httpx.post(front.url + CHAT, json=text_body(), timeout=30)
    assert second.status_code == 200
    assert [cookie for _, cookie, _ in Engine.seen] == [None, None]


def test_an_engines_redirect_goes_to_the_client_unfollowed(front):
    Engine.seen.clear()
    r = httpx.post(front.url + "/v1/other", json={}, timeout=30)
    assert r.status_code == 307 and r.headers["location"] == CHAT
    assert [path for path, _, _ in Engine.seen] == ["/v1/other"]


def test_the_body_the_engine_gets_has_the_clients_values(front):
    Engine.seen.clear()
    raw = json.dumps(text_body(top_p="NAN", temperature="MINUS_INF", seed=10**30, user="\ud800x"))
    raw = raw.replace('"NAN"', "NaN").replace('"MINUS_INF"', "-Infinity")
    r = httpx.post(
        front.url + CHAT,
        content=raw.encode(),
        headers={"Content-Type": "application/json"},
        timeout=30,
    )
    assert r.status_code == 200, r.text
    ((_, _, got),) = Engine.seen
    sent = json.loads(got)
    assert math.isnan(sent["top_p"]) and sent["temperature"] == -math.inf
    assert sent["seed"] == 10**30 and type(sent["seed"]) is int
    assert sent["user"] == "\ud800x"
    assert sent["messages"] == text_body()["messages"]


class Streams(BaseHTTPRequestHandler):
    """A chat answer whole (JSON with its length), or on `/v1/events` two server-sent events,
    the second only once the test has seen the first (`released`), or 204 on `/v1/empty`."""

    released = threading.Event()

    def do_POST(self) -> None:  # noqa: N802
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if self.path == "/v1/empty":
            self.send_response(204)
            self.end_headers()
            return
        if self.path != "/v1/events":
            answer = b'{"id": "whole", "choices": []}'
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()  # HTTP/1.0: the body ends when the connection closes
        self.wfile.write(b"data: 1\n\n")
        self.wfile.flush()
        Streams.released.wait(10)
        self.wfile.write(b"data: 2\n\n")

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def streams() -> Iterator[Proc]:
    yield from _front(Streams)


def test_a_whole_answer_goes_out_with_its_length(streams):
    r = httpx.post(streams.url + CHAT, json=text_body(), timeout=30)
    assert r.status_code == 200
    assert r.content == b'{"id": "whole", "choices": []}'
    assert r.headers["content-length"] == str(len(r.content))
    assert "transfer-encoding" not in r.headers
    r = httpx.post(streams.url + "/v1/empty", json={}, timeout=30)
    assert r.status_code == 204 and r.content == b""
    assert "content-length" not in r.headers


def test_a_stream_goes_out_as_it_arrives(streams):
    Streams.released.clear()
    with httpx.stream("POST", streams.url + "/v1/events", json={}, timeout=30) as r:
        assert r.status_code == 200
        chunks = r.iter_raw()
        first = next(chunks)
        # Held back until the client has the first event: a proxy that waited for the whole
        # answer would hand over both at once, ten seconds later.
        assert first == b"data: 1\n\n"
        Streams.released.set()
        assert b"".join(chunks) == b"data: 2\n\n"
    assert "content-length" not in r.headers
