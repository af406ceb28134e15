"""The connector's two sides against a lying service over real HTTP (`lying_service.py`).

Scheduler side (`Presence`, what `has_cache_item` runs): every malformed, unexpected or late
lookup answer is "absent", never an exception, and the next good answer is believed again;
presence is trusted for the service's `pinned_s` (half of it, counted from the send) and the
table of items told present stays bounded. Worker side (`fetch_rows`, what `start_load_caches`
runs): rows are checked against the planned shape and dtype, a shared-memory handle that does
not open falls back to safetensors over HTTP, and a load that cannot be had names its items.
"""

from __future__ import annotations

import time

import pytest
import torch

from mmferry.engines.cache_client import CALLER_HEADER, CacheClient, RowSpec, fetch_rows
from mmferry.engines.presence import MAX_ITEMS, Presence
from mmferry.testing.ports import free_port
from mmferry.transport.shm import ShmArena
from tests.engines.lying_service import (
    BAD_LOOKUPS,
    SLOW_S,
    Answer,
    LyingService,
    absent,
    handle_json,
    html,
    js,
    pending,
    present,
    raw,
    rows,
)

LOOKUP_TIMEOUT_S = 0.5
SPEC = RowSpec(width=12, dtype=torch.float32)


def client_for(url: str, *, shm: bool = False, caller: str = "engine-1") -> CacheClient:
    return CacheClient(url, None, 2.0, shm, caller=caller, lookup_timeout_s=LOOKUP_TIMEOUT_S)


@pytest.fixture(scope="module")
def lying_server():
    with LyingService() as s:
        yield s


@pytest.fixture
def lying(lying_server):
    """The module's lying service, with no answers set and nothing seen."""
    lying_server.answers.clear()
    lying_server.seen.clear()
    return lying_server


@pytest.mark.parametrize("form", list(BAD_LOOKUPS))
def test_a_bad_lookup_answer_is_absent_and_the_next_good_one_is_believed(lying, form):
    lying.answer("lookup", BAD_LOOKUPS[form])
    client = client_for(lying.url)
    presence = Presence(client, retry_after_s=0.0)
    try:
        started = time.monotonic()
        assert presence.has("h0") is False
        # Late or trickled answers are cut at the lookup's deadline, not waited for.
        assert time.monotonic() - started < SLOW_S - 1.0
        assert presence.claim("h0") is False
        lying.answer("lookup", present(60.0))
        # Believed again once the service answers (a cut call ends first: absent till then).
        until = time.monotonic() + SLOW_S + 5.0
        while not presence.has("h1") and time.monotonic() < until:
            time.sleep(0.1)
        assert presence.claim("h1") is True
    finally:
        client.close()


def test_a_service_that_is_not_there_is_absent(lying):
    client = client_for(f"http://127.0.0.1:{free_port()}")
    try:
        assert Presence(client, retry_after_s=0.0).has("h0") is False
    finally:
        client.close()


@pytest.mark.parametrize("form", ["late", "status_500"])
def test_after_a_failure_the_scheduler_does_not_ask_for_every_item(lying, form):
    """A service that fails costs one lookup (a late one, one deadline), then "absent" at once
    for a while: a scheduler pass over many items is neither slowed by each of them nor
    hammering the service."""
    lying.answer("lookup", BAD_LOOKUPS[form])
    client = client_for(lying.url)
    presence = Presence(client, retry_after_s=30.0)
    try:
        started = time.monotonic()
        assert not any(presence.has(f"h{i}") for i in range(50))
        assert time.monotonic() - started < SLOW_S - 1.0
        assert len(lying.calls("lookup")) == 1
    finally:
        client.close()


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_presence_is_trusted_for_half_the_pin_the_service_reports(lying):
    """`pinned_s` is the one clock: present is answered from memory for half of it (from when
    the lookup was sent), then asked again; a pin about to lapse is not planned on."""
    clock = Clock()
    lying.answer("lookup", present(20.0))
    client = client_for(lying.url)
    presence = Presence(client, clock=clock)
    try:
        assert presence.has("h")
        presence.end_pass()
        clock.t += 9.9
        assert presence.has("h") and len(lying.calls("lookup")) == 1
        presence.end_pass()
        clock.t += 0.2  # 10.1 s after the send: past half the pin
        assert presence.has("h") and len(lying.calls("lookup")) == 2
        presence.end_pass()
        lying.answer("lookup", present(0.5))
        clock.t += 20.0
        assert presence.has("h") is False and len(lying.calls("lookup")) == 3
        assert presence.claim("h") is False
    finally:
        client.close()


