"""The Mooncake client against a real master and holder on loopback TCP."""

from __future__ import annotations

import time

import pytest
import torch

from mmferry.store.entry import ModelIdentity, entry_key, entry_parts, read_entry
from mmferry.store.mooncake import MooncakeStore, StoreAddress, StoreError

MODEL = ModelIdentity("tiny", "a" * 32)


def test_address_parsing():
    a = StoreAddress.parse("mooncake://10.0.0.5:50051?metadata=http://10.0.0.5:8080/metadata")
    assert (a.master, a.metadata, a.protocol, a.retry_s) == (
        "10.0.0.5:50051",
        "http://10.0.0.5:8080/metadata",
        "tcp",
        5.0,
    )
    a = StoreAddress.parse("mooncake://m:1?metadata=x&local_mib=8&retry_s=0.5&host=h")
    assert (a.local_bytes, a.retry_s, a.local_host()) == (8 << 20, 0.5, "h")
    assert (a.lookup_s, StoreAddress.parse("mooncake://m:1?metadata=x&lookup_s=0.25").lookup_s) == (
        1.0,
        0.25,
    )
    assert (a.publish_s, StoreAddress.parse("mooncake://m:1?metadata=x&publish_s=2").publish_s) == (
        5.0,
        2.0,
    )
    for bad, why in [
        ("redis://m:1?metadata=x", "mooncake://"),
        ("mooncake://m?metadata=x", "mooncake://"),
        ("mooncake://m:1", "metadata"),
        ("mooncake://m:1?metadata=x&ttl=3", "unknown store parameter"),
        ("mooncake://m:1?metadata=x&local_mib=big", "numbers"),
        ("mooncake://m:1?metadata=x&local_mib=0", "positive"),
        ("mooncake://m:1?metadata=x&lookup_s=0", "positive"),
        ("mooncake://m:1?metadata=x&lookup_s=soon", "numbers"),
        ("mooncake://m:1?metadata=x&publish_s=0", "positive"),
        ("mooncake://m:1?metadata=x&publish_s=later", "numbers"),
    ]:
        with pytest.raises(ValueError, match=why):
            StoreAddress.parse(bad)


def _read(store: MooncakeStore, key: str) -> torch.Tensor:
    """The rows of `_entry`'s entry under `key`, checked by `read_entry`."""
    rows, _ = read_entry(
        store.get(key),
        key=key,
        model=MODEL,
        dtype=torch.float32,
        num_tokens=64,
        hidden=32,
        deepstack=0,
    )
    return rows


def _entry(key: str, seed: int) -> tuple[list, torch.Tensor]:
    embeds = torch.randn(64, 32, generator=torch.Generator().manual_seed(seed))
    return entry_parts(key, MODEL, embeds, ()), embeds


def test_round_trip_first_writer_and_replace(store_cluster):
    store = MooncakeStore(StoreAddress.parse(store_cluster.url + "&local_mib=1"))
    try:
        key = entry_key("01" * 16, MODEL, torch.float32)
        assert store.get(key) is None
        parts, embeds = _entry(key, 0)
        assert store.put(key, parts) == sum(memoryview(p).nbytes for p in parts)
        got = _read(store, key)
        assert torch.equal(got, embeds)
        # A second put keeps the first writer's rows; a replace overwrites them.
        other, other_embeds = _entry(key, 1)
        store.put(key, other)
        got = _read(store, key)
        assert torch.equal(got, embeds)
        store.put(key, other, replace=True)
        got = _read(store, key)
        assert torch.equal(got, other_embeds)
        # An entry larger than the client's staging buffer is not published, and says why.
        big = [torch.zeros(2 << 20, dtype=torch.uint8).numpy()]
        with pytest.raises(StoreError, match="buffer"):
            store.put(entry_key("02" * 16, MODEL, torch.float32), big)
        assert store.get(entry_key("02" * 16, MODEL, torch.float32)) is None
        assert store.available()  # a refused entry is no reason to leave the store alone
    finally:
        store.close()


def test_master_down_opens_the_breaker_then_recovers(mooncake, tmp_path):
    from tests.store.cluster import Cluster

    c = Cluster(tmp_path).start()
    store = None
    try:
        store = MooncakeStore(StoreAddress.parse(c.url))
        key = entry_key("03" * 16, MODEL, torch.float32)
        parts, _ = _entry(key, 3)
        store.put(key, parts)
        c.stop_master()
        with pytest.raises(StoreError):
            store.put(entry_key("04" * 16, MODEL, torch.float32), parts)
        assert not store.available()
        t0 = time.monotonic()
        with pytest.raises(StoreError, match="left alone"):
            store.get(key)  # no call while the breaker is open: at once
        assert time.monotonic() - t0 < 0.5
        c.start_master()
        deadline = time.monotonic() + 30
        while True:
            time.sleep(0.5)
            try:
                key2 = entry_key("05" * 16, MODEL, torch.float32)
                store.put(key2, _entry(key2, 5)[0])
                break
            except StoreError:
                assert time.monotonic() < deadline, "the store did not come back"
        assert store.get(key2) is not None
    finally:
        if store is not None:
            store.close()
        c.stop()


def test_full_store_costs_only_that_put(mooncake, tmp_path):
    """A store without room refuses the put (counted by the caller) but is not left alone: the
    next lookup still goes to it."""
    from tests.store.cluster import Cluster

    # NOTE: the store must stay full: the first entry's lease (10 s by default) could run out
    # between the two puts on a loaded machine and the master then evicts it to make room, so
    # the lease is long and eviction is off (with a 1 ms lease and eviction on, the second put
    # succeeds: the failure seen in full runs).
    no_eviction = (
        "--default_kv_lease_ttl=300s",
        "--eviction_ratio=0",
        "--eviction_high_watermark_ratio=1.0",
    )
    c = Cluster(tmp_path, segment="16 MB", master_args=no_eviction).start()
    store = None
    try:
        store = MooncakeStore(StoreAddress.parse(c.url + "&local_mib=16"))
        big = entry_key("06" * 16, MODEL, torch.float32)
        store.put(big, [torch.zeros(15 << 20, dtype=torch.uint8).numpy()])
        with pytest.raises(StoreError, match="code"):
            store.put(
                entry_key("07" * 16, MODEL, torch.float32),
                [torch.ones(2 << 20, dtype=torch.uint8).numpy()],
            )
        assert store.available()
        assert store.get(big) is not None
    finally:
        if store is not None:
            store.close()
        c.stop()


def test_a_cluster_whose_port_is_taken_before_its_master_binds_starts_on_fresh_ports(
    mooncake, tmp_path
):
    """A port free when chosen can be taken before the master binds it (CI once saw the master
    exit so): the first start picks fresh ports, and the store then works on them."""
    import socket

    from tests.store.cluster import Cluster

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        busy = taken.getsockname()[1]
        c = Cluster(tmp_path, metrics=busy).start()
    store = None
    try:
        assert c.metrics != busy
        assert "Address already in use" in (tmp_path / "mooncake_master.log").read_text()
        store = MooncakeStore(StoreAddress.parse(c.url))
        key = entry_key("07" * 16, MODEL, torch.float32)
        parts, embeds = _entry(key, 7)
        store.put(key, parts)
        got = _read(store, key)
        assert torch.equal(got, embeds)
    finally:
        if store is not None:
            store.close()
        c.stop()
