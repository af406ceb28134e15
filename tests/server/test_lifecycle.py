"""Backpressure and shutdown: a full queue answers 503; SIGTERM drains and exits 0."""

from __future__ import annotations

import base64
import http.server
import json
import os
import signal
import threading
from functools import partial

import httpx
import pytest

from mmferry.server.client import EncodeError, EncoderClient, image_part, path_part

from .conftest import png, start_server


class StalledUpload:
    """A request whose body arrives in two halves, the second only when released.

    While the first half is in, the request is admitted and in flight; nothing is mocked.
    """

    def __init__(self, url: str, body: bytes) -> None:
        self.release = threading.Event()
        self.sent_half = threading.Event()
        self.response: httpx.Response | None = None
        half = len(body) // 2

        def chunks():
            yield body[:half]
            self.sent_half.set()
            self.release.wait(60)
            yield body[half:]

        def post() -> None:
            self.response = httpx.post(
                f"{url}/v1/encode",
                content=chunks(),
                headers={"content-type": "application/json"},
                timeout=120,
            )

        self.thread = threading.Thread(target=post, daemon=True)
        self.thread.start()
        assert self.sent_half.wait(30)

    def finish(self) -> httpx.Response:
        self.release.set()
        self.thread.join(120)
        assert self.response is not None
        return self.response


def _wait_in_flight(url: str, n: int) -> None:
    for _ in range(500):
        if httpx.get(f"{url}/health").json()["in_flight"] == n:
            return
        threading.Event().wait(0.02)
    raise AssertionError(f"in_flight never reached {n}")


def test_full_queue_503_then_sigterm_drains_and_exits_0(tmp_path):
    server = start_server(["--max-queue", "1", "--shm-mib", "4"])
    try:
        data = png(64, 64, seed=42)
        with EncoderClient(server.url) as c:
            # An shm response, so the server's own segment exists and can be checked after.
            c.encode([image_part(data, "image/png")], shm=True)
            segment = httpx.get(f"{server.url}/health").json()["shm_segment"]
            assert segment and os.path.exists(f"/dev/shm{segment}")
            url = f"data:image/png;base64,{base64.b64encode(data).decode()}"
            body = json.dumps({"content": [{"type": "image_url", "image_url": {"url": url}}]})
            slow = StalledUpload(server.url, body.encode())
            _wait_in_flight(server.url, 1)

            with pytest.raises(EncodeError) as full:
                c.encode([image_part(data, "image/png")])
            assert full.value.status == 503 and "--max-queue" in full.value.message
            r = httpx.post(f"{server.url}/v1/encode", json={"content": []})
            assert r.status_code == 503 and r.headers["retry-after"] == "1"

            server.proc.send_signal(signal.SIGTERM)
            for _ in range(500):  # the flag is set by the signal handler, shortly
                if httpx.get(f"{server.url}/health").json()["status"] == "draining":
                    break
                threading.Event().wait(0.02)
            with pytest.raises(EncodeError) as draining:
                c.encode([image_part(data, "image/png")])
            assert draining.value.status == 503 and "shutting down" in draining.value.message

            done = slow.finish()  # the admitted request still completes
            assert done.status_code == 200, done.text
            assert done.headers["content-type"] == "application/vnd.mmferry.safetensors"
        assert server.proc.wait(timeout=60) == 0
        assert not os.path.exists(f"/dev/shm{segment}")
    finally:
        server.stop()


def test_remote_urls_only_from_allowed_hosts(tmp_path):
    (tmp_path / "cat.png").write_bytes(png(48, 48, seed=5))
    handler = partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    files = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=files.serve_forever, daemon=True).start()
    host = f"127.0.0.1:{files.server_address[1]}"
    server = start_server(["--allow-host", host, "--shm-mib", "0"])
    try:
        with EncoderClient(server.url) as c:
            (item,) = c.encode([image_part(f"http://{host}/cat.png")])
            (inline,) = c.encode([image_part(tmp_path / "cat.png")])
            assert item.hash == inline.hash and item.num_tokens == inline.num_tokens
            with pytest.raises(EncodeError) as e:
                c.encode([image_part(f"http://localhost:{files.server_address[1]}/cat.png")])
            assert e.value.status == 403
            with pytest.raises(EncodeError) as e:  # no --allow-path at all
                c.encode([path_part(tmp_path / "cat.png")])
            assert e.value.status == 403
            with pytest.raises(EncodeError) as e:  # --shm-mib 0
                c.encode([image_part(tmp_path / "cat.png")], shm=True)
            assert e.value.status == 422 and "shm" in e.value.message
    finally:
        server.stop()
        files.shutdown()
