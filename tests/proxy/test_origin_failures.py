"""A remote image whose origin fails (an error status, a redirect, nothing listening) is the
client's failure: the proxy answers the encoder's 502 `fetch_failed` naming the client's part,
hands the engine nothing (vLLM would fetch the URL itself, and follow the redirect the encoder
refused), and leaves the encoder up for everyone else. Real processes over loopback: an origin
HTTP server, one `mmferry serve` on the tiny checkpoint, the proxy, a recording engine."""

from __future__ import annotations

import io
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from PIL import Image

from tests.engines.tiny_vlm import build_checkpoint, image
from tests.proxy.procs import Proc, RecordingEngine, encoder, proxy, scrape

METADATA = "http://169.254.169.254/latest/meta-data/iam"


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
        else:
            self.send_error(404)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def origin() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Origin)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def stack(origin, tmp_path_factory) -> Iterator[tuple[Proc, Proc, RecordingEngine]]:
    model = build_checkpoint("qwen2_5_vl", tmp_path_factory.mktemp("model"))
    engine = RecordingEngine({"id": "recorded", "choices": []})
    enc = Proc([*encoder(model).args, "--allow-host", origin]).start()
    front = proxy(engine.url, [enc.url], "connector", "--allow-host", origin).start()
    yield front, enc, engine
    front.stop()
    enc.stop()
    engine.close()


def chat(front: Proc, url: str) -> httpx.Response:
    parts = [{"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": url}}]
    body = {"model": "m", "messages": [{"role": "user", "content": parts}]}
    return httpx.post(f"{front.url}/v1/chat/completions", json=body, timeout=60)


def test_an_image_the_origin_serves_reaches_the_engine_encoded(stack, origin):
    front, _, engine = stack
    engine.take()
    r = chat(front, f"http://{origin}/ok.png")
    assert r.status_code == 200, r.text
    (sent,) = engine.take()
    part = sent.json()["messages"][0]["content"][1]
    # Held by the encoder: its grid, named by its hash (vLLM's connector loads the rows).
    assert part["type"] == "image_embeds" and part["image_embeds"]["image_grid_thw"] == [1, 4, 6]
    assert "@" in part["uuid"]


@pytest.mark.parametrize("path", ["/missing.png", "/moved.png", "/drop.png"])
def test_an_origin_that_fails_is_the_clients_502_and_the_engine_gets_nothing(stack, origin, path):
    front, enc, engine = stack
    url = f"http://{origin}{path}"
    engine.take()
    failures = scrape(front.url, "mmferry_proxy_encoder_failures_total")
    r = chat(front, url)
    assert r.status_code == 502, r.text
    error = r.json()["error"]
    assert error["type"] == "fetch_failed", error
    assert error["message"].startswith("message 0 part 1"), error
    assert engine.take() == []  # the engine never got the URL to fetch itself
    assert scrape(front.url, "mmferry_proxy_encoder_failures_total") == failures
    assert httpx.get(f"{front.url}/health", timeout=10).json()["encoders"] == {"up": 1, "down": 0}
