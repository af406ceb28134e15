"""vLLM on host V with `MmferryECConnector` (`transport: mooncake`) beside `mmferry serve
--store` on E1 and E2 and the Mooncake master and holder on S: V's greedy tokens and top
logprobs from rows E1 published and V read from S over the network (the entry's bytes on V's
link) equal its own pixel path's; then V is cut from S alone (E1 and E2 still reach S): its
request still finishes, with the rows from the service path (E1 over HTTP), the same answer.
Requests carry only each item's grid and hash, so vLLM can encode nothing itself: an answer
proves the rows came from across the network."""

from __future__ import annotations

import json
import subprocess
import time
from types import SimpleNamespace

import httpx
import pytest

import mmferry as mf
from mmferry.engines.vllm import to_vllm_refs
from tests.cluster import mooncake, stack
from tests.engines import vllm_harness
from tests.engines.cases import Case, pixel_request
from tests.engines.conftest import needs_vllm
from tests.engines.test_vllm_connector import encode
from tests.engines.tiny_vlm import build_checkpoint, image
from tests.store import cluster as local

pytestmark = pytest.mark.skipif(not local.installed(), reason="needs `make mooncake-venv`")
LOGPROB_ATOL = 1e-4
LOOKUP_TIMEOUT_S = 1.0


@pytest.fixture(scope="module")
def site(make_net, tmp_path_factory):
    needs_vllm()
    net = make_net(["s", "e1", "e2", "v"])
    model = build_checkpoint("qwen2_5_vl", tmp_path_factory.mktemp("qwen2_5_vl"), max_tokens=256)
    store = mooncake.Store(net["s"]).start(net)
    urls = {}
    for name in ("e1", "e2"):
        h = net[name]
        args = ["-m", "mmferry", "serve", "--model", str(model), "--host", h.addr]
        args += ["--port", "0", "--shm-mib", "0", "--store", store.url]
        urls[name] = stack.start(net, h, f"serve-{name}", args, extra_env=mooncake.env(h))
    v = net["v"]
    config = {
        "ec_connector": "MmferryECConnector",
        "ec_connector_module_path": "mmferry.engines.vllm_connector",
        "ec_role": "ec_consumer",
        "ec_connector_extra_config": {
            "urls": [urls["e1"], urls["e2"]],
            "transport": "mooncake",
            "store": store.url,
            "lookup_timeout_s": LOOKUP_TIMEOUT_S,
        },
    }
    opts = {**vllm_harness.ENGINE_OPTIONS, "ec_transfer_config": config}
    work = tmp_path_factory.mktemp("vllm")
    env = {**vllm_harness.vllm_env(True), **local.env(), "MC_TCP_BIND_ADDRESS": v.addr}
    cmd = [str(vllm_harness.VLLM_PYTHON), str(vllm_harness.DRIVER), str(model), json.dumps(opts)]
    proc = subprocess.Popen(
        v.command(cmd),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        cwd=work,
        start_new_session=True,
    )
    v.procs.append(proc)
    engine = vllm_harness.VllmEngine(proc, work)
    engine._follow()
    engine._wait(lambda: any("vllm-driver: ready" in x for x in engine.lines), 600)
    factor = mf.Processor.from_pretrained(model).config.factor
    try:
        yield net, urls, engine, factor
    finally:
        engine.stop()
        (work / "engine.log").write_text("".join(engine.lines))


def case(factor: int, seed: int) -> Case:
    return Case(
        f"img{seed}",
        "hello <|vision_start|><|image_pad|><|vision_end|> what ?",
        [("image", image(16 * factor, 16 * factor, seed))],  # 256 tokens: 64 KiB of rows
    )


def published(url: str) -> float:
    return stack.scrape(url, "mmferry_store_published_total")


def wait_for(check, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def test_vllm_on_v_reads_rows_from_s_then_from_e1_when_cut_from_s(site):
    net, urls, engine, factor = site
    v, s = net["v"], net["s"]
    e1 = SimpleNamespace(url=urls["e1"], proc=None, lines=[])

    c = case(factor, 11)
    (want,) = engine.generate([pixel_request(c)])
    facts = encode(e1, c.media)
    wait_for(lambda: published(urls["e1"]) >= 1, "E1's publication")
    s_sent, v_got = s.counters()[1], v.counters()[0]
    t = time.monotonic()
    got = engine.generate([to_vllm_refs(facts).prompt(c.text)])
    print(f"\nfrom S: answered in {time.monotonic() - t:.2f} s")
    assert not isinstance(got, dict), (got, "".join(engine.lines[-30:]))
    (res,) = got
    assert res.tokens == want.tokens
    assert res.max_logprob_diff(want) <= LOGPROB_ATOL
    rows = facts[0]["num_tokens"] * 4 * 64  # float32 rows of the tiny model's 64-wide LM
    moved_s, moved_v = s.counters()[1] - s_sent, v.counters()[0] - v_got
    print(f"\nrows {rows} B; S sent {moved_s} B, V received {moved_v} B")
    assert moved_s >= rows and moved_v >= rows
    # E1 and E2 made none of these rows over HTTP for V: no load answered by them.
    loads = sum(stack.scrape(u, "mmferry_requests_total") for u in urls.values())

    # V cut from S alone; E1 still holds the item in its cache and reaches S.
    c2 = case(factor, 12)
    (want2,) = engine.generate([pixel_request(c2)])
    facts2 = encode(e1, c2.media)
    wait_for(lambda: published(urls["e1"]) >= 2, "E1's second publication")
    v.cut_from(s)
    try:
        t = time.monotonic()
        print(f"cut at {time.time():.3f}")
        got = engine.generate([to_vllm_refs(facts2).prompt(c2.text)])
        took = time.monotonic() - t
        assert not isinstance(got, dict), (got, "".join(engine.lines[-30:]))
        (res2,) = got
        assert res2.tokens == want2.tokens
        assert res2.max_logprob_diff(want2) <= LOGPROB_ATOL
        print(f"V cut from S: answered in {took:.2f} s")
        # The store's lookup deadline (1 s), then the rows from E1 over HTTP, well inside the
        # connector's timeout_s (30 s): without the reader's deadlines the worker's read of
        # the store waited 124 s here, for Mooncake to give up.
        assert took < 20.0, took
        assert stack.scrape(urls["e1"], "mmferry_requests_total") > loads  # E1 served it
        httpx.get(f"{urls['e1']}/health", timeout=5).raise_for_status()
    finally:
        v.heal_from(s)
