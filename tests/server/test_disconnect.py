"""A client that leaves a real `mmferry serve` before its answer stops the work queued for it:
its request is cancelled (counted as 499) and items not yet preprocessed are dropped."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest

from mmferry.server.client import path_part

from .conftest import Server, png, start_server
from .test_service import metric

ITEMS = 12
SIDE = 1280  # a decode of some 50 ms, so one preprocessing thread takes ITEMS of them in turn


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("large")
    for i in range(ITEMS):
        (d / f"{i:02d}.png").write_bytes(png(SIDE, SIDE, seed=i))
    return d


@pytest.fixture(scope="module")
def server(folder) -> Iterator[Server]:
    s = start_server(
        [
            *("--allow-path", str(folder), "--preprocess-threads", "1", "--shm-mib", "0"),
            *("--limit-items", str(ITEMS), "--limit-pixels", str(SIDE * SIDE)),
        ]
    )
    yield s
    s.stop()


def _preprocessed(url: str) -> float:
    return metric(url, "mmferry_stage_seconds_count" + '{stage="preprocess"}')


def test_a_client_gone_before_its_answer_drops_its_queued_items(server, folder):
    body = json.dumps({"content": [path_part(p) for p in sorted(folder.iterdir())]}).encode()
    split = urlsplit(server.url)
    head = (
        f"POST /v1/encode HTTP/1.1\r\nHost: {split.netloc}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    before = _preprocessed(server.url)
    with socket.create_connection((split.hostname, split.port), timeout=30) as client:
        client.sendall(head + body)
        deadline = time.monotonic() + 30
        while _preprocessed(server.url) == before and time.monotonic() < deadline:
            time.sleep(0.01)  # leave once the first item is done: the others queued behind it
    assert _preprocessed(server.url) > before, "nothing was preprocessed"
    deadline = time.monotonic() + 10
    while metric(server.url, 'mmferry_errors_total{kind="client_disconnect"}') < 1:
        assert time.monotonic() < deadline, "the request was not cancelled"
        time.sleep(0.05)
    time.sleep(1.0)  # what is still running finishes; nothing more starts
    done = _preprocessed(server.url) - before
    assert done < ITEMS / 2, f"{done} of {ITEMS} items were preprocessed for a client gone"
    health = httpx.get(f"{server.url}/health", timeout=10).json()
    assert health["in_flight"] == 0 and health["queue_depth"] == 0