def test_an_item_still_being_encoded_is_waited_for_then_believed(lying):
    """A pending answer (the encode answered ahead of the rows) is "waiting", neither present
    nor absent: asked once per pass, again at the next pass, and present once the service
    holds the rows."""
    clock = Clock()
    lying.answer("lookup", pending())
    client = client_for(lying.url)
    presence = Presence(client, clock=clock, wait_s=5.0)
    try:
        assert presence.has("h") is False and presence.waiting("h")
        assert presence.has("h") is False and len(lying.calls("lookup")) == 1
        assert presence.claim("h") is False
        presence.end_pass()
        assert not presence.waiting("h")  # a new pass: not known until asked
        clock.t += 4.0
        assert presence.has("h") is False and presence.waiting("h")
        assert len(lying.calls("lookup")) == 2
        presence.end_pass()
        lying.answer("lookup", present(60.0))
        # Said pending a moment ago (the scheduler passes every millisecond): not asked yet.
        assert presence.has("h") is False and presence.waiting("h")
        assert len(lying.calls("lookup")) == 2
        presence.end_pass()
        clock.t += 0.01
        assert presence.has("h") and not presence.waiting("h")
        assert presence.claim("h") is True
    finally:
        client.close()


def test_an_item_still_being_encoded_is_asked_about_ever_less_often(lying):
    """The scheduler passes every millisecond while a request waits: an item still being
    encoded is asked about again after 2 ms, the gap doubling to at most 16 ms (not once a
    pass, which would take the encoder's CPU where the two share cores)."""
    from mmferry.engines.presence import POLL_MAX_S

    clock = Clock()
    lying.answer("lookup", pending())
    client = client_for(lying.url)
    presence = Presence(client, clock=clock, wait_s=5.0)
    try:
        for _ in range(200):  # 200 ms of passes
            assert presence.has("h") is False and presence.waiting("h")
            presence.end_pass()
            clock.t += 0.001
        asked = len(lying.calls("lookup"))
        # 2, 4, 8 ms, then every 16 ms: about 15 lookups in 200 ms, not 200.
        assert 10 <= asked <= 3 + 0.2 / POLL_MAX_S + 1, asked
    finally:
        client.close()


def test_an_item_pending_past_its_wait_is_absent(lying):
    """An item the service keeps saying it encodes is given up `wait_s` after the first such
    answer (its request fails, or vLLM encodes it), and its wait is not kept past that."""
    clock = Clock()
    lying.answer("lookup", pending())
    client = client_for(lying.url)
    presence = Presence(client, clock=clock, wait_s=5.0)
    try:
        assert presence.waiting("h") is False and presence.has("h") is False
        assert presence.waiting("h")
        presence.end_pass()
        clock.t += 5.1
        assert presence.has("h") is False and not presence.waiting("h")
        assert presence.claim("h") is False
        # Another item's wait is its own.
        assert presence.has("g") is False and presence.waiting("g")
    finally:
        client.close()


