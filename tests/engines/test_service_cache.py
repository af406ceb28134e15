"""The service's lookup by hash and its pins (server/ec.py), and `CacheClient` against a real
`mmferry serve`: the rows it loads are mmferry's encoder output in the engines' layout."""

from __future__ import annotations

import contextlib
import gc
import io
import time
import weakref

import httpx
import pytest
import torch
from PIL import Image

from mmferry.embed.cache import EncoderCache
from mmferry.encoder.model import VisionOutput
from mmferry.engines.cache_client import CacheClient, ServiceUnavailable
from mmferry.server.client import image_part
from mmferry.server.pins import Pins
from mmferry.testing.ports import free_port
from tests.engines.service import Service
from tests.engines.tiny_vlm import image


def out(rows: int, fill: float) -> VisionOutput:
    return VisionOutput(torch.full((rows, 4), fill), (torch.full((rows, 4), -fill),))


def test_pin_outlives_eviction_until_taken():
    cache = EncoderCache(capacity_bytes=64)  # room for one 2-row entry with its deepstack
    cache.put("a", out(2, 1.0))
    pins = Pins(cache, ttl_s=10.0, max_bytes=1 << 20)
    assert pins.lookup(["a", "b"], "e1", now=0.0) == [10.0, 0.0]
    cache.put("c", out(2, 3.0))  # evicts "a" from the LRU
    assert cache.peek("a") is None and pins.used_bytes == 64
    taken = pins.take_all(["a"], "e1", now=1.0)["a"]
    assert float(taken.embeds[0, 0]) == 1.0
    assert len(pins) == 0 and pins.used_bytes == 0
    with pytest.raises(KeyError):
        pins.take_all(["a"], "e1", now=1.0)
    pins.lookup(["c"], "e1", now=2.0)
    with pytest.raises(KeyError):
        pins.take_all(["c", "gone"], "e1", now=2.0)
    assert len(pins) == 1  # a failed load releases nothing
    assert set(pins.take_all(["c", "c"], "e1", now=2.0)) == {"c"} and len(pins) == 0


def test_a_repeat_lookup_renews_a_cached_pin_and_never_an_evicted_one():
    cache = EncoderCache(capacity_bytes=1 << 20)
    cache.put("a", out(2, 1.0))
    pins = Pins(cache, ttl_s=60.0, max_bytes=0)
    assert pins.lookup(["a"], "e1", now=0.0) == [60.0]
    # The cache holds the rows: asking again renews the pin, so an engine that looked the item
    # up and loaded nothing (its own cache had it) is not told a lapsing pin a minute later.
    assert pins.lookup(["a"], "e1", now=59.5) == [60.0]
    assert pins.lookup(["a"], "e2", now=60.0) == [60.0]  # another caller's own pin
    cache._drop("a")
    # Evicted: the rows live in the pins alone, and a repeat never extends them.
    assert pins.lookup(["a"], "e2", now=65.0) == [55.0]
    # A load releases the loader's pin only; the other caller's still holds the rows.
    assert set(pins.take_all(["a"], "e2", now=66.0)) == {"a"} and len(pins) == 1
    assert pins.lookup(["a"], "e1", now=118.5) == [1.0]
    assert pins.lookup(["a"], "e1", now=119.5) == [0.0] and len(pins) == 0


