"""A remote image whose origin fails (an error status, a redirect, no answer, past the fetch
deadline) is the client's failure: the proxy answers the encoder's 502 `fetch_failed` or 504
`fetch_timeout` naming the client's part,
hands the engine nothing (vLLM would fetch the URL itself, and follow the redirect the encoder
refused), and leaves the encoder up for everyone else. Real processes over loopback: an origin
HTTP server, two `mmferry serve` on the tiny checkpoint, the proxy (connector and embeds mode),
a recording engine."""

from __future__ import annotations

import io
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler

import httpx
import pytest
from PIL import Image

from tests.engines.tiny_vlm import build_checkpoint, image
from tests.proxy.procs import Proc, RecordingEngine, encoder, loopback_server, proxy, scrape

METADATA = "http://169.254.169.254/latest/meta-data/iam"
FETCH_TIMEOUT_S = 1.0


def _png() -> bytes:
    buf = io.BytesIO()
    Image.fromarray(image(56, 84, 3)).save(buf, "PNG")
    return buf.getvalue()


class _Origin(BaseHTTPRequestHandler):
    png = _png()

    def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
        if self.path == "/ok.png":
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(len(self.png)))
            self.end_headers()
            self.wfile.write(self.png)
        elif self.path == "/moved.png":
            self.send_response(302)
            self.send_header("Location", METADATA)
            self.send_header("Content-Length", "0")
            self.end_headers()
        elif self.path == "/drop.png":
            self.close_connection = True  # no answer at all
        elif self.path == "/slow.png":
            time.sleep(FETCH_TIMEOUT_S + 2)  # past the encoder's --fetch-timeout
            self.send_error(404)
        else:
            self.send_error(404)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def origin() -> Iterator[str]:
    with loopback_server(_Origin) as host:
        yield host


@pytest.fixture(scope="module")
def encoders(origin, tmp_path_factory) -> Iterator[list[Proc]]:
    """Two encoders (an item failing on one would be tried on the other) that fetch `origin`."""
    model = build_checkpoint("qwen2_5_vl", tmp_path_factory.mktemp("model"))
    allow = ["--allow-host", origin, "--fetch-timeout", str(FETCH_TIMEOUT_S)]
    started = [Proc([*encoder(model).args, *allow]).start() for _ in range(2)]
    yield started
    for e in started:
        e.stop()


@pytest.fixture(scope="module", params=["connector", "embeds"])
def stack(request, origin, encoders) -> Iterator[tuple[Proc, RecordingEngine]]:
    engine = RecordingEngine({"id": "recorded", "choices": []})
    urls = [e.url for e in encoders]
    front = proxy(engine.url, urls, request.param, "--allow-host", origin).start()
    yield front, engine
    front.stop()
    engine.close()


def chat(front: Proc, *urls: str) -> httpx.Response:
    parts = [{"type": "text", "text": "hi"}]
    parts += [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    body = {"model": "m", "messages": [{"role": "user", "content": parts}]}
    return httpx.post(f"{front.url}/v1/chat/completions", json=body, timeout=60)


def test_an_image_the_origin_serves_reaches_the_engine_encoded(stack, origin):
    front, engine = stack
    engine.take()
    r = chat(front, f"http://{origin}/ok.png")
    assert r.status_code == 200, r.text
    (sent,) = engine.take()
    part = sent.json()["messages"][0]["content"][1]
    # Encoded: its grid named by its hash (connector mode) or its rows (embeds mode).
    assert part["type"] == "image_embeds" and part["image_embeds"]["image_grid_thw"] == [1, 4, 6]
    assert "@" in part["uuid"] or part["image_embeds"]["image_embeds"]


FAILING = {
    "/missing.png": (502, "fetch_failed"),
    "/moved.png": (502, "fetch_failed"),  # to the metadata address: never followed
    "/drop.png": (502, "fetch_failed"),
    "/slow.png": (504, "fetch_timeout"),
}


@pytest.mark.parametrize("path", list(FAILING))
def test_an_origin_that_fails_is_the_clients_answer_and_the_engine_gets_nothing(
    stack, origin, path
):
    """Alone, and second beside an image the origin serves: the whole request is refused."""
    front, engine = stack
    status, kind = FAILING[path]
    for urls, where in [
        ([f"http://{origin}{path}"], "message 0 part 1"),
        ([f"http://{origin}/ok.png", f"http://{origin}{path}"], "message 0 part 2"),
    ]:
        engine.take()
        failures = scrape(front.url, "mmferry_proxy_encoder_failures_total")
        r = chat(front, *urls)
        assert r.status_code == status, r.text
        error = r.json()["error"]
        assert error["type"] == kind and error["message"].startswith(where), error
        assert engine.take() == []  # the engine never got the URL to fetch itself
        assert scrape(front.url, "mmferry_proxy_encoder_failures_total") == failures
        health = httpx.get(f"{front.url}/health", timeout=10).json()["encoders"]
        assert health == {"up": 2, "down": 0}
