"""The encoder-cache routes (`/v1/cache/...`) against hostile clients, over real HTTP to a real
`mmferry serve`: they read requests by the same path as /v1/encode (API key, 415, 499, the
drain, lingering close), every malformed body is a 4xx, and the encode route says when it could
not hold an item's rows."""

from __future__ import annotations

import base64
import copy
import json
import signal
import socket
import time
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest

from .conftest import API_KEY, Server, png, start_server
from .slow import RawUpload
from .test_service import metric

ROUTES = ("lookup", "load", "encode")
AUTH = {"Authorization": f"Bearer {API_KEY}"}
# Values of every JSON type, each wrong somewhere.
WRONG: list[Any] = [None, True, 0, -1, 1.5, "", "x", [], [None], [1], [[]], {}, {"a": 1}, [{}]]


def _image(seed: int = 1) -> dict:
    data = base64.b64encode(png(48, 40, seed)).decode()
    return {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{data}"}}


@pytest.fixture(scope="module")
def keyed() -> Iterator[Server]:
    s = start_server(["--shm-mib", "0", "--body-timeout", "3"], env={"MMFERRY_API_KEY": API_KEY})
    yield s
    s.stop()


def _post(url: str, route: str, body: Any, **headers: str) -> httpx.Response:
    return httpx.post(
        f"{url}/v1/cache/{route}",
        content=json.dumps(body).encode(),
        headers={"content-type": "application/json", **AUTH, **headers},
        timeout=120,
    )


def _set(doc: Any, path: tuple, value: Any) -> Any:
    """A copy of `doc` with the field at `path` set to `value` (removed for `...`)."""
    doc = copy.deepcopy(doc)
    if not path:
        return value
    parent = doc
    for key in path[:-1]:
        parent = parent[key]
    if value is ...:
        del parent[path[-1]]
    else:
        parent[path[-1]] = value
    return doc


def _fuzzed() -> Iterator[tuple[str, tuple, Any, Any]]:
    """(route, field path, value, body) for every field of every route set to each wrong value
    (and removed)."""
    msg = {"role": "user", "content": [{"type": "text", "text": "hi"}, _image(2)]}
    good = {
        "lookup": [({"hashes": ["h"]}, [("hashes",)])],
        "load": [
            (
                {"hashes": ["h"], "dtype": "float32", "response": "safetensors"},
                [("hashes",), ("hashes", 0), ("dtype",), ("response",)],
            )
        ],
        "encode": [
            (
                {"content": [_image()], "layout": "compact", "dtype": "float32", "wait": False},
                [
                    ("wait",),
                    ("content",),
                    ("content", 0),
                    ("content", 0, "type"),
                    ("content", 0, "image_url"),
                    ("content", 0, "image_url", "url"),
                    ("layout",),
                    ("dtype",),
                ],
            ),
            (
                {"messages": [msg]},
                [
                    ("messages",),
                    ("messages", 0),
                    ("messages", 0, "role"),
                    ("messages", 0, "content"),
                    ("messages", 0, "content", 0),
                    ("messages", 0, "content", 0, "text"),
                    ("messages", 0, "content", 1, "image_url"),
                ],
            ),
        ],
    }
    for route, docs in good.items():
        for doc, paths in docs:
            for value in WRONG:
                yield route, (), value, value
            for path in paths:
                for value in [*WRONG, ...]:
                    yield route, path, value, _set(doc, path, value)


def test_every_malformed_body_of_every_cache_route_is_a_4xx(keyed):
    r = _post(keyed.url, "load", {"hashes": ["h"], "dtype": ["float32"]})
    assert r.status_code == 422 and "dtype" in r.json()["error"]["message"], r.text
    answers: dict[int, int] = {}
    for route, path, value, body in _fuzzed():
        r = _post(keyed.url, route, body)
        answers[r.status_code] = answers.get(r.status_code, 0) + 1
        assert r.status_code < 500, (route, path, value, r.status_code, r.text[:300])
        if r.status_code != 200:
            assert r.json()["error"]["message"], (route, path, value)
    assert sum(n for s, n in answers.items() if 400 <= s < 500) > 300, answers
    assert metric(keyed.url, 'mmferry_errors_total{kind="internal"}') == 0
    assert "Traceback" not in "".join(keyed.lines)
    (item,) = _post(keyed.url, "encode", {"content": [_image(3)]}).json()["items"]
    assert item["held"] is True  # still serving


def test_cache_routes_refuse_a_wrong_content_type_with_a_415(keyed):
    for route in ROUTES:
        for ctype in ("text/plain", "application/json; charset=latin-1", ""):
            r = httpx.post(
                f"{keyed.url}/v1/cache/{route}",
                content=b'{"hashes": ["h"]}',
                headers={"content-type": ctype, **AUTH},
                timeout=30,
            )
            assert r.status_code == 415, (route, ctype, r.status_code, r.text[:200])


def test_a_client_gone_mid_upload_to_a_cache_route_is_a_499(keyed):
    for route in ROUTES:
        before = metric(keyed.url, 'mmferry_requests_total{status="499"}')
        seen = len(keyed.lines)
        gone = RawUpload(keyed.url, path=f"/v1/cache/{route}", headers=AUTH)
        _wait_for(lambda: _reading(keyed.url) >= 1, f"the {route} upload to start")
        gone.sock.close()
        _wait_for(
            lambda b=before: metric(keyed.url, 'mmferry_requests_total{status="499"}') > b,
            f"the {route} disconnect to be counted",
        )
        time.sleep(0.3)  # anything logged with it has reached the pipe by now
        assert "Traceback" not in "".join(keyed.lines[seen:]), route
    assert metric(keyed.url, 'mmferry_errors_total{kind="internal"}') == 0


def test_a_refusal_before_the_body_is_read_reaches_the_client(keyed):
    """A 401 is answered before the body is read. A client that sends its whole body before
    reading the answer must still get it: the service reads what the client is still
    sending before it closes (without that, the client's send fails on a closed connection
    and it never reads the 401)."""
    split = urlsplit(keyed.url)
    body = b'{"hashes": ["' + b"h" * (900 << 10) + b'"]}'
    for route in ROUTES:
        with socket.create_connection((split.hostname, split.port), timeout=30) as sock:
            head = (
                f"POST /v1/cache/{route} HTTP/1.1\r\nHost: {split.netloc}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
            )
            sock.sendall(head.encode() + body[:1000])
            time.sleep(0.3)  # the answer is written meanwhile
            sock.sendall(body[1000:])
            data = b""
            while chunk := sock.recv(65536):
                data += chunk
        assert data.startswith(b"HTTP/1.1 401"), (route, data[:100])


def test_a_drain_waits_for_a_cache_route_upload_in_progress():
    server = start_server(["--drain-timeout", "20", "--shm-mib", "0"])
    try:
        body = b'{"hashes": ["h1", "h2"]}'
        upload = RawUpload(server.url, declared=len(body), first=body[:5], path="/v1/cache/lookup")
        _wait_for(lambda: _reading(server.url) == 1, "the upload to start")
        server.proc.send_signal(signal.SIGTERM)
        _wait_for(lambda: _status(server.url) == "draining", "the drain to start")
        time.sleep(1.0)  # a drain that does not count the upload has ended by now
        assert server.proc.poll() is None
        upload.sock.sendall(body[5:])
        assert upload.status() == 200
        assert server.proc.wait(timeout=60) == 0
    finally:
        server.stop()


def test_cache_encode_says_when_it_could_not_hold_the_rows():
    """With no cache (and so no pin budget), /v1/cache/encode cannot keep the rows for a later
    load: each item says held false, and a lookup answers absent."""
    server = start_server(["--cache-mib", "0", "--shm-mib", "0"])
    try:
        r = httpx.post(
            f"{server.url}/v1/cache/encode", json={"content": [_image(4), _image(5)]}, timeout=120
        )
        assert r.status_code == 200, r.text
        items = r.json()["items"]
        assert [it["held"] for it in items] == [False, False]
        r = httpx.post(
            f"{server.url}/v1/cache/lookup", json={"hashes": [items[0]["hash"]]}, timeout=30
        )
        assert r.json() == {"present": [False], "pinned_s": [0.0], "pending": [False]}
    finally:
        server.stop()


def _health(url: str) -> dict:
    return httpx.get(f"{url}/health", timeout=30).json()


def _reading(url: str) -> int:
    return _health(url).get("reading", 0)


def _status(url: str) -> str:
    try:
        return _health(url)["status"]
    except httpx.HTTPError:
        return "gone"


def _wait_for(predicate, what: str, timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")
