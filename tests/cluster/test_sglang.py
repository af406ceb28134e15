"""SGLang 0.5.23's `--language-only` server on host L (`zmq_to_tokenizer`, `SGLANG_HOST_IP` its
address) with `--encoder-urls` E1 and E2 (`mmferry serve`), each on its own network stack (one
SGLang start for the module), and L refusing the connections E1 opens to it (a firewall on L's
side: E1 still gets SGLang's `/encode` calls, but cannot push rows to the receive address they
name; `Host.refuse_from`, one way).

SGLang picks an encoder per request at random and does not try another: the requests it sends
to E1 fail, whichever way. What mmferry can do is fail them at once: E1 connects to the receive
address while it encodes and answers 502 `receiver_unreachable` when the connection is not up
within `--sglang-connect-timeout` (2 s), instead of encoding, then waiting the push's 30 s.
Asserted: those requests fail within that deadline plus a margin, the ones sent to E2 answer,
and E1 keeps no connection attempt to L nor any request open afterwards. And with nothing cut,
the rows E1 and E2 push to L across their links give SGLang's own answers (its `--encoder-only`
server on host O is the reference): the greedy tokens and top-5 logprobs."""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

import httpx
import pytest

import mmferry as mf
from tests.cluster import stack
from tests.engines.sglang_epd import (
    CPU_FLAGS,
    IMAGE_TOKEN,
    answer,
    close,
    ffmpeg_env,
    write_png,
)
from tests.engines.sglang_harness import SGLANG_PYTHON, START_TIMEOUT_S, sglang_env
from tests.engines.tiny_vlm import build_checkpoint, image

CONNECT_S = 2.0  # `mmferry serve --sglang-connect-timeout`'s default, which E1 runs with
# SGLang's own handling of the 502 and the HTTP round trips on 2 shared CPUs.
MARGIN_S = 3.0
PORT = 30000


@pytest.fixture(scope="module")
def site(make_net, tmp_path_factory):
    net = make_net(["e1", "e2", "l", "o"])
    work = tmp_path_factory.mktemp("sglang")
    model = build_checkpoint("qwen2_5_vl", work / "ckpt")
    f = mf.Processor.from_pretrained(model).config.factor
    media = work / "media"
    media.mkdir()
    paths = [str(write_png(media / f"i{k}.png", image(2 * f, 3 * f, k))) for k in range(16)]
    urls = {n: stack.encoder(net, net[n], model, "--allow-path", str(media)) for n in ("e1", "e2")}
    l = net["l"]
    cmd = [str(SGLANG_PYTHON), "-m", "sglang.launch_server", "--model-path", str(model)]
    cmd += ["--host", l.addr, "--port", str(PORT), *CPU_FLAGS, "--language-only"]
    cmd += ["--encoder-transfer-backend", "zmq_to_tokenizer", "--encoder-bootstrap-port"]
    cmd += [str(PORT + 1), "--encoder-urls", urls["e1"], urls["e2"]]
    # NOTE: SGLang names its receive address by get_local_ip_auto(), which on a host with no
    # default route needs SGLANG_HOST_IP.
    env = sglang_env(**ffmpeg_env(work / "ffmpeg"), SGLANG_HOST_IP=l.addr)
    log = net.work / "sglang.log"
    proc = l.popen(cmd, env=env, log=log, cwd=work)
    # SGLang's own encoder on host O, started beside L: the reference answers.
    o = net["o"]
    own_cmd = [str(SGLANG_PYTHON), "-m", "sglang.launch_server", "--model-path", str(model)]
    own_cmd += ["--host", o.addr, "--port", str(PORT), *CPU_FLAGS, "--encoder-only"]
    own_cmd += ["--encoder-transfer-backend", "zmq_to_tokenizer"]
    own_env = sglang_env(**ffmpeg_env(work / "ffmpeg-own"), SGLANG_HOST_IP=o.addr)
    own_log = net.work / "sglang-own.log"
    own_proc = o.popen(own_cmd, env=own_env, log=own_log, cwd=work)
    url = stack.healthy("SGLang", f"http://{l.addr}:{PORT}", proc, log, START_TIMEOUT_S)
    own = stack.healthy("SGLang's encoder", f"http://{o.addr}:{PORT}", own_proc, own_log, 600)
    width = json.loads((model / "config.json").read_text())["vision_config"]["out_hidden_size"]
    return SimpleNamespace(
        net=net,
        urls=urls,
        url=url,
        own=own,
        paths=paths,
        log=log,
        bootstrap=f"http://{l.addr}:{PORT + 1}",
        registered=[urls["e1"], urls["e2"]],
        width=width,
    )


def generate(site, path: str) -> tuple[int, float, str]:
    body = {
        "text": f"hello {IMAGE_TOKEN} what ?",
        "image_data": [path],
        "sampling_params": {"temperature": 0.0, "max_new_tokens": 2, "ignore_eos": True},
    }
    t = time.monotonic()
    r = httpx.post(f"{site.url}/generate", json=body, timeout=120)
    return r.status_code, time.monotonic() - t, r.text


def parts(site, name: str) -> float:
    return stack.scrape(site.urls[name], "mmferry_sglang_parts_total")


