"""Many slow or heavy clients against a real `mmferry serve`: a deadline for the request
headers, a cap on uploads in progress, and JSON bodies that never stall the event loop."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from urllib.parse import urlsplit

import httpx
import pytest

from .conftest import Server, start_server
from .slow import RawUpload
from .test_service import metric

HEADER_TIMEOUT_S = 2
MAX_UPLOADS = 2
SLOW_S = 8  # well past the header deadline, well before the body deadline


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    s = start_server(
        [
            *("--shm-mib", "0", "--header-timeout", str(HEADER_TIMEOUT_S)),
            *("--max-uploads", str(MAX_UPLOADS), "--body-timeout", "60"),
        ]
    )
    yield s
    s.stop()


def _connect(url: str) -> socket.socket:
    split = urlsplit(url)
    return socket.create_connection((split.hostname, split.port), timeout=30)


def read_until_closed(sock: socket.socket) -> bytes:
    """What the server sends until it closes (b'' when it closes without answering)."""
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    return data


def test_headers_must_arrive_within_the_header_timeout(server):
    before = metric(server.url, 'mmferry_errors_total{kind="header_timeout"}')
    silent = _connect(server.url)  # sends nothing at all
    dripping = _connect(server.url)  # sends its headers a byte at a time
    t0 = time.monotonic()
    stop = threading.Event()

    def drip() -> None:
        try:
            for byte in b"POST /v1/cache/lookup HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * 1000:
                if stop.wait(0.2):
                    return
                dripping.sendall(bytes([byte]))
        except OSError:
            pass  # the server closed the connection

    threading.Thread(target=drip, daemon=True).start()
    try:
        for sock in (silent, dripping):
            answer = read_until_closed(sock)
            assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
            assert b"--header-timeout" in answer
        assert time.monotonic() - t0 < SLOW_S
    finally:
        stop.set()
        silent.close()
        dripping.close()
    assert metric(server.url, 'mmferry_errors_total{kind="header_timeout"}') >= before + 2
    # A kept-alive connection is timed again from its next request's first byte.
    with httpx.Client(base_url=server.url, timeout=30) as c:
        assert c.post("/v1/cache/lookup", json={"hashes": ["h"]}).status_code == 200
        time.sleep(HEADER_TIMEOUT_S + 0.5)
        assert c.post("/v1/cache/lookup", json={"hashes": ["h"]}).status_code == 200


def test_uploads_in_progress_are_capped(server):
    stalled = [
        RawUpload(server.url, path="/v1/cache/lookup", first=b'{"hashes": [')
        for _ in range(MAX_UPLOADS)
    ]
    try:
        _wait_for(lambda: _health(server.url)["reading"] == MAX_UPLOADS, "the uploads to start")
        r = httpx.post(f"{server.url}/v1/cache/lookup", json={"hashes": ["h"]}, timeout=30)
        assert r.status_code == 503, r.text
        assert r.json()["error"]["kind"] == "uploads_full" and r.headers["retry-after"] == "1"
        assert "--max-uploads" in r.json()["error"]["message"]
    finally:
        for u in stalled:
            u.sock.close()
    _wait_for(lambda: _health(server.url)["reading"] == 0, "the uploads to end")
    r = httpx.post(f"{server.url}/v1/cache/lookup", json={"hashes": ["h"]}, timeout=30)
    assert r.status_code == 200


def test_a_large_json_body_does_not_stall_other_requests(server):
    """30 MiB of ten million empty objects, while /health is asked every 20 ms: no answer
    waits for the body (parsed on the event loop, it held every request 4-9 s)."""
    body = b"[" + b"{}," * (10 << 20) + b"{}]"
    done = threading.Event()
    answers: list[httpx.Response] = []

    def post() -> None:
        try:
            answers.append(
                httpx.post(
                    f"{server.url}/v1/cache/lookup",
                    content=body,
                    headers={"content-type": "application/json"},
                    timeout=120,
                )
            )
        finally:
            done.set()

    with httpx.Client(base_url=server.url, timeout=30) as c:
        c.get("/health")
        threading.Thread(target=post, daemon=True).start()
        waits = []
        while not done.is_set():
            t0 = time.monotonic()
            c.get("/health")
            waits.append(time.monotonic() - t0)
            time.sleep(0.02)
    (r,) = answers
    assert r.status_code == 400 and "too many" in r.json()["error"]["message"], r.text[:300]
    assert max(waits) < 1.0, sorted(waits)[-5:]


def _health(url: str) -> dict:
    return httpx.get(f"{url}/health", timeout=30).json()


def _wait_for(predicate, what: str, timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")