def test_a_new_caller_pins_the_rows_the_cache_holds_now_never_older_pinned_ones():
    """Rows evicted while pinned and encoded again: the cache holds newer rows under the key
    while the old ones are still pinned. Every pin on the key then holds the cached rows (the
    same item's, by its hash), so a chain of new callers, each pinning for the full TTL, never
    keeps the evicted rows alive, and they cost the pins' budget nothing from then on."""
    cache = EncoderCache(capacity_bytes=64)  # one 2-row entry with its deepstack
    cache.put("a", out(2, 1.0))
    pins = Pins(cache, ttl_s=60.0, max_bytes=64)
    assert pins.lookup(["a"], "e1", now=0.0) == [60.0]
    old = weakref.ref(cache.peek("a").embeds)
    cache.put("b", out(2, 2.0))  # evicts "a": its rows live in e1's pin alone
    assert pins.used_bytes == 64
    cache.put("a", out(2, 3.0))  # "a" encoded again (evicting "b")
    for t, caller in ((50.0, "e2"), (100.0, "e3"), (150.0, "e4")):
        assert pins.lookup(["a"], caller, now=t) == [60.0]  # cached rows: a full pin
        assert pins.used_bytes == 0  # nothing pinned outside the cache
    gc.collect()
    assert old() is None
    # e1's pin lapsed at 60 s; e4's loads the rows the cache holds.
    assert float(pins.take_all(["a"], "e4", now=151.0)["a"].embeds[0, 0]) == 3.0
    # The encode route's pin on rows encoded again is the cached rows' too.
    assert pins.lookup(["a"], "e5", now=152.0) == [60.0]
    cache.put("c", out(2, 4.0))  # evicts "a" again
    cache.put("a", out(2, 5.0))
    assert pins.hold("a", cache.peek("a"), now=153.0) and pins.used_bytes == 0
    assert float(pins.take_all(["a"], "e5", now=154.0)["a"].embeds[0, 0]) == 5.0


def test_the_encode_routes_pin_on_rows_only_pins_hold_keeps_to_the_budget():
    """The item encoded again while its evicted rows are pinned, and the cache does not take
    the new ones: over `max_bytes`, the encode route's pin ends with the pins already there,
    as a lookup's would."""
    cache = EncoderCache(capacity_bytes=64)
    cache.put("a", out(2, 1.0))
    pins = Pins(cache, ttl_s=60.0, max_bytes=0)
    assert pins.lookup(["a"], "e1", now=0.0) == [60.0]
    cache.put("b", out(2, 2.0))  # evicts "a": 64 bytes pinned outside the cache, over 0
    assert pins.hold("a", out(2, 3.0), now=10.0)  # held, by the pins already there
    assert pins.lookup(["a"], "e2", now=20.0) == [40.0]  # ending with e1's, not at 70 s
    assert pins.lookup(["a"], "e2", now=60.0) == [0.0] and len(pins) == 0


def test_pin_expires_and_is_bounded():
    """The budget bounds pinned rows the cache no longer holds; rows still cached cost
    nothing. A pin on rows only pins hold ends with them: passing the rows from caller to
    caller never keeps them alive."""
    cache = EncoderCache(capacity_bytes=128)  # two 2-row entries
    cache.put("a", out(2, 1.0))
    cache.put("b", out(2, 2.0))
    pins = Pins(cache, ttl_s=5.0, max_bytes=64)  # one entry's worth
    assert pins.lookup(["a", "b"], "e1", now=0.0) == [5.0, 5.0]  # cached: free
    assert pins.used_bytes == 0
    cache.put("c", out(2, 3.0))
    cache.put("d", out(2, 4.0))
    assert pins.used_bytes == 128  # evicted while pinned: counted from now on
    assert pins.lookup(["c", "d"], "e2", now=1.0) == [5.0, 5.0]  # within one cache's worth
    cache.put("e", out(2, 5.0))
    cache.put("f", out(2, 6.0))
    assert pins.used_bytes == 256  # past max_bytes and a cache's worth ...
    assert pins.lookup(["e"], "e2", now=2.0) == [0.0]  # ... so no new rows are pinned
    assert pins.lookup(["a"], "e2", now=2.0) == [3.0]  # ones already pinned cost nothing
    assert pins.lookup(["a"], "e3", now=4.0) == [1.0]  # and end with their first pin
    assert pins.lookup(["a", "b"], "e3", now=5.0) == [0.0, 0.0]
    assert pins.used_bytes == 128 and len(pins) == 2
    assert pins.lookup(["e"], "e2", now=5.0) == [5.0]
    # c and d lapsed; e is still cached, so asking again renews its pin.
    assert pins.lookup(["c", "d", "e"], "e2", now=6.0) == [0.0, 0.0, 5.0]
    assert pins.used_bytes == 0 and len(pins) == 1
    # The encode route's pin: rows the cache cannot take are held within max_bytes only.
    assert not pins.hold("big", out(4, 9.0), now=6.0)  # 128 bytes with its deepstack
    assert pins.hold("f", cache.peek("f"), now=6.0)
    assert pins.hold("small", out(2, 8.0), now=6.0) and pins.used_bytes == 64
    assert not pins.hold("small2", out(2, 8.0), now=6.0)
    # The first caller to look it up takes the encode route's pin over.
    assert pins.lookup(["small"], "e1", now=7.0) == [4.0] and len(pins) == 3