def test_an_item_named_ahead_is_waited_for_until_its_encoder_has_read_it(lying):
    """An item the proxy named before its encoder read it (`ahead`): unknown to the service,
    it is waiting (its request deferred), not absent; then pending, then present. Unknown after
    the service once said it encodes it is absent (that encode failed); an item not named ahead
    is absent at once."""
    clock = Clock()
    lying.answer("lookup", absent())
    client = client_for(lying.url)
    presence = Presence(client, clock=clock, wait_s=5.0)
    try:
        assert presence.has("plain") is False and not presence.waiting("plain")
        presence.ask(["h"], ahead={"h"})
        assert presence.waiting("h") and presence.has("h") is False
        presence.end_pass()
        clock.t += 0.1
        lying.answer("lookup", pending())
        presence.ask(["h"], ahead={"h"})
        assert presence.waiting("h")
        presence.end_pass()
        clock.t += 0.1
        lying.answer("lookup", present(60.0))
        presence.ask(["h"], ahead={"h"})
        assert presence.has("h") and not presence.waiting("h")
        assert presence.claim("h") is True
        presence.end_pass()

        # Pending once, then unknown: its encode failed, so it is absent (the request fails
        # and is sent again with pixels), not waited for until `wait_s`.
        lying.answer("lookup", pending())
        presence.ask(["g"], ahead={"g"})
        assert presence.waiting("g")
        presence.end_pass()
        clock.t += 0.1
        lying.answer("lookup", absent())
        presence.ask(["g"], ahead={"g"})
        assert not presence.waiting("g") and presence.has("g") is False
    finally:
        client.close()


def test_an_item_waited_for_is_asked_with_a_wait_whatever_the_gap(lying):
    """`wait_s` (the engine has nothing else to run): a waiting item is asked again at once,
    inside its gap, and the lookup carries the wait for the service to answer at a change."""
    clock = Clock()
    lying.answer("lookup", pending())
    client = client_for(lying.url)
    presence = Presence(client, clock=clock, wait_s=5.0)
    try:
        presence.ask(["h"])
        assert presence.waiting("h")
        presence.end_pass()
        presence.ask(["h"])  # within its gap: not asked
        assert len(lying.calls("lookup")) == 1
        presence.end_pass()
        lying.answer("lookup", present(60.0))
        presence.ask(["h"], wait_s=0.01)
        assert [b.get("wait_ms") for _, b in lying.calls("lookup")] == [None, 10]
        presence.end_pass()
        assert presence.has("h") and presence.claim("h")  # trusted from the waiting lookup
        assert len(lying.calls("lookup")) == 2
    finally:
        client.close()


def test_an_item_named_ahead_that_never_arrives_is_absent_after_its_wait(lying):
    """An item named ahead that its service never comes to know is given up `wait_s` after the
    first lookup, as an item kept pending is."""
    clock = Clock()
    lying.answer("lookup", absent())
    client = client_for(lying.url)
    presence = Presence(client, clock=clock, wait_s=5.0)
    try:
        presence.ask(["h"], ahead={"h"})
        assert presence.waiting("h")
        presence.end_pass()
        clock.t += 4.9
        presence.ask(["h"], ahead={"h"})
        assert presence.waiting("h")
        presence.end_pass()
        clock.t += 0.2
        presence.ask(["h"], ahead={"h"})
        assert not presence.waiting("h") and presence.has("h") is False
    finally:
        client.close()


def test_a_present_answer_binds_the_alloc_of_its_pass_only(lying):
    """An item answered present is loaded when vLLM allocates it in that pass, even if its
    entry was pushed out meanwhile; in a later pass, an alloc without a present answer (vLLM
    encodes it) plans no load."""
    lying.answer("lookup", present(60.0))
    client = client_for(lying.url)
    presence = Presence(client, max_items=2)
    try:
        assert presence.has("a") and presence.has("b") and presence.has("c")
        assert len(presence) == 2  # "a" pushed out of the table ...
        assert presence.claim("a") is True  # ... yet its alloc in this pass loads it
        presence.end_pass()
        assert presence.claim("b") is False
    finally:
        client.close()


