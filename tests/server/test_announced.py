"""`/v1/cache/encode` with `announced`: items a router named itself (hash and grid) before the
service read them. The names are pending to lookups from the moment the body is read (before
preprocessing), present once the rows are held; an item whose facts here differ from its name is
not held under it (the name goes absent, counted); the settings a router names items by are
`GET /v1/cache/processor`'s, and give the service's very names."""

from __future__ import annotations

import asyncio
import base64
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

import mmferry as mf
from mmferry.encoder.model import VisionEncoder
from mmferry.models import spec_for
from mmferry.preprocess.image import encoded_image_facts
from mmferry.proxy.ahead import processor_config
from mmferry.server.limits import Limits
from mmferry.server.service import EncoderService, ServiceConfig

from .conftest import IMAGE_MAX_PIXELS, png
from .test_cache_routes import _wait_for

KEY = "service-key-0123456789"


def _part(image: bytes) -> dict:
    url = "data:image/png;base64," + base64.b64encode(image).decode()
    return {"type": "image_url", "image_url": {"url": url}}


def _service(api_key: str | None = None) -> EncoderService:
    proc = mf.Processor.for_model("qwen3-vl", image_max_pixels=IMAGE_MAX_PIXELS)
    tower = spec_for("qwen3-vl").random_config.with_depth(1)
    return EncoderService(
        proc,
        VisionEncoder.random("qwen3-vl", config=tower),
        ServiceConfig(limits=Limits(), shm_bytes=0, preprocess_threads=1, api_key=api_key),
    )


@pytest.fixture
def client():
    from fastapi.testclient import TestClient

    from mmferry.server.app import create_app

    service = _service(KEY)
    with TestClient(create_app(service), headers={"Authorization": f"Bearer {KEY}"}) as c:
        c.service = service
        yield c


def _lookup(client, hashes: list[str]) -> dict:
    r = client.post("/v1/cache/lookup", json={"hashes": hashes})
    assert r.status_code == 200, r.text
    return r.json()


def _hold_back(service: EncoderService) -> threading.Event:
    """The service's preprocessing held back until the returned event is set."""
    let_go = threading.Event()
    prepare = service.prepare

    async def held_back(*args, **kwargs):
        await asyncio.to_thread(let_go.wait, 60)
        return await prepare(*args, **kwargs)

    service.prepare = held_back
    return let_go


def _settings(client):
    r = client.get("/v1/cache/processor")
    assert r.status_code == 200, r.text
    return processor_config(r.json())


