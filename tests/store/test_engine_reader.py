"""An engine's store reader as vLLM's scheduler meets it: a presence check never waits on
Mooncake past its lookup deadline, whether the store is slow to answer or its master is absent
(the client connects in the background), and the store is asked again once it answers."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import pytest
import torch

from mmferry.engines.presence import RETRY_AFTER_S, Presence
from mmferry.store.engine import StoreReader
from mmferry.store.entry import ModelIdentity, entry_key, entry_parts
from mmferry.store.mooncake import MooncakeStore, StoreAddress
from tests.store import cluster

MODEL = ModelIdentity("tiny", "b" * 32)
HIDDEN = 32
DEADLINE_S = 0.3
# What a presence check may take beyond its deadline on a loaded 2-core machine.
SLACK_S = 0.7


def reader(url: str) -> StoreReader:
    return StoreReader(
        url, MODEL, dtype=torch.float32, hidden=HIDDEN, deepstack=0, lookup_timeout_s=DEADLINE_S
    )


def publish(url: str, item_hash: str, r: StoreReader) -> None:
    """The item's entry in the store, written as an encoder writes it."""
    store = MooncakeStore(StoreAddress.parse(url))
    try:
        embeds = torch.randn(8, HIDDEN, generator=torch.Generator().manual_seed(1))
        key = r.key(item_hash)
        store.put(key, entry_parts(key, MODEL, embeds, ()))
    finally:
        store.close()


def timed_has(presence: Presence, item_hash: str) -> tuple[bool, float]:
    t0 = time.monotonic()
    answer = presence.has(item_hash)
    presence.end_pass()
    return answer, time.monotonic() - t0


def test_a_slow_exists_is_absent_at_the_deadline(store_cluster, monkeypatch):
    """Mooncake's `exists` delayed 5 s (the real call, after a sleep): the presence check
    answers "absent" at its deadline, the next one at once while the store is left alone, and
    the item is present again once the store answers in time."""
    r = reader(store_cluster.url)
    try:
        assert r.ready(30), "the reader did not connect"
        held = "c1" * 16
        publish(store_cluster.url, held, r)
        assert timed_has(Presence(r), held)[0] is True
        real = MooncakeStore.exists

        def slow(self: MooncakeStore, key: str) -> bool:
            time.sleep(5.0)
            return real(self, key)

        monkeypatch.setattr(MooncakeStore, "exists", slow)
        presence = Presence(r)
        answer, took = timed_has(presence, held)
        assert answer is False
        assert took < DEADLINE_S + SLACK_S, f"the check took {took:.2f} s"
        answer, took = timed_has(presence, held)
        assert answer is False and took < 0.1, took  # left alone: not asked
        monkeypatch.undo()
        time.sleep(5.0)  # the slow call ends
        deadline = time.monotonic() + 10
        while not presence.has(held):
            presence.end_pass()
            assert time.monotonic() < deadline, "the store was never asked again"
            time.sleep(RETRY_AFTER_S / 2)
    finally:
        r.close()