def sent_to(site, path: str) -> tuple[str, tuple[int, float, str]]:
    """Which encoder SGLang sent a request to (its parts' count moved), and the answer."""
    before = {n: parts(site, n) for n in site.urls}
    answer = generate(site, path)
    # SGLang hangs up on /encode once the rows are in: the count may land just after.
    deadline = time.monotonic() + 5
    while True:
        went = [n for n in site.urls if parts(site, n) > before[n]]
        if went or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert len(went) == 1, (went, answer)
    return went[0], answer


def test_requests_sglang_sends_to_an_encoder_that_cannot_push_fail_at_once(site):
    e1, l = site.net["e1"], site.net["l"]
    status, took, text = generate(site, site.paths[0])
    assert status == 200, text
    l.refuse_from(e1)  # every port: SGLang binds a new receive port per request
    seen: dict[str, list[tuple[int, float, str]]] = {"e1": [], "e2": []}
    try:
        # SGLang picks at random: until both encoders have had requests (at most 16).
        for path in site.paths[1:12]:
            went, answer = sent_to(site, path)
            seen[went].append(answer)
            if len(seen["e1"]) >= 2 and len(seen["e2"]) >= 1:
                break
        # E1 held nothing open: no connection attempt to L, no request.
        held = e1.run(["ss", "-Htn", "dst", l.addr]).stdout.strip()
        in_flight = stack.scrape(site.urls["e1"], "mmferry_requests_in_flight")
    finally:
        l.accept_from()
    print(
        "sglang across a one-way cut:",
        {n: [(s, round(t, 2)) for s, t, _ in v] for n, v in seen.items()},
        seen["e1"][0][2][:400] if seen["e1"] else "",
    )
    assert len(seen["e1"]) >= 2 and len(seen["e2"]) >= 1, seen
    for status, took, text in seen["e1"]:
        assert status >= 400, text
        assert CONNECT_S <= took < CONNECT_S + MARGIN_S, (took, text)
    for status, _, text in seen["e2"]:
        assert status == 200, text
    undelivered = {"backend": "zmq_to_tokenizer", "outcome": "undelivered"}
    assert _sample(site.urls["e1"], "mmferry_sglang_parts_total", undelivered) == len(seen["e1"])
    assert held == "" and in_flight == 0, (held, in_flight)
    # L accepts E1 again: a request SGLang sends to E1 answers.
    for path in site.paths[12:]:
        went, (status, _, text) = sent_to(site, path)
        assert status == 200, text
        if went == "e1":
            break
    else:
        pytest.fail("SGLang sent none of 4 requests to E1")


def use(site, urls: list[str]) -> None:
    """`urls` made L's encoders (SGLang's bootstrap registry: the new registered, the others
    removed)."""
    for url in urls:
        if url not in site.registered:
            r = httpx.post(f"{site.bootstrap}/register_encoder_url", json={"url": url}, timeout=30)
            r.raise_for_status()
    for url in site.registered:
        if url not in urls:
            r = httpx.request(
                "DELETE", f"{site.bootstrap}/unregister_encoder_url", json={"url": url}, timeout=30
            )
            r.raise_for_status()
    listed = httpx.get(f"{site.bootstrap}/list_encoder_urls", timeout=30).json()
    assert sorted(listed["encoder_urls"]) == sorted(urls), listed
    site.registered = list(urls)


def scored(site, path: str) -> tuple:
    """The greedy tokens and top-5 logprobs of 8 tokens on the image at `path`."""
    body = {
        "text": f"hello {IMAGE_TOKEN} what ?",
        "image_data": [path],
        "sampling_params": {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True},
        "return_logprob": True,
        "top_logprobs_num": 5,
    }
    return answer(httpx.post(f"{site.url}/generate", json=body, timeout=300))


def test_rows_pushed_from_other_hosts_give_sglangs_own_answers(site):
    # SGLang's own encoder on O answers first; then E1 alone and E2 alone, each pushing its rows
    # over its link to L's receive address: the same greedy tokens and top logprobs.
    cases = site.paths[:3]
    tokens = 2 * 3  # an image of 2x3 merged patches (the fixture's sizes)
    try:
        use(site, [site.own])
        reference = [scored(site, p) for p in cases]
        for name in ("e1", "e2"):
            host = site.net[name]
            sent_before = host.counters()[1]
            use(site, [site.urls[name]])
            ours = [scored(site, p) for p in cases]
            sent = host.counters()[1] - sent_before
            for ref, got in zip(reference, ours, strict=True):
                close(ref, got)
            with pytest.raises(AssertionError):  # another image's rows: another answer
                close(reference[0], ours[1])
            # The rows crossed E's link (bfloat16 at least: two bytes a value).
            print(f"{name} sent {sent} bytes for {len(cases)} images")
            assert sent >= len(cases) * tokens * site.width * 2, (name, sent)
    finally:
        use(site, [site.urls["e1"], site.urls["e2"]])


def _sample(url: str, name: str, labels: dict[str, str]) -> float:
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    for line in httpx.get(f"{url}/metrics", timeout=5).text.splitlines():
        if line.startswith(f"{name}{{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rpartition(" ")[2])
    raise AssertionError(f"no {name}{{{want}}} at {url}")
