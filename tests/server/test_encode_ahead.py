"""`/v1/cache/encode` with `"wait": false`: the answer comes once the items are preprocessed
and the tower runs behind it. Lookups say pending until the rows are held, then present (the
rows the items' own), or absent when the encode failed; the encode counts in the queue and the
drain until it ends."""

from __future__ import annotations

import asyncio
import base64
import signal
import threading
import time

import httpx
import torch

import mmferry as mf
from mmferry.encoder.model import VisionEncoder
from mmferry.models import spec_for
from mmferry.server.limits import Limits
from mmferry.server.service import EncoderService, ServiceConfig

from .conftest import DEPTH, IMAGE_MAX_PIXELS, png, start_server
from .test_cache_routes import _health, _status, _wait_for
from .test_service import metric


def _body(image: bytes) -> dict:
    url = "data:image/png;base64," + base64.b64encode(image).decode()
    return {"content": [{"type": "image_url", "image_url": {"url": url}}], "wait": False}


def _lookup(post, hashes: list[str]) -> dict:
    r = post("/v1/cache/lookup", json={"hashes": hashes})
    assert r.status_code == 200, r.text
    return r.json()


def test_the_answer_comes_ahead_of_the_rows_and_the_rows_follow():
    """Over real HTTP, the tower held back by the batcher's wait: the facts come before it
    runs, a lookup says pending (counted), a second encode finds the queue full (the first
    still counts), and once encoded the item is present and its rows are the item's own."""
    from safetensors.torch import load

    from mmferry.server.ec import packed

    hold_s = 4.0
    server = start_server(
        ["--batch-wait-ms", str(int(hold_s * 1000)), "--max-queue", "1", "--shm-mib", "0"]
    )
    try:
        url = server.url

        def post(route: str, **kw) -> httpx.Response:
            return httpx.post(url + route, timeout=120, **kw)

        image = png(48, 40, 11)
        started = time.monotonic()
        r = post("/v1/cache/encode", json=_body(image))
        answered_s = time.monotonic() - started
        assert r.status_code == 200, r.text
        (item,) = r.json()["items"]
        h = item["hash"]
        assert item["held"] is True and item["num_tokens"] > 0
        assert answered_s < hold_s, "the answer waited for the tower"
        assert _lookup(post, [h, "never-seen"]) == {
            "present": [False, False],
            "pinned_s": [0.0, 0.0],
            "pending": [True, False],
        }
        assert metric(url, 'mmferry_cache_lookups_total{answer="pending"}') == 1
        assert _health(url)["in_flight"] == 1
        r = post("/v1/cache/encode", json=_body(png(40, 40, 12)))
        assert r.status_code == 503 and r.json()["error"]["kind"] == "queue_full", r.text
        _wait_for(lambda: _lookup(post, [h])["present"] == [True], "the rows", timeout=120)
        assert _lookup(post, [h])["pending"] == [False]
        assert _health(url)["in_flight"] == 0
        r = post("/v1/cache/load", json={"hashes": [h]})
        assert r.status_code == 200, r.text
        proc = mf.Processor.for_model("qwen3-vl", image_max_pixels=IMAGE_MAX_PIXELS)
        enc = mf.VisionEncoder.random(config=spec_for("qwen3-vl").random_config.with_depth(DEPTH))
        want = proc.image(image, "compact-u8")
        assert (want.hash, list(want.grid_thw)) == (h, item["grid_thw"])
        with torch.inference_mode():
            (out,) = enc([want])
        torch.testing.assert_close(load(r.content)[h], packed(out, torch.float32))
    finally:
        server.stop()


def test_a_drain_waits_for_an_encode_behind_its_answer():
    """SIGTERM with an encode still running behind its answer: the service drains (it does not
    exit while the encode counts), until the drain's deadline."""
    server = start_server(["--batch-wait-ms", "60000", "--drain-timeout", "3", "--shm-mib", "0"])
    try:
        r = httpx.post(f"{server.url}/v1/cache/encode", json=_body(png(40, 48, 13)), timeout=120)
        assert r.status_code == 200, r.text
        assert _health(server.url)["in_flight"] == 1
        server.proc.send_signal(signal.SIGTERM)
        _wait_for(lambda: _status(server.url) == "draining", "the drain to start")
        time.sleep(1.0)
        assert server.proc.poll() is None, "the drain did not wait for the encode"
        server.proc.wait(timeout=60)
    finally:
        server.stop()


def test_an_encode_that_fails_behind_its_answer_is_absent_not_pending():
    """The tower fails after the answer (a service in this process whose batcher raises once
    let go): lookups go from pending to absent, nothing stays counted in the queue."""
    from fastapi.testclient import TestClient

    from mmferry.server.app import create_app

    proc = mf.Processor.for_model("qwen3-vl", image_max_pixels=IMAGE_MAX_PIXELS)
    tower = spec_for("qwen3-vl").random_config.with_depth(1)
    service = EncoderService(
        proc,
        VisionEncoder.random("qwen3-vl", config=tower),
        ServiceConfig(limits=Limits(), shm_bytes=0, preprocess_threads=1),
    )
    let_go = threading.Event()

    async def failing(items):
        await asyncio.to_thread(let_go.wait, 60)
        raise RuntimeError("the tower broke")

    with TestClient(create_app(service)) as client:
        service.batcher.encode = failing
        r = client.post("/v1/cache/encode", json=_body(png(48, 48, 14)))
        assert r.status_code == 200, r.text
        h = r.json()["items"][0]["hash"]
        assert _lookup(client.post, [h])["pending"] == [True]
        assert client.get("/health").json()["in_flight"] == 1
        let_go.set()
        _wait_for(lambda: _lookup(client.post, [h])["pending"] == [False], "the failure")
        assert _lookup(client.post, [h]) == {
            "present": [False],
            "pinned_s": [0.0],
            "pending": [False],
        }
        assert client.get("/health").json()["in_flight"] == 0
