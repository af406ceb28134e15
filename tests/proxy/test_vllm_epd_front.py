"""The benchmark's vLLM EPD front (mmferry/bench/_vllm_epd.py) as a real process between
recording upstreams: each media part to an encoder alone (one token, not streamed), the encoders
taken round-robin, the original body to the PD server byte for byte and its stream relayed; an
encoder that cannot be reached is a 502 and nothing reaches PD. The whole set-up with real vLLMs
runs in examples/bench_proxy.py, whose first check is that it answers as a plain vLLM does."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from mmferry.testing.ports import free_port
from tests.proxy.procs import Proc, send_json

STREAM = b'data: {"choices": [{"delta": {"content": "hi"}}]}\n\ndata: [DONE]\n\n'


class Recorder(ThreadingHTTPServer):
    """An upstream that keeps every body it is sent and answers 200."""

    def __init__(self) -> None:
        self.bodies: list[bytes] = []
        super().__init__(("127.0.0.1", 0), _Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _Handler(BaseHTTPRequestHandler):
    def log_message(self, *args: object) -> None:
        pass

    def do_POST(self) -> None:  # noqa: N802 - the stdlib's name
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.server.bodies.append(body)
        if json.loads(body).get("stream"):
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Content-Length", str(len(STREAM)))
            self.end_headers()
            self.wfile.write(STREAM)
        else:
            send_json(self, b'{"choices": []}')


@pytest.fixture
def upstreams() -> Iterator[list[Recorder]]:
    servers = [Recorder() for _ in range(3)]
    yield servers
    for s in servers:
        s.shutdown()
        s.server_close()


def front(encoders: list[str], pd: str) -> Proc:
    args = [a for url in encoders for a in ("--encoder", url)] + ["--pd", pd]
    return Proc(args, module="mmferry.bench._vllm_epd").start()


def image(i: int) -> dict:
    return {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{i}"}}


def test_parts_round_robin_then_pd(upstreams: list[Recorder]) -> None:
    e0, e1, pd = upstreams
    content = [{"type": "text", "text": "x"}, *map(image, range(3))]
    body = {"model": "m", "messages": [{"role": "user", "content": content}], "stream": True}
    raw = json.dumps(body).encode()
    proc = front([e0.url, e1.url], pd.url)
    try:
        r = httpx.post(f"{proc.url}/v1/chat/completions", content=raw, timeout=30)
    finally:
        proc.stop()
    assert r.status_code == 200 and r.content == STREAM
    sent = [json.loads(b) for b in e0.bodies + e1.bodies]

    def parts(bodies: list[bytes]) -> list[str]:
        # NOTE: the parts go out at once, so an encoder may receive its parts in any order.
        return sorted(
            json.loads(b)["messages"][0]["content"][0]["image_url"]["url"] for b in bodies
        )

    assert parts(e0.bodies) == [image(0)["image_url"]["url"], image(2)["image_url"]["url"]]
    assert parts(e1.bodies) == [image(1)["image_url"]["url"]]
    assert all(len(m["messages"][0]["content"]) == 1 for m in sent)  # one image a part
    assert all(m["max_tokens"] == 1 and m["stream"] is False for m in sent)
    assert pd.bodies == [raw]


def test_unreachable_encoder_is_502(upstreams: list[Recorder]) -> None:
    e0, _, pd = upstreams
    dead = f"http://127.0.0.1:{free_port()}"
    body = {"model": "m", "messages": [{"role": "user", "content": [image(0), image(1)]}]}
    proc = front([e0.url, dead], pd.url)
    try:
        r = httpx.post(f"{proc.url}/v1/chat/completions", json=body, timeout=30)
        text = httpx.post(
            f"{proc.url}/v1/chat/completions",
            json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
            timeout=30,
        )
    finally:
        proc.stop()
    assert r.status_code == 502, r.text
    assert dead in r.json()["error"]["message"]
    # Text-only requests need no encoder: only that one reached PD.
    assert text.status_code == 200 and len(pd.bodies) == 1
