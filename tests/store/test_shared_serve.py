"""A pool of `mmferry serve --store` processes sharing one Mooncake Store on loopback: one
encodes, the other answers from the store without an encoder call; bad entries are refused and
re-encoded; a master that stops costs no request and comes back."""

from __future__ import annotations

import re
import signal
import time

import httpx
import pytest
import torch

from mmferry.server.client import EncoderClient, image_part
from mmferry.store.entry import ModelIdentity, entry_key, entry_parts, read_entry
from mmferry.store.mooncake import MooncakeStore, StoreAddress
from tests.server.conftest import DEPTH, IMAGE_MAX_PIXELS, png
from tests.store import cluster

pytestmark = pytest.mark.slow


def start_server(store: str) -> cluster.Service:
    """`mmferry serve --store STORE` with the one-layer random tower."""
    args = ["--depth", str(DEPTH), "--max-pixels", str(IMAGE_MAX_PIXELS), "--store", store]
    return cluster.start_service(args)


def metric(server, name: str) -> float:
    """The sum of a counter's samples (all labels) in the service's /metrics."""
    text = httpx.get(server.url + "/metrics", timeout=30).text
    pat = re.compile(rf"^{name}(_total)?(\{{[^}}]*\}})? (\S+)$", re.M)
    return sum(float(m.group(3)) for m in pat.finditer(text))