def test_a_requests_items_are_asked_in_one_lookup(lying):
    """`ask` sends one lookup for every item not yet known, in the scheduler's step, and `has`
    answers from it: present ones (pinned long enough) present, the rest absent, none asked
    again in that pass; the next pass asks again only what is not trusted."""

    def some_present(body):
        hashes = body["hashes"]
        return js({"present": [h != "b" for h in hashes], "pinned_s": [60.0] * len(hashes)})

    lying.answer("lookup", some_present)
    client = client_for(lying.url)
    presence = Presence(client)
    try:
        presence.ask(["a", "b", "c", "a"])
        assert [presence.has(h) for h in ("a", "b", "c")] == [True, False, True]
        assert [body["hashes"] for _, body in lying.calls("lookup")] == [["a", "b", "c"]]
        presence.end_pass()
        presence.ask(["a", "b", "d"])
        assert presence.has("d") and not presence.has("b")
        assert [body["hashes"] for _, body in lying.calls("lookup")][1:] == [["b", "d"]]
    finally:
        client.close()


def test_items_told_present_but_never_allocated_are_bounded(lying):
    """Aborted requests leave items told present and never allocated: the table holds at
    most `max_items` and forgets each once its trust has passed."""
    clock = Clock()
    lying.answer("lookup", present(10.0))
    client = client_for(lying.url)
    presence = Presence(client, max_items=64, clock=clock)
    try:
        for i in range(200):
            assert presence.has(f"h{i}")
            presence.end_pass()
            assert len(presence) <= 64
        clock.t += 5.1
        lying.answer("lookup", BAD_LOOKUPS["html_200"])
        assert presence.has("other") is False
        assert len(presence) == 0
    finally:
        client.close()
    assert MAX_ITEMS <= 1 << 16


def test_lookups_and_loads_carry_the_connectors_caller(lying):
    """One caller id per connector: the scheduler's lookups and the worker's loads (which
    learn the id from the plan) send it, so the service releases the pins the lookups took."""
    lying.answer("lookup", present(60.0))
    lying.answer("load", rows({"h": torch.ones(3, 12)}))
    scheduler = client_for(lying.url, caller="conn-abc")
    worker = client_for(lying.url, caller="worker-own")
    try:
        assert Presence(scheduler).has("h")
        worker.set_caller("conn-abc")
        fetch_rows(worker, {"h": 3}, SPEC, 2.0)
    finally:
        scheduler.close()
        worker.close()
    ((lookup_headers, _),) = lying.calls("lookup")
    ((load_headers, _),) = lying.calls("load")
    assert lookup_headers[CALLER_HEADER.lower()] == "conn-abc"
    assert load_headers[CALLER_HEADER.lower()] == "conn-abc"


def good(n: int = 3) -> torch.Tensor:
    return torch.arange(n * 12, dtype=torch.float32).reshape(n, 12)


# Every form of rows that must not reach vLLM for an item planned as 3 tokens of width 12.
BAD_ROWS = {
    "one_dim": torch.zeros(3),  # the planned token count in its first dimension ...
    "three_dims": torch.zeros(3, 4, 3),  # ... and the planned number of values
    "wrong_width": torch.zeros(3, 8),
    "deepstack_missing": torch.zeros(3, 4),
    "wrong_tokens": torch.zeros(4, 12),
    "no_tokens": torch.zeros(0, 12),
    "float64": torch.zeros(3, 12, dtype=torch.float64),
    "float16": torch.zeros(3, 12, dtype=torch.float16),
    "int32": torch.zeros(3, 12, dtype=torch.int32),
}


@pytest.mark.parametrize("form", list(BAD_ROWS))
def test_rows_that_do_not_fit_fail_the_load_naming_the_item(lying, form):
    lying.answer("load", rows({"good": good(), "bad-item": BAD_ROWS[form]}))
    client = client_for(lying.url)
    try:
        with pytest.raises(RuntimeError, match="bad-item"):
            fetch_rows(client, {"good": 3, "bad-item": 3}, SPEC, 2.0)
    finally:
        client.close()


BAD_LOADS = {
    "missing_hash": rows({"a": good()}),
    "extra_hash": rows({"a": good(), "b": good(), "c": good()}),
    "other_hashes": rows({"x": good(), "y": good()}),
    "not_safetensors": raw(b"\x00\x01garbage", "application/octet-stream"),
    "html_200": html(),
}