def test_the_processor_route_gives_the_settings_items_are_named_by(client):
    cfg = _settings(client)
    assert cfg == client.service.processor.config
    assert cfg.fingerprint() == client.service.processor.config.fingerprint()
    image = png(52, 44, 1)
    r = client.post("/v1/cache/encode", json={"content": [_part(image)]})
    assert r.status_code == 200, r.text
    (item,) = r.json()["items"]
    assert encoded_image_facts(image, cfg) == (item["hash"], tuple(item["grid_thw"]))
    # Behind the key, as the other routes.
    r = client.get("/v1/cache/processor", headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401, r.text


def test_named_items_are_pending_from_the_read_then_held(client):
    """The lookup of an announced name says pending while its item is still being read and
    preprocessed (preprocessing held back here), then present: the engine that already has
    the request waits rather than failing it."""
    image = png(60, 40, 2)
    h, grid = encoded_image_facts(image, _settings(client))
    let_go = _hold_back(client.service)
    body = {"content": [_part(image)], "announced": [{"hash": h, "grid_thw": list(grid)}]}
    with ThreadPoolExecutor(1) as pool:
        answer = pool.submit(client.post, "/v1/cache/encode", json=body)
        _wait_for(lambda: _lookup(client, [h])["pending"] == [True], "the name to be pending")
        assert not answer.done()
        let_go.set()
        r = answer.result(timeout=120)
    assert r.status_code == 200, r.text
    (item,) = r.json()["items"]
    assert (item["hash"], item["grid_thw"], item["held"]) == (h, list(grid), True)
    assert _lookup(client, [h]) == {"present": [True], "pinned_s": [60.0], "pending": [False]}


@pytest.mark.parametrize("wrong", ["grid", "hash"])
def test_an_item_that_is_not_what_it_was_named_is_not_held_under_that_name(client, wrong):
    """A name whose grid (or hash) differs from the service's own facts: the item is answered
    with its own facts and `held` false (the router sends its request the usual way), the name
    goes absent (the engine's connector fails the request rather than loading rows that do not
    fit its prompt), and the difference is counted."""
    image = png(44, 60, 3)
    h, grid = encoded_image_facts(image, _settings(client))
    named = (
        {"hash": h, "grid_thw": [1, grid[1] + 2, grid[2]]}
        if wrong == "grid"
        else {
            "hash": "f" * 32,
            "grid_thw": list(grid),
        }
    )
    other = png(40, 40, 4)
    h2, grid2 = encoded_image_facts(other, _settings(client))
    body = {
        "content": [_part(image), _part(other)],
        "announced": [named, {"hash": h2, "grid_thw": list(grid2)}],
    }
    r = client.post("/v1/cache/encode", json=body)
    assert r.status_code == 200, r.text
    first, second = r.json()["items"]
    assert (first["hash"], first["grid_thw"], first["held"]) == (h, list(grid), False)
    assert second["held"] is True  # the other item of the call is held as named
    assert _lookup(client, [named["hash"], h2])["present"] == [False, True]
    metrics = client.get("/metrics").text
    assert 'mmferry_errors_total{kind="announced_differs"} 1.0' in metrics


@pytest.mark.parametrize(
    "announced",
    [
        "h",
        [],
        [{"hash": "h"}],
        [{"hash": "", "grid_thw": [1, 2, 2]}],
        [{"hash": "h" * 129, "grid_thw": [1, 2, 2]}],
        [{"hash": "h", "grid_thw": [1, 2]}],
        [{"hash": "h", "grid_thw": [1, 2, True]}],
        [{"hash": "h", "grid_thw": [1, 2, 2.0]}],
        [{"hash": 7, "grid_thw": [1, 2, 2]}],
        ["h"],
        [{"hash": "h", "grid_thw": [1, 2, 2]}, {"hash": "g", "grid_thw": [1, 2, 2]}],
    ],
)
def test_malformed_names_are_refused_and_leave_nothing_pending(client, announced):
    body = {"content": [_part(png(40, 40, 5))], "announced": announced}
    r = client.post("/v1/cache/encode", json=body)
    assert r.status_code == 422, r.text
    assert "announced" in r.json()["error"]["message"]
    assert _lookup(client, ["h"])["pending"] == [False]


def test_a_named_item_whose_read_fails_goes_absent(client):
    """An item named ahead that the service refuses (its bytes are no image): the refusal is the
    answer, and the name goes from pending to absent (nothing stays pending)."""
    body = {
        "content": [_part(b"not an image")],
        "announced": [{"hash": "a" * 32, "grid_thw": [1, 4, 4]}],
    }
    r = client.post("/v1/cache/encode", json=body)
    assert r.status_code == 422, r.text
    assert _lookup(client, ["a" * 32]) == {
        "present": [False],
        "pinned_s": [0.0],
        "pending": [False],
    }


def test_a_waiting_lookup_answers_at_the_change_not_at_its_deadline(client):
    """`wait_ms`: a lookup of items none of which is held answers once one's encode begins (a
    named item read), once its rows are held, or at the deadline when nothing changes; one
    held already answers at once."""
    image = png(48, 52, 6)
    h, grid = encoded_image_facts(image, _settings(client))

    def waiting(wait_ms: int) -> tuple[dict, float]:
        started = time.monotonic()
        r = client.post("/v1/cache/lookup", json={"hashes": [h], "wait_ms": wait_ms})
        assert r.status_code == 200, r.text
        return r.json(), time.monotonic() - started

    answer, took = waiting(300)  # nothing happens: the deadline
    assert answer["present"] == [False] and answer["pending"] == [False]
    assert 0.3 <= took < 5
    let_go = _hold_back(client.service)
    body = {"content": [_part(image)], "announced": [{"hash": h, "grid_thw": list(grid)}]}
    with ThreadPoolExecutor(2) as pool:
        looked = pool.submit(waiting, 1000)
        time.sleep(0.2)  # the lookup waits first
        encoded = pool.submit(client.post, "/v1/cache/encode", json=body)
        answer, took = looked.result(timeout=60)
        assert answer["pending"] == [True] and took < 1.0  # the named item was read
        looked = pool.submit(waiting, 1000)
        time.sleep(0.2)
        let_go.set()
        answer, took = looked.result(timeout=60)
        assert answer["present"] == [True]
        assert encoded.result(timeout=60).status_code == 200
    started = time.monotonic()
    assert waiting(1000)[0]["present"] == [True] and time.monotonic() - started < 1.0


@pytest.mark.parametrize("wait_ms", [-1, 1001, 2.5, True, "10"])
def test_a_bad_wait_is_refused(client, wait_ms):
    r = client.post("/v1/cache/lookup", json={"hashes": ["h"], "wait_ms": wait_ms})
    assert r.status_code == 422, r.text
    assert "wait_ms" in r.json()["error"]["message"]