def wait_for(check, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def identity(server) -> ModelIdentity:
    """The model identity the service keys its entries with (printed at start)."""
    text = "".join(server.lines)
    m = re.search(r"shared through SharedStore\(\S+, ([^@\s]+)@([0-9a-f]+)\)", text)
    assert m, text
    return ModelIdentity(m.group(1), m.group(2))


def encode(server, seed: int):
    with EncoderClient(server.url) as c:
        (item,) = c.encode([image_part(png(64, 64, seed))])
    return item


def same_bytes(a, b) -> bool:
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.fixture(scope="module")
def pool(store_cluster):
    servers = []
    try:
        for _ in range(2):
            servers.append(start_server(store_cluster.url))
        yield servers
    finally:
        for s in servers:
            s.stop()


@pytest.fixture(scope="module")
def client(store_cluster):
    store = MooncakeStore(StoreAddress.parse(store_cluster.url))
    yield store
    store.close()


def test_second_encoder_takes_the_first_ones_rows(pool):
    e1, e2 = pool
    assert identity(e1) == identity(e2)
    first = encode(e1, seed=100)
    wait_for(lambda: metric(e1, "mmferry_store_published") >= 1, "encoder 1's publication")
    assert metric(e1, "mmferry_store_bytes") > first.embeds.numel() * 4
    encoded = metric(e2, "mmferry_encoded_items")
    second = encode(e2, seed=100)
    assert metric(e2, "mmferry_encoded_items") == encoded  # no encoder call
    assert metric(e2, "mmferry_store_hits") == 1
    assert second.hash == first.hash
    assert same_bytes(second.embeds, first.embeds)
    assert len(second.deepstack) == len(first.deepstack) > 0
    for a, b in zip(second.deepstack, first.deepstack):
        assert same_bytes(a, b)
    # Encoder 2 does not publish what it took from the store; a new item is a miss there.
    encode(e2, seed=101)
    assert metric(e2, "mmferry_encoded_items") == encoded + 1
    assert metric(e2, "mmferry_store_misses") >= 1


def _corrupt(key: str, model: ModelIdentity, good: bytes, how: str) -> list:
    if how == "foreign":  # another model's rows under this model's key
        embeds = torch.frombuffer(bytearray(good[-4096:]), dtype=torch.float32)
        other = ModelIdentity(model.name, "f" * 32)
        rows = embeds.view(1, -1).expand(64, -1).contiguous()[:, :16]
        return entry_parts(key, other, rows, ())
    if how == "truncated":
        return [good[:-256]]
    assert how == "header"
    return [good.replace(b'"deepstack":', b'"deepstacK":', 1)]


@pytest.mark.parametrize("how", ["foreign", "truncated", "header"])
def test_bad_entries_are_refused_and_replaced(pool, client, how):
    e1, e2 = pool
    seed = {"foreign": 200, "truncated": 201, "header": 202}[how]
    model = identity(e1)
    published = metric(e1, "mmferry_store_published")
    first = encode(e1, seed)
    wait_for(lambda: metric(e1, "mmferry_store_published") > published, "publication")
    key = entry_key(first.hash, model, torch.float32)
    good = bytes(client.get(key).numpy())
    client.put(key, _corrupt(key, model, good, how), replace=True)
    refused, encoded = metric(e2, "mmferry_store_refused"), metric(e2, "mmferry_encoded_items")
    second = encode(e2, seed)
    assert metric(e2, "mmferry_store_refused") == refused + 1
    assert metric(e2, "mmferry_encoded_items") == encoded + 1  # re-encoded, not fed
    assert same_bytes(second.embeds, first.embeds)
    # Encoder 2 replaced the bad entry with its own rows.
    n, d = first.embeds.shape

    def fixed() -> bool:
        data = client.get(key)
        try:
            read_entry(
                data,
                key=key,
                model=model,
                dtype=torch.float32,
                num_tokens=n,
                hidden=d,
                deepstack=len(first.deepstack),
            )
        except ValueError:
            return False
        return True

    wait_for(fixed, "the replaced entry")


def test_master_stopped_mid_run_degrades_then_recovers(pool, store_cluster):
    e1, e2 = pool
    store_cluster.stop_master()
    try:
        t0 = time.monotonic()
        got = encode(e1, seed=300)  # no store: encoded here, rows over HTTP
        assert got.embeds.shape[0] == got.num_tokens
        assert time.monotonic() - t0 < 20
        wait_for(lambda: metric(e1, "mmferry_store_errors") >= 1, "a counted store error")
        wait_for(lambda: "failed" in "".join(e1.lines), "a logged store error")
        again = encode(e2, seed=300)  # encoder 2 encodes it too: same rows
        assert same_bytes(again.embeds, got.embeds)
    finally:
        store_cluster.start_master()
    # Back: a new item published by encoder 1 is taken by encoder 2 from the store.
    seed, deadline = 400, time.monotonic() + 60
    while True:
        published = metric(e1, "mmferry_store_published")
        encode(e1, seed)
        time.sleep(0.5)
        if metric(e1, "mmferry_store_published") > published:
            break
        assert time.monotonic() < deadline, "encoder 1 never published again"
        seed += 1
    hits, encoded = metric(e2, "mmferry_store_hits"), metric(e2, "mmferry_encoded_items")
    encode(e2, seed)
    assert metric(e2, "mmferry_store_hits") == hits + 1
    assert metric(e2, "mmferry_encoded_items") == encoded
    assert "answers again" in "".join(e1.lines)


def test_engine_reads_rows_of_a_killed_encoder(pool, store_cluster):
    """An engine's reader takes encoder 1's rows from the store after encoder 1 is SIGKILLed:
    `[main | ds0 | ...]` rows, byte for byte what encoder 1 answered; an item it lacks or whose
    entry does not fit the item is left out (the connector then loads it another way)."""
    from mmferry.embed.packed import packed_rows
    from mmferry.store.engine import StoreReader, identity_for

    e1, _ = pool
    model = identity(e1)
    published = metric(e1, "mmferry_store_published")
    first = encode(e1, seed=600)
    wait_for(lambda: metric(e1, "mmferry_store_published") > published, "publication")
    e1.proc.send_signal(signal.SIGKILL)
    e1.proc.wait(timeout=30)
    n, d = first.embeds.shape
    levels = len(first.deepstack)
    reader = StoreReader(
        store_cluster.url,
        identity_for(f"{model.name}@{model.weights}"),
        dtype=torch.float32,
        hidden=d,
        deepstack=levels,
    )
    try:
        assert reader.ready(30), "the reader did not connect"
        absent = "0" * 32
        assert reader.lookup_pins([first.hash, absent]) == [reader.lease_s, 0.0]
        rows = reader.load({first.hash: n, absent: n}, torch.device("cpu"), torch.bfloat16)
        assert list(rows) == [first.hash]
        want = packed_rows(first.embeds, first.deepstack, dtype=torch.bfloat16)
        assert rows[first.hash].shape == (n, d * (1 + levels))
        assert same_bytes(rows[first.hash], want)
        # The plan says another token count: the entry is not this item's, and is refused.
        assert reader.load({first.hash: n + 4}, torch.device("cpu"), torch.float32) == {}
    finally:
        reader.close()
    with pytest.raises(ValueError, match="NAME@WEIGHTS"):
        identity_for("no-weights-here")


def test_store_absent_at_start_costs_no_request(mooncake, tmp_path):
    """A service started before its store answers at once from its own encoder (the connect
    runs in the background, refused in a moment rather than Mooncake's minute and a half of
    retries) and publishes once the master is up."""
    c = cluster.Cluster(tmp_path)
    server = start_server(c.url)
    try:
        t0 = time.monotonic()
        got = encode(server, seed=700)
        assert got.embeds.shape[0] == got.num_tokens
        assert time.monotonic() - t0 < 20
        wait_for(lambda: metric(server, "mmferry_store_errors") >= 1, "a counted connect error")
        c.start()
        seed, deadline = 701, time.monotonic() + 60
        while metric(server, "mmferry_store_published") < 1:
            assert time.monotonic() < deadline, "never published once the store was up"
            encode(server, seed)
            seed += 1
            time.sleep(0.5)
    finally:
        server.stop()
        c.stop()
