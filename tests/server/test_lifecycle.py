"""Backpressure and shutdown: a full queue answers 503; SIGTERM drains in time and exits 0."""

from __future__ import annotations

import http.server
import os
import signal
import socket
import threading
import time
from functools import partial
from urllib.parse import urlsplit

import httpx
import pytest

from mmferry.server.client import EncodeError, EncoderClient, image_part, path_part

from .conftest import png, start_server
from .slow import RawUpload, SlowOrigin


def _wait_in_flight(url: str, n: int) -> None:
    for _ in range(500):
        if httpx.get(f"{url}/health").json()["in_flight"] == n:
            return
        threading.Event().wait(0.02)
    raise AssertionError(f"in_flight never reached {n}")


def test_full_queue_503_then_sigterm_drains_and_exits_0():
    # An admitted request held in flight by an origin that answers only when the gate opens.
    with SlowOrigin(png(64, 64, seed=42)) as origin:
        server = start_server(
            ["--max-queue", "1", "--shm-mib", "4", "--allow-host", origin.host]
            + ["--fetch-timeout", "120"]
        )
        try:
            _full_queue_then_drain(server, origin)
        finally:
            server.stop()


def _full_queue_then_drain(server, origin: SlowOrigin) -> None:
    data = png(64, 64, seed=42)
    with EncoderClient(server.url) as c:
        # An shm response, so the server's own segment exists and can be checked after.
        c.encode([image_part(data, "image/png")], shm=True)
        segment = httpx.get(f"{server.url}/health").json()["shm_segment"]
        assert segment and os.path.exists(f"/dev/shm{segment}")
        held: list[httpx.Response] = []
        body = {
            "content": [
                {"type": "image_url", "image_url": {"url": f"http://{origin.host}/gate.png"}}
            ]
        }
        admitted = threading.Thread(
            target=lambda: held.append(
                httpx.post(f"{server.url}/v1/encode", json=body, timeout=120)
            )
        )
        admitted.start()
        _wait_in_flight(server.url, 1)

        with pytest.raises(EncodeError) as full:
            c.encode([image_part(data, "image/png")])
        assert full.value.status == 503 and "--max-queue" in full.value.message
        r = httpx.post(f"{server.url}/v1/encode", json={"content": []})
        assert r.status_code == 503 and r.headers["retry-after"] == "1"

        server.proc.send_signal(signal.SIGTERM)
        for _ in range(500):  # the flag is set by the signal handler, shortly
            health = httpx.get(f"{server.url}/health")
            if health.json()["status"] == "draining":
                break
            threading.Event().wait(0.02)
        # A load balancer must stop sending here: the health check fails while draining.
        assert health.status_code == 503
        assert c.health()["status"] == "draining"  # the client still reads the document
        with pytest.raises(EncodeError) as draining:
            c.encode([image_part(data, "image/png")])
        assert draining.value.status == 503 and "shutting down" in draining.value.message

        origin.gate.set()  # the admitted request still completes
        admitted.join(120)
        (done,) = held
        assert done.status_code == 200, done.text
        assert done.headers["content-type"] == "application/vnd.mmferry.safetensors"
    assert server.proc.wait(timeout=60) == 0
    assert not os.path.exists(f"/dev/shm{segment}")


def test_sigterm_drains_within_its_timeout_despite_stalled_uploads():
    drain_s = 12  # long enough that exiting after it has seconds to spare on a busy machine
    server = start_server(["--drain-timeout", str(drain_s), "--body-timeout", "120"])
    try:
        stalled = [RawUpload(server.url) for _ in range(3)]
        for _ in range(500):
            if httpx.get(f"{server.url}/health").json().get("reading") == len(stalled):
                break
            threading.Event().wait(0.02)
        t0 = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        # Uploads still coming in at the drain deadline are cut: 503, and the process exits.
        assert [u.status() for u in stalled] == [503] * len(stalled)
        assert server.proc.wait(timeout=60) == 0
        # Not twice the drain timeout (the drain, then uvicorn's own graceful wait).
        assert time.monotonic() - t0 < 2 * drain_s - 1
    finally:
        server.stop()


def test_listening_is_printed_once_the_socket_accepts():
    server = start_server(["--shm-mib", "0"])
    try:
        # At once, no retry: the line is the signal that clients may connect.
        split = urlsplit(server.url)
        socket.create_connection((split.hostname, split.port), timeout=10).close()
        assert httpx.get(f"{server.url}/health").status_code == 200
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
