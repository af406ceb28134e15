"""vLLM fed from a Mooncake Store: `MmferryECConnector` with `transport: mooncake` reads the rows
an encoder published, straight from the store, after that encoder was SIGKILLed.

A real master and holder on loopback TCP, two `mmferry serve --store` processes on the tiny
checkpoint, and a vLLM consumer pointed at the second one: requests carry only each item's grid
and hash, so vLLM can neither encode them nor get them from the second encoder (which never saw
them); it answers as vLLM's own pixel path does. An entry replaced by another model's rows is
refused by the reader, and the item's rows come from the service that holds them instead.
"""

from __future__ import annotations

import re
import signal
import time

import httpx
import pytest
import torch

from mmferry.engines.vllm import to_vllm_refs
from mmferry.store.entry import ModelIdentity, entry_key, entry_parts
from mmferry.store.mooncake import MooncakeStore, StoreAddress
from tests.engines import vllm_harness
from tests.engines.cases import cases, pixel_request
from tests.engines.conftest import start_engines
from tests.engines.test_vllm_connector import encode
from tests.engines.tiny_vlm import image
from tests.store import cluster

pytestmark = pytest.mark.slow
LOGPROB_ATOL = 1e-4


def metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=30).text
    pat = re.compile(rf"^{name}(_total)?(\{{[^}}]*\}})? (\S+)$", re.M)
    return sum(float(m.group(3)) for m in pat.finditer(text))


def wait_for(check, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    if not cluster.installed():
        pytest.fail(f"Mooncake is missing ({cluster.MOONCAKE}); run `make mooncake-venv`")
    cluster.import_here()
    c = cluster.Cluster(tmp_path_factory.mktemp("mooncake"))
    try:
        yield c.start()
    finally:
        c.stop()


@pytest.fixture(scope="module")
def pools(models, store):
    started: dict[str, list[cluster.Service]] = {}
    try:
        for family, m in models.items():
            started[family] = [
                cluster.start_service(
                    ["--model", str(m.path), "--store", store.url, "--shm-mib", "16"]
                )
                for _ in range(2)
            ]
        yield started
    finally:
        for pair in started.values():
            for s in pair:
                s.stop()


@pytest.fixture(scope="module")
def store_consumers(models, pools, store, tmp_path_factory, monkeypatch_module):
    # vLLM's processes get Mooncake's folder and libraries too (the connector imports it).
    plain = vllm_harness.vllm_env
    monkeypatch_module.setattr(
        vllm_harness, "vllm_env", lambda in_process=True: {**plain(in_process), **cluster.env()}
    )
    started = {}
    try:
        for family in models:
            config = {
                "ec_connector": "MmferryECConnector",
                "ec_connector_module_path": "mmferry.engines.vllm_connector",
                "ec_role": "ec_consumer",
                "ec_connector_extra_config": {
                    "url": pools[family][1].url,
                    "transport": "mooncake",
                    "store": store.url,
                },
            }
            started.update(
                start_engines(
                    {family: models[family]},
                    tmp_path_factory,
                    "vllm-store",
                    ec_transfer_config=config,
                )
            )
        yield started
    finally:
        for e in started.values():
            e.stop()


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_vllm_reads_a_killed_encoders_rows_from_the_store(
    family, models, engines, pools, store, store_consumers
):
    m = models[family]
    e1, e2 = pools[family]
    case = cases(m.proc.config.factor)["images"]
    (want,) = engines[family].generate([pixel_request(case)])
    facts = encode(e1, case.media)
    n = len({f["hash"] for f in facts})
    wait_for(lambda: metric(e1.url, "mmferry_store_published") >= n, "encoder 1's publication")
    e1.proc.send_signal(signal.SIGKILL)
    e1.proc.wait(timeout=30)
    got = store_consumers[family].generate([to_vllm_refs(facts).prompt(case.text)])
    assert not isinstance(got, dict), (got, "".join(store_consumers[family].lines[-30:]))
    (res,) = got
    assert len(res.tokens) == 16
    assert res.tokens == want.tokens
    assert res.max_logprob_diff(want) <= LOGPROB_ATOL
    assert metric(e2.url, "mmferry_encoded_items") == 0  # encoder 2 made none of these rows

    # Another model's rows under an item's key: refused by the reader, never fed to vLLM; the
    # service that holds the item answers instead (encoder 2 encodes and publishes it here).
    factor = m.proc.config.factor
    case = type(case)(
        "fresh",
        "hello <|vision_start|><|image_pad|><|vision_end|> what ?",
        [("image", image(2 * factor, 3 * factor, 7))],
    )
    (want,) = engines[family].generate([pixel_request(case)])
    facts = encode(e2, case.media)
    wait_for(lambda: metric(e2.url, "mmferry_store_published") >= 1, "encoder 2's publication")
    client = MooncakeStore(StoreAddress.parse(store.url))
    try:
        mine = re.search(r"shared through SharedStore\(\S+, (\S+)@([0-9a-f]+)\)", "".join(e2.lines))
        model = ModelIdentity(mine.group(1), mine.group(2))
        key = entry_key(facts[0]["hash"], model, torch.float32)
        good = client.get(key)
        assert good is not None
        foreign = ModelIdentity(model.name, "f" * 32)
        rows = torch.randn(facts[0]["num_tokens"], 8)
        client.put(key, entry_parts(key, foreign, rows, ()), replace=True)
    finally:
        client.close()
    got = store_consumers[family].generate([to_vllm_refs(facts).prompt(case.text)])
    assert not isinstance(got, dict), (got, "".join(store_consumers[family].lines[-30:]))
    (res,) = got
    assert res.tokens == want.tokens
    assert res.max_logprob_diff(want) <= LOGPROB_ATOL
    assert "refused the entry" in "".join(store_consumers[family].lines)