def test_a_caller_looking_up_every_50_s_keeps_nothing_for_ever_and_starves_nobody():
    """One key holder pins everything it can and repeats its lookups every 50 s, under a
    fresh caller id each time too: its pins lapse 60 s after the first lookup, the rows the
    cache dropped go with them, and the other callers' lookups of cached rows are answered
    "present" all along."""
    cache = EncoderCache(capacity_bytes=64 * 8)
    mine = [f"m{i}" for i in range(8)]
    for i, key in enumerate(mine):
        cache.put(key, out(2, float(i)))
    pins = Pins(cache, ttl_s=60.0, max_bytes=64)
    assert all(s == 60.0 for s in pins.lookup(mine, "attacker", now=0.0))
    for i in range(8):  # the others' traffic evicts them all while pinned
        cache.put(f"o{i}", out(2, 100.0 + i))
    for t in (50.0, 55.0, 59.0):
        for caller in ("attacker", f"attacker-{t}"):
            assert all(0.0 < s <= 60.0 - t for s in pins.lookup(mine, caller, now=t))
        # Another caller's cached rows: present, pinned for the full TTL.
        assert pins.lookup([f"o{int(t) % 8}"], "engine", now=t) == [60.0]
    assert pins.lookup(mine, "attacker", now=60.0) == [0.0] * 8
    assert pins.lookup(mine, "attacker-again", now=100.0) == [0.0] * 8
    assert pins.used_bytes == 0


@pytest.fixture(scope="module")
def service(models):
    s = Service(models["qwen3_vl"].path, free_port()).start()
    yield s
    s.stop()


def png(pixels) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


@pytest.mark.parametrize("shm", [False, True])
def test_client_loads_packed_rows(service, models, shm):
    m = models["qwen3_vl"]
    pixels = image(64, 96, 3 + shm)
    body = {"content": [image_part(png(pixels))]}
    (facts,) = httpx.post(f"{service.url}/v1/cache/encode", json=body, timeout=60).json()["items"]
    client = CacheClient(service.url, None, 30.0, shm)
    try:
        assert facts["held"] is True
        assert client.lookup([facts["hash"], "never-seen"]) == [True, False]
        rows = client.load([facts["hash"]], torch.float32)[facts["hash"]]
        ref = m.enc([m.proc.image(pixels)])[0]
        assert rows.shape == (facts["num_tokens"], ref.embeds.shape[1] * 3)
        want = torch.cat([ref.embeds, *ref.deepstack], dim=-1)
        assert torch.allclose(rows, want, atol=1e-5)
        with pytest.raises(ServiceUnavailable, match="404"):
            client.load(["never-seen"], torch.float32)
    finally:
        client.close()


def test_lookup_answers_each_callers_pin_lifetime(service):
    """Over HTTP: `pinned_s` runs from the caller's lookup (a repeat renews it while the cache
    holds the rows), another caller (X-Mmferry-Caller) gets a pin of its own, a load by one
    caller leaves the other's, and an unusable caller id is a 422."""
    body = {"content": [image_part(png(image(48, 64, 11)))]}
    (facts,) = httpx.post(f"{service.url}/v1/cache/encode", json=body, timeout=60).json()["items"]
    assert facts["held"] is True
    h = facts["hash"]

    def lookup(caller: str) -> dict:
        r = httpx.post(
            f"{service.url}/v1/cache/lookup",
            json={"hashes": [h, "never-seen"]},
            headers={"X-Mmferry-Caller": caller},
            timeout=30,
        )
        assert r.status_code == 200, r.text
        return r.json()

    first = lookup("engine-a")
    assert first["present"] == [True, False] and first["pinned_s"][1] == 0.0
    assert 55.0 < first["pinned_s"][0] <= 60.0
    time.sleep(1.2)
    again = lookup("engine-a")
    assert 59.0 < again["pinned_s"][0] <= 60.0  # renewed: the cache holds the rows
    other = lookup("engine-b")
    assert 59.0 < other["pinned_s"][0] <= 60.0  # its own, from now
    r = httpx.post(
        f"{service.url}/v1/cache/load",
        json={"hashes": [h], "dtype": "float32"},
        headers={"X-Mmferry-Caller": "engine-b"},
        timeout=30,
    )
    assert r.status_code == 200
    # engine-a's pin is its own: engine-b's load left it (the unit test counts the pins).
    assert lookup("engine-a")["present"][0] is True
    for bad in ("x" * 200, "caf\u00e9"):
        r = httpx.post(
            f"{service.url}/v1/cache/lookup",
            json={"hashes": [h]},
            headers={"X-Mmferry-Caller": bad.encode("latin-1")},
            timeout=30,
        )
        assert r.status_code == 422, (bad, r.status_code, r.text)


