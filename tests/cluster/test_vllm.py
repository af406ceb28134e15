"""vLLM's OpenAI server on host V with `MmferryECConnector` (`transport: mooncake`) beside `mmferry
serve --store` on E1 and E2, the Mooncake master and holder on S, and `mmferry proxy --mode
connector` on P, each on its own network stack (one vLLM start for the module).

- V's greedy tokens and top logprobs from rows E1 published and V read from S over the network
  (the entry's bytes on V's link) equal its own pixel path's; then V is cut from S alone (E1 and
  E2 still reach S): its request still finishes, with the rows from the service path (E1 over
  HTTP), the same answer. These requests carry only each item's grid and hash, so vLLM can
  encode nothing itself: an answer proves the rows came from across the network.
- Through P at a steady rate, E1's link goes down (E1 lives on) and comes back: no request
  fails, none waits past the proxy's `--encoder-timeout` plus one answer, each answer is vLLM's
  own for the same image sent as pixels, and E1 is used again once its link is back."""

from __future__ import annotations

import json
import statistics
import time
from types import SimpleNamespace

import httpx
import pytest

import mmferry as mf
from tests.cluster import mooncake, stack
from tests.cluster.load import Load, down_then_used_again
from tests.engines.cases import Case
from tests.engines.conftest import needs_vllm
from tests.engines.test_vllm_connector import encode
from tests.engines.tiny_vlm import build_checkpoint, image
from tests.proxy.conftest import Answer, _ids, chat, chat_body, first_choice, image_part
from tests.store import cluster as local

pytestmark = pytest.mark.skipif(not local.installed(), reason="needs `make mooncake-venv`")
LOOKUP_TIMEOUT_S = 1.0
TEXT = {"type": "text", "text": "what ?"}
# The proxy's deadlines on P: short, so a silent encoder costs seconds (its defaults are longer).
ENCODER_TIMEOUT_S = 6.0
CONNECT_TIMEOUT_S = 1.0
ANSWER_MARGIN_S = 3.0  # one encode of a small image on E2 and vLLM's answer, on 2 CPUs
NEW_TOKENS = 2
RATE = 1.5
IMAGES = 8


@pytest.fixture(scope="module")
def site(make_net, tmp_path_factory):
    needs_vllm()
    net = make_net(["s", "e1", "e2", "v", "p"])
    model = build_checkpoint("qwen2_5_vl", tmp_path_factory.mktemp("qwen2_5_vl"), max_tokens=256)
    store = mooncake.Store(net["s"]).start(net)
    urls = {}
    for name in ("e1", "e2"):
        h = net[name]
        args = ["-m", "mmferry", "serve", "--model", str(model), "--host", h.addr]
        args += ["--port", "0", "--shm-mib", "0", "--store", store.url]
        urls[name] = stack.start(net, h, f"serve-{name}", args, extra_env=mooncake.env(h))
    connector = {
        "urls": [urls["e1"], urls["e2"]],
        "transport": "mooncake",
        "store": store.url,
        "lookup_timeout_s": LOOKUP_TIMEOUT_S,
    }
    llm = stack.vllm(net, net["v"], model, connector)
    p = net["p"]
    args = ["-m", "mmferry", "proxy", "--llm", llm, "--encoder", urls["e1"]]
    args += ["--encoder", urls["e2"], "--mode", "connector", "--dtype", "float32"]
    args += ["--host", p.addr, "--port", "0", "--encoder-timeout", str(ENCODER_TIMEOUT_S)]
    args += ["--connect-timeout", str(CONNECT_TIMEOUT_S)]
    proxy = stack.start(net, p, "proxy", args)
    factor = mf.Processor.from_pretrained(model).config.factor
    return SimpleNamespace(net=net, urls=urls, llm=llm, proxy=proxy, model=model, factor=factor)


def case(factor: int, seed: int) -> Case:
    return Case(
        f"img{seed}",
        "what ?",
        [("image", image(16 * factor, 16 * factor, seed))],  # 256 tokens: 64 KiB of rows
    )


def published(url: str) -> float:
    return stack.scrape(url, "mmferry_store_published_total")


