"""`mmferry proxy` reads its POSTs through the server's one request path (server/intake.py)
and holds request headers to `--header-timeout`, over real HTTP: checked before anything
reaches an encoder or the engine, so neither runs here (their addresses refuse connections)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar
from urllib.parse import urlsplit

import httpx
import pytest

from mmferry.testing.ports import free_port
from tests.proxy.procs import Proc, proxy, scrape, send_json
from tests.server.test_connections import read_until_closed

HEADER_TIMEOUT_S = 1


@pytest.fixture(scope="module")
def front() -> Iterator[Proc]:
    dead = [f"http://127.0.0.1:{free_port()}" for _ in range(2)]
    p = proxy(dead[0], dead[1:], "embeds", "--header-timeout", str(HEADER_TIMEOUT_S)).start()
    yield p
    p.stop()


def test_a_chat_body_that_is_not_json_is_a_415(front):
    path = "/v1/chat/completions"
    r = httpx.post(
        f"{front.url}{path}",
        content=b"model=m&prompt=hi",
        headers={"Content-Type": "application/x-www-form-urlencoded"},
        timeout=30,
    )
    assert r.status_code == 415, r.text
    assert r.json()["error"]["code"] == 415
    assert scrape(front.url, "mmferry_proxy_requests_total", route=path, status="415") >= 1


class _Recorder(BaseHTTPRequestHandler):
    """An upstream that keeps what reached it: method, path, content type, body bytes."""

    seen: ClassVar[list[tuple[str, str, str, bytes]]] = []

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.seen.append((self.command, self.path, self.headers.get("Content-Type", ""), body))
        send_json(self, b'{"ok": true}')

    def log_message(self, *args) -> None:
        pass


@pytest.mark.parametrize(
    ("path", "ctype", "body"),
    [
        ("/v1/completions", "application/json", b'{"model": "m",  "prompt": "hi"}'),
        ("/v1/audio/transcriptions", "multipart/form-data; boundary=x", b"--x\r\n\r\nhi\r\n--x--"),
        ("/v1/completions", "application/x-www-form-urlencoded", b"model=m&prompt=hi"),
    ],
)
def test_every_other_post_reaches_the_engine_byte_for_byte(path, ctype, body):
    upstream = ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    threading.Thread(target=upstream.serve_forever, daemon=True).start()
    llm = f"http://127.0.0.1:{upstream.server_address[1]}"
    # The upload route is one the engine reads media from: the operator passes it unchecked.
    passed = ("--pass-route", "/v1/audio/transcriptions")
    p = proxy(llm, [f"http://127.0.0.1:{free_port()}"], "embeds", *passed).start()
    try:
        _Recorder.seen.clear()
        r = httpx.post(f"{p.url}{path}", content=body, headers={"Content-Type": ctype}, timeout=30)
        assert r.status_code == 200, r.text
        assert r.json() == {"ok": True}
        assert _Recorder.seen == [("POST", path, ctype, body)]
    finally:
        p.stop()
        upstream.shutdown()


def test_headers_never_sent_are_a_408_within_the_header_timeout(front):
    split = urlsplit(front.url)
    before = scrape(front.url, "mmferry_proxy_errors_total", kind="header_timeout")
    t0 = time.monotonic()
    with socket.create_connection((split.hostname, split.port), timeout=30) as silent:
        silent.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")  # never ended
        answer = read_until_closed(silent)
    waited = time.monotonic() - t0
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert b"--header-timeout" in answer
    assert HEADER_TIMEOUT_S - 0.1 <= waited < HEADER_TIMEOUT_S + 5, waited
    assert scrape(front.url, "mmferry_proxy_errors_total", kind="header_timeout") == before + 1