@pytest.mark.parametrize("form", list(BAD_LOADS))
def test_a_load_answer_that_is_not_the_asked_items_fails_naming_them(lying, form):
    lying.answer("load", BAD_LOADS[form])
    client = client_for(lying.url)
    try:
        with pytest.raises(RuntimeError, match=r"\['a', 'b'\]"):
            fetch_rows(client, {"a": 3, "b": 3}, SPEC, 1.0)
    finally:
        client.close()


def test_a_load_that_never_comes_fails_after_its_time_naming_the_items(lying):
    """Cut at the load's deadline even when the service trickles its answer byte by byte."""
    lying.answer("load", Answer(200, b'{"items": {"a": {}}}', trickle_s=SLOW_S / 20))
    client = client_for(lying.url, shm=True)
    try:
        started = time.monotonic()
        with pytest.raises(RuntimeError, match=r"\['a'\].*did not answer"):
            fetch_rows(client, {"a": 3}, SPEC, 1.0)
        assert time.monotonic() - started < SLOW_S - 1.0
    finally:
        client.close()


def test_items_the_service_no_longer_holds_fail_at_once_naming_them(lying):
    """A 404 is an answer, not an outage: the load is not retried for its whole window (the
    engine would stall on it), it fails naming the items."""
    lying.answer("load", js({"error": {"kind": "not_found", "message": "gone"}}, status=404))
    client = client_for(lying.url)
    try:
        with pytest.raises(RuntimeError, match=r"\['a', 'b'\].*no longer holds"):
            fetch_rows(client, {"a": 3, "b": 3}, SPEC, 10.0)
        assert len(lying.calls("load")) == 1
    finally:
        client.close()


def test_a_load_retries_a_service_that_is_briefly_unavailable(lying):
    answers = [js({"error": "restarting"}, status=503)] * 2 + [rows({"a": good()})]
    lying.answer("load", lambda body: answers.pop(0))
    client = client_for(lying.url)
    try:
        got = fetch_rows(client, {"a": 3}, SPEC, 5.0)
        assert torch.equal(got["a"], good())
    finally:
        client.close()


def gone_handle(tensor: torch.Tensor) -> dict:
    """A real handle into a real arena whose segment is unlinked before anyone opens it."""
    arena = ShmArena(1 << 20)
    doc = handle_json(arena.put(tensor))
    arena.close()
    return doc


SHM_FAILURES = {
    "segment_gone": lambda: js({"items": {"a": gone_handle(good())}}),
    "bad_handle": lambda: js({"items": {"a": {"shape": [3, 12], "dtype": "float32"}}}),
    "handle_not_an_object": lambda: js({"items": {"a": "shm://a"}}),
    "items_a_list": lambda: js({"items": [{"a": 1}]}),
    "duplicate_hash": lambda: raw('{"items": {"a": {}, "a": {}}}'),
    "no_items": lambda: js({}),
}


@pytest.mark.parametrize("form", list(SHM_FAILURES))
def test_shared_memory_that_fails_falls_back_to_safetensors(lying, form):
    bad = SHM_FAILURES[form]()

    def load(body: dict) -> Answer:
        return bad if body.get("response") == "shm" else rows({"a": good()})

    lying.answer("load", load)
    client = client_for(lying.url, shm=True)
    try:
        got = fetch_rows(client, {"a": 3}, SPEC, 2.0)
        assert torch.equal(got["a"], good())
    finally:
        client.close()
    forms = [body.get("response", "safetensors") for _, body in lying.calls("load")]
    assert forms == ["shm", "safetensors"]


def test_shared_memory_rows_are_checked_like_bytes(lying):
    """A handle that opens but holds rows of another shape fails the load too."""
    arena = ShmArena(1 << 20)
    try:
        lying.answer("load", js({"items": {"a": handle_json(arena.put(torch.zeros(3, 8)))}}))
        client = client_for(lying.url, shm=True)
        try:
            with pytest.raises(RuntimeError, match=r"a: rows \(3, 8\)"):
                fetch_rows(client, {"a": 3}, SPEC, 2.0)
        finally:
            client.close()
    finally:
        arena.close()
