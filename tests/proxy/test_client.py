"""The proxy's HTTP client toward the engine (proxy/http.py): it keeps nothing of one client's
request for another's (no cookie jar), follows no redirect, and the body it writes carries the
client's values as they came (NaN, integers past 64 bits, lone surrogates: what orjson would
write otherwise or refuse)."""

from __future__ import annotations

import json
import math
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


@pytest.fixture(scope="module")
def front() -> Iterator[Proc]:
    with loopback_server(Engine) as engine:
        dead = f"http://127.0.0.1:{free_port()}"
        p = proxy(f"http://{engine}", [dead], "connector").start()
        try:
            yield p
        finally:
            p.stop()


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