@pytest.fixture
def silent_master() -> Iterator[str]:
    """A master address whose port accepts connections and never answers (a master that hangs,
    or another program on its port): Mooncake's setup retries it for about a minute and a half."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(64)
        port = s.getsockname()[1]
        metadata = f"http://127.0.0.1:{port}/metadata"
        yield f"mooncake://127.0.0.1:{port}?metadata={metadata}&retry_s=1"


def test_an_absent_master_never_holds_a_presence_check(mooncake, silent_master):
    """The reader is made (as vLLM builds the connector) and asked, again and again for a few
    seconds, against a master that does not answer: the construction and every check return
    within the deadline, each "absent", and no thread of the process is held meanwhile (the
    setup, which holds the GIL while it retries, never runs in it); closing does not wait."""
    t0 = time.monotonic()
    r = reader(silent_master)
    try:
        assert time.monotonic() - t0 < SLACK_S, "making the reader waited on the connect"
        presence = Presence(r, retry_after_s=0.0)
        last = time.monotonic()
        while time.monotonic() - t0 < 5.0:
            answer, took = timed_has(presence, "d" * 32)
            assert answer is False
            assert took < DEADLINE_S + SLACK_S, f"a check took {took:.2f} s"
            time.sleep(0.05)
            now = time.monotonic()
            assert now - last < DEADLINE_S + SLACK_S, f"the process stood still {now - last:.2f} s"
            last = now
        assert not r.ready()
    finally:
        t0 = time.monotonic()
        r.close()
        assert time.monotonic() - t0 < SLACK_S


def test_a_store_that_comes_up_later_is_found(mooncake, tmp_path):
    """The store is down when the reader is made: checks are "absent" at once, and once the
    master and holder are up the reader connects (after `retry_s`) and finds the item."""
    c = cluster.Cluster(tmp_path)
    r = reader(c.url)
    try:
        presence = Presence(r)
        answer, took = timed_has(presence, "e" * 32)
        assert answer is False and took < DEADLINE_S + SLACK_S
        c.start()
        held = "e1" * 16
        publish(c.url, held, r)
        deadline = time.monotonic() + 60
        while not presence.has(held):
            presence.end_pass()
            assert time.monotonic() < deadline, "the reader never connected"
            time.sleep(0.5)
    finally:
        r.close()
        c.stop()


def test_a_generic_checkpoint_is_read_by_the_identity_of_its_folder(store_cluster, tmp_path):
    """A Gemma 3 folder (no native spec): the reader an engine builds from the folder alone
    (`identity_for`, as vLLM's connector does) reads the rows the generic encoder made, keyed as
    `mmferry serve --store` keys them (`[tokens, hidden]`, no deepstack), into the engine's
    dtype; a reader that names the native family's identity of a Qwen folder finds nothing the
    generic family published for it."""
    import mmferry as mf
    from mmferry.store.engine import identity_for
    from mmferry.testing.families import save_family_checkpoint
    from tests.engines.tiny_vlm import build_checkpoint, image

    folder = save_family_checkpoint("gemma3", tmp_path / "gemma3")
    proc, enc = mf.Processor.from_pretrained(folder), mf.VisionEncoder.from_pretrained(folder)
    item = proc.images([image(56, 56, 0)])[0]
    (out,) = enc([item])
    service_side = ModelIdentity.of_checkpoint(folder, "generic")
    assert identity_for(str(folder)) == service_side
    store = MooncakeStore(StoreAddress.parse(store_cluster.url))
    n, d = out.embeds.shape
    r = StoreReader(
        store_cluster.url, identity_for(str(folder)), dtype=torch.float32, hidden=d, deepstack=0
    )
    try:
        key = r.key(item.hash)
        store.put(key, entry_parts(key, service_side, out.embeds, out.deepstack))
        assert r.ready(30), "the reader did not connect"
        rows = r.load({item.hash: n}, torch.device("cpu"), torch.bfloat16)
        assert torch.equal(rows[item.hash], out.embeds.to(torch.bfloat16))
        # A Qwen folder's rows published by a `--family generic` service: a reader of that
        # identity finds them, a reader of the native one (the connector's default) does not.
        qwen = build_checkpoint("qwen2_5_vl", tmp_path / "qwen")
        gen = identity_for(str(qwen), "generic")
        gkey = entry_key(item.hash, gen, torch.float32)
        store.put(gkey, entry_parts(gkey, gen, out.embeds, ()))
        for family, found in (("generic", True), (None, False)):
            other = StoreReader(
                store_cluster.url,
                identity_for(str(qwen), family),
                dtype=torch.float32,
                hidden=d,
                deepstack=0,
            )
            try:
                assert other.ready(30)
                assert (other.identity == gen) is found
                assert other.lookup_pins([item.hash]) == [other.lease_s if found else 0.0]
                got = other.load({item.hash: n}, torch.device("cpu"), torch.float32)
                assert list(got) == ([item.hash] if found else [])
            finally:
                other.close()
    finally:
        r.close()
        store.close()