def wait_for(check, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def pixels(site, c: Case) -> Answer:
    """vLLM's own answer: the image's pixels sent to it, its own encoding."""
    want = chat(site.llm, site.model, [image_part(c.media[0][1]), TEXT])
    assert want.status == 200 and want.tokens, want.text
    return want


def by_reference(site, facts: list[dict]) -> Answer:
    """The item sent by its grid and hash alone: vLLM's connector must load its rows."""
    (f,) = facts
    part = {"image_grid_thw": list(f["grid_thw"])}
    return chat(
        site.llm,
        site.model,
        [{"type": "image_embeds", "image_embeds": part, "uuid": f["hash"]}, TEXT],
    )


def test_vllm_on_v_reads_rows_from_s_then_from_e1_when_cut_from_s(site):
    net, urls, factor = site.net, site.urls, site.factor
    v, s = net["v"], net["s"]
    e1 = SimpleNamespace(url=urls["e1"], proc=None, lines=[])

    c = case(factor, 11)
    want = pixels(site, c)
    facts = encode(e1, c.media)
    wait_for(lambda: published(urls["e1"]) >= 1, "E1's publication")
    s_sent, v_got = s.counters()[1], v.counters()[0]
    t = time.monotonic()
    got = by_reference(site, facts)
    print(f"\nfrom S: answered in {time.monotonic() - t:.2f} s")
    got.same_as(want)
    rows = facts[0]["num_tokens"] * 4 * 64  # float32 rows of the tiny model's 64-wide LM
    moved_s, moved_v = s.counters()[1] - s_sent, v.counters()[0] - v_got
    print(f"\nrows {rows} B; S sent {moved_s} B, V received {moved_v} B")
    assert moved_s >= rows and moved_v >= rows
    # E1 and E2 made none of these rows over HTTP for V: no load answered by them.
    loads = sum(stack.scrape(u, "mmferry_requests_total") for u in urls.values())

    # V cut from S alone; E1 still holds the item in its cache and reaches S.
    c2 = case(factor, 12)
    want2 = pixels(site, c2)
    facts2 = encode(e1, c2.media)
    wait_for(lambda: published(urls["e1"]) >= 2, "E1's second publication")
    v.cut_from(s)
    try:
        t = time.monotonic()
        got2 = by_reference(site, facts2)
        took = time.monotonic() - t
        got2.same_as(want2)
        print(f"V cut from S: answered in {took:.2f} s")
        # The store's lookup deadline (1 s), then the rows from E1 over HTTP, well inside the
        # connector's timeout_s (30 s): without the reader's deadlines the worker's read of
        # the store waited 124 s here, for Mooncake to give up.
        assert took < 20.0, took
        assert stack.scrape(urls["e1"], "mmferry_requests_total") > loads  # E1 served it
        httpx.get(f"{urls['e1']}/health", timeout=5).raise_for_status()
    finally:
        v.heal_from(s)


def test_e1_link_down_through_the_proxy_loses_no_request(site):
    net, urls = site.net, site.urls
    side = 2 * site.factor  # 4 tokens an image: no resampling, so vLLM's pixels are ours
    parts = [image_part(image(side, side, 100 + i)) for i in range(IMAGES)]
    on_e1 = {
        i for i, p in enumerate(parts) if first_choice([urls["e1"], urls["e2"]], p) == urls["e1"]
    }
    assert 0 < len(on_e1) < IMAGES, "the images must be split between the encoders"

    def make(part: dict, n: int) -> dict:
        body = chat_body([part, TEXT], tokens=NEW_TOKENS)
        body["model"], body["user"] = str(site.model), str(n)
        return body

    def answer(text: str) -> Answer:
        return Answer(200, *_ids(json.loads(text)["choices"][0]["logprobs"]["content"]))

    # The independent reference: each image's pixels sent to vLLM itself (its own tower).
    want = []
    for i, p in enumerate(parts):
        r = httpx.post(f"{site.llm}/v1/chat/completions", json=make(p, i), timeout=120)
        assert r.status_code == 200, r.text
        want.append(answer(r.text))

    e1 = net["e1"]
    served_e1 = lambda: stack.scrape(urls["e1"], "mmferry_requests_total")  # noqa: E731
    fallback = lambda: stack.scrape(site.proxy, "mmferry_proxy_items_fallback_total")  # noqa: E731
    fell_back = fallback()
    load = Load(site.proxy, parts, RATE, timeout_s=120, make=make)
    time.sleep(4)
    before = e1.counters()
    cut, back, used_again = down_then_used_again(e1, served_e1, ENCODER_TIMEOUT_S + 6)
    time.sleep(1)
    done = load.stop()

    failed = [d for d in done if d.status != 200]
    longest = max(done, key=lambda d: d.took)
    during = [d for d in done if d.image in on_e1 and cut <= d.start < back]
    usual = statistics.median(d.took for d in done if d.start < cut)
    # Noticed: an image of E1's answered without waiting on E1 (within the usual time of an
    # answer plus less than a connect timeout).
    fast = [d for d in during if d.took < usual + CONNECT_TIMEOUT_S]
    noticed = min(d.start for d in fast) - cut if fast else float("inf")
    report = {
        "requests": len(done),
        "failed": len(failed),
        "longest_s": round(longest.took, 2),
        "median_before_cut_s": round(usual, 2),
        "median_e1_images_during_cut_s": round(statistics.median(d.took for d in during), 2)
        if during
        else None,
        "e1_images_during_cut": len(during),
        "noticed_after_s": round(noticed, 2),
        "e1_used_again_after_s": used_again and round(used_again - back, 2),
        "items_fallback": fallback() - fell_back,
        # Items E1 answered just before its link went down, which vLLM then found nowhere:
        # encoded again by E2 (tests/proxy/test_epd.py makes that case happen every time).
        "items_moved": stack.scrape(site.proxy, "mmferry_proxy_items_moved_total"),
    }
    print("\nE1 link down, vLLM behind P:", json.dumps(report))
    assert not failed, [(d.status, d.text[:300]) for d in failed[:3]]
    assert before[0] > 0 and before[1] > 0  # E1 served over its link before the cut
    assert during, "no request for E1's images while its link was down"
    # The proxy's bound: `--encoder-timeout`, then one encode by the next encoder and vLLM's answer.
    assert longest.took <= ENCODER_TIMEOUT_S + ANSWER_MARGIN_S, report
    assert used_again is not None, "E1 was not used again"
    assert report["items_fallback"] == 0, report  # E2 took E1's items, not vLLM's own tower
    # Each answer is vLLM's own for that image's pixels, whichever encoder made the rows.
    for d in done:
        answer(d.text).same_as(want[d.image])
