"""A client that leaves `mmferry proxy` before its answer starts stops the work done for it: the
encoders' requests for its items are closed while they encode, and the engine's request is closed
while the engine computes or while the proxy holds a stream back before its first token. Real
processes over loopback: the proxy, a scripted encoder (tests/engines/lying_service.py) and an
engine that notes when the proxy closes its request's connection."""

from __future__ import annotations

import json
import select
import socket
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from typing import ClassVar
from urllib.parse import urlsplit

import httpx
import pytest

from tests.engines.lying_service import Answer, LyingService, js
from tests.engines.tiny_vlm import image
from tests.proxy.conftest import image_part
from tests.proxy.procs import Proc, loopback_server, proxy, scrape, send_json

HOLD_S = 20.0  # how long the encoder and the engine hold their answers back
PROMPT_S = 2.0  # the upstream request closed within this of the client leaving
FACTS = {"modality": "image", "hash": "h0", "grid_thw": [1, 4, 6], "num_tokens": 6, "held": True}
PREAMBLE = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
TOKEN = {"choices": [{"index": 0, "delta": {"content": "Hi"}, "finish_reason": "stop"}]}


class _Engine(BaseHTTPRequestHandler):
    """The engine's place: a stream gets its role-only preamble at once, then nothing for
    HOLD_S; a plain answer nothing for HOLD_S. Notes when the proxy closes the connection."""

    seen: ClassVar[list[dict]] = []
    closed: ClassVar[list[float]] = []  # monotonic times the proxy closed a held request

    def do_POST(self) -> None:  # noqa: N802 - the stdlib's name
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.seen.append(body)
        if not body.get("stream"):
            if self._held():
                send_json(self, json.dumps({"id": "chatcmpl-late", "choices": []}).encode())
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Connection", "close")  # the stream ends with the connection
        self.end_headers()
        self.wfile.write(b"data: " + json.dumps(PREAMBLE).encode() + b"\n\n")
        self.wfile.flush()
        if self._held():
            self.wfile.write(b"data: " + json.dumps(TOKEN).encode() + b"\n\ndata: [DONE]\n\n")

    def _held(self) -> bool:
        """Waits HOLD_S; False (noted in `closed`) if the proxy closed the connection first."""
        readable = select.select([self.connection], [], [], HOLD_S)[0]
        if readable and not self.connection.recv(1, socket.MSG_PEEK):
            self.closed.append(time.monotonic())
            return False
        return True

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def engine() -> Iterator[str]:
    with loopback_server(_Engine) as host:
        yield f"http://{host}"


@pytest.fixture(scope="module")
def encoder() -> Iterator[LyingService]:
    with LyingService() as s:
        yield s


@pytest.fixture(scope="module")
def front(engine, encoder) -> Iterator[Proc]:
    """A connector-mode proxy: the encoded item goes by reference, so a stream is held back
    until its first token (to be sent again with pixels if the engine lacked the item)."""
    p = proxy(engine, [encoder.url], "connector").start()
    yield p
    p.stop()


def leave_after(front: Proc, path: str, body: dict, wait_s: float) -> float:
    """Sends `body` to `path`, reads nothing, and closes the connection after `wait_s`;
    returns when it closed (monotonic)."""
    split = urlsplit(front.url)
    raw = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {split.netloc}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(raw)}\r\n\r\n"
    )
    with socket.create_connection((split.hostname, split.port), timeout=30) as client:
        client.sendall(head.encode() + raw)
        time.sleep(wait_s)
        # NOTE: nothing of the answer may have come yet: the proxy is to notice the close
        # while it still waits on an encoder or the engine.
        assert not select.select([client], [], [], 0)[0], client.recv(200)
    return time.monotonic()


def settled(front: Proc) -> dict:
    """The proxy's /health once nothing is in flight (within PROMPT_S)."""
    deadline = time.monotonic() + PROMPT_S
    while True:
        health = httpx.get(f"{front.url}/health", timeout=10).json()
        if health["in_flight"] == 0 or time.monotonic() > deadline:
            return health
        time.sleep(0.05)


def chat(stream: bool) -> dict:
    content = [image_part(image(56, 84, 0)), {"type": "text", "text": "describe it"}]
    return {"model": "m", "messages": [{"role": "user", "content": content}], "stream": stream}


def gone_499(front: Proc, route: str) -> float:
    return scrape(front.url, "mmferry_proxy_requests_total", route=route, status="499")


def test_a_client_gone_while_its_items_encode_closes_the_encoders_request(front, encoder):
    encoder.answer("encode", Answer(200, json.dumps({"items": [FACTS]}).encode(), delay_s=HOLD_S))
    _Engine.seen.clear()
    before = gone_499(front, "/v1/chat/completions")
    asked = len(encoder.calls("encode"))
    left = leave_after(front, "/v1/chat/completions", chat(stream=False), 1.0)
    deadline = left + PROMPT_S
    while not encoder.gone and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(encoder.calls("encode")) == asked + 1  # it was encoding when the client left
    assert encoder.gone, "the encoder's request was still open"
    route, closed = encoder.gone.pop()
    assert route == "encode" and closed - left < PROMPT_S
    health = settled(front)
    assert health["in_flight"] == 0
    assert health["encoders"] == {"up": 1, "down": 0}  # a cancel is no failure of the encoder
    assert _Engine.seen == []  # nothing went on to the engine
    assert gone_499(front, "/v1/chat/completions") == before + 1


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", chat(stream=True)),  # held before its first token
        ("/v1/chat/completions", chat(stream=False)),  # the engine's answer not begun
        ("/v1/completions", {"model": "m", "prompt": "hi"}),  # any other route
    ],
    ids=["chat-stream-held", "chat", "other-route"],
)
def test_a_client_gone_before_the_engines_first_output_closes_the_engines_request(
    front, encoder, path, body
):
    encoder.answer("encode", js({"items": [FACTS]}))
    _Engine.closed.clear()
    _Engine.seen.clear()
    left = leave_after(front, path, body, 1.5)
    deadline = left + PROMPT_S
    while not _Engine.closed and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(_Engine.seen) == 1  # the engine had the request when the client left
    assert _Engine.closed, "the engine's request was still open"
    assert _Engine.closed[0] - left < PROMPT_S
    assert settled(front)["in_flight"] == 0