def test_cache_routes_ask_for_the_api_key(models):
    key = "engine-test-key-0123"
    s = Service(models["qwen2_5_vl"].path, free_port(), env={"MMFERRY_API_KEY": key}).start()
    try:
        r = httpx.post(f"{s.url}/v1/cache/lookup", json={"hashes": ["x"]}, timeout=30)
        assert r.status_code == 401
        bad = httpx.post(
            f"{s.url}/v1/cache/lookup",
            json={"hashes": "x"},
            timeout=30,
            headers={"Authorization": f"Bearer {key}"},
        )
        assert bad.status_code == 422
        client = CacheClient(s.url, key, 30.0, shm=False)
        assert client.lookup(["x"]) == [False]
        client.close()
    finally:
        s.stop()


def test_cache_routes_refuse_hostile_json_with_a_400(service):
    """The cache routes parse bodies as /v1/encode does: deep nesting and a 5,000-digit
    integer are a 400, not a 500."""
    for raw in (b"[" * 100_000, b'{"hashes": [' + b"9" * 5000 + b"]}"):
        for route in ("lookup", "load", "encode"):
            r = httpx.post(
                f"{service.url}/v1/cache/{route}",
                content=raw,
                headers={"content-type": "application/json"},
                timeout=60,
            )
            assert r.status_code == 400, (route, r.status_code, r.text[:200])
            assert r.json()["error"]["kind"] == "bad_json"


def _outside_by_scan(pins: Pins, cache: EncoderCache) -> int:
    """The plain definition of `used_bytes`: every pinned item whose rows the cache does not
    hold under its key."""
    return sum(
        sum(t.numel() * t.element_size() for t in (h.out.embeds, *h.out.deepstack))
        for k, h in pins._held.items()
        if cache.peek(k) is not h.out
    )


def test_used_bytes_follows_every_pin_and_cache_change():
    # A seeded walk of lookups, holds, loads, expiries and cache stores, evictions and
    # replacements: the count kept as they happen equals a scan of every pin after each step.
    import random

    rng = random.Random(7)
    cache = EncoderCache(capacity_bytes=3 * 64)
    pins = Pins(cache, ttl_s=5.0, max_bytes=4 * 64, max_pins=12)
    keys = [f"k{i}" for i in range(6)]
    callers = ["e1", "e2", "e3"]
    now = 0.0
    for step in range(3000):
        now += rng.choice([0.0, 0.1, 0.5, 2.0])
        op = rng.randrange(6)
        key = rng.choice(keys)
        if op == 0:
            cache.put(key, out(rng.choice([1, 2, 3]), float(step)))
        elif op == 1:
            pins.lookup(rng.sample(keys, 2), rng.choice(callers), now=now)
        elif op == 2:
            pins.hold(key, out(rng.choice([1, 2]), float(step)), now=now)
        elif op == 3:
            with contextlib.suppress(KeyError):
                pins.take_all([key], rng.choice(callers + ["encode"]), now=now)
        elif op == 4 and key in cache:
            cache.get(key, -1)  # a wrong length drops the entry
        else:
            pins.lookup([], "e1", now=now)  # expiry alone
        assert pins.used_bytes == _outside_by_scan(pins, cache), step
