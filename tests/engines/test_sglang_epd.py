"""`mmferry serve` as the encoder of SGLang's encode/language disaggregation, proven with stock
SGLang 0.5.23 servers on the CPU (the tiny Qwen3-VL checkpoint over `zmq_to_tokenizer` so far,
COMBOS). One `--language-only` server per family and backend sends each request's media first
to SGLang's own `--encoder-only` server, then to two `mmferry serve` encoders sharing a
Mooncake Store (swapped through the language server's own encoder registry):

- one image, several images, the same image twice: the greedy tokens and the top logprobs are
  SGLang's own; other rows (the images swapped) change them; an image and a video: not yet
  (a strict expected failure, see the README);
- the same image in 10 requests is encoded once in all, whichever encoder SGLang picks;
- media mmferry refuses fails the request with SGLang's error, and the server stays up;
- an encoder killed mid-run (last): with `zmq_to_tokenizer` every request is answered and the
  language server stays up, and once the encoder is back SGLang sends to it again; with
  `zmq_to_scheduler` SGLang 0.5.23's language server exits on the first encoder failure of a
  text prompt (the README's reason to run `zmq_to_tokenizer`; this fails when SGLang fixes it).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.engines.sglang_epd import (
    IMAGE_TOKEN as IMAGE,
)
from tests.engines.sglang_epd import (
    VIDEO_TOKEN as VIDEO,
)
from tests.engines.sglang_epd import (
    LanguageServer,
    SglangServer,
    answer,
    start_encoders,
    write_png,
    write_video,
)
from tests.engines.sglang_harness import SGLANG_PYTHON
from tests.engines.tiny_vlm import gradient, image, video
from tests.store import cluster

# Two SGLang servers start with the first test of each family and backend: 3-12 minutes on two
# cores shared with other work, past pytest-timeout's default.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]
# The same weights in float32 on both sides; the towers' kernels differ, so their logprobs
# agree to float32 rounding carried through two layers, not bit for bit.
LOGPROB_TOL = 1e-4


@dataclass
class Epd:
    family: str
    backend: str
    model: Path
    media: dict[str, str]
    own: SglangServer  # SGLang's --encoder-only server
    lang: LanguageServer
    encoders: list[cluster.Service]
    ports: list[int]
    store: str
    factor: int


def cases(media: dict[str, str]) -> dict[str, tuple[str, dict[str, list[str]]]]:
    a, b, c, clip = media["a"], media["b"], media["c"], media["clip"]
    return {
        "image": (f"hello {IMAGE} what ?", {"image": [a]}),
        "images": (f"hello {IMAGE} and {IMAGE} and {IMAGE} describe", {"image": [a, b, c]}),
        "same_twice": (f"hello {IMAGE} {IMAGE} what ?", {"image": [a, a]}),
        "image_video": (f"hello {IMAGE} {VIDEO} what happens ?", {"image": [b], "video": [clip]}),
    }


# Run on this machine so far: Qwen3-VL over zmq_to_tokenizer (10 minutes with its servers'
# start). The other families and backends are the next to add here.
COMBOS = [("qwen3_vl", "zmq_to_tokenizer")]


@pytest.fixture(scope="module", params=COMBOS, ids=[f"{f}-{b}" for f, b in COMBOS])
def epd(request, models, tmp_path_factory) -> Iterator[Epd]:
    family, backend = request.param
    if not SGLANG_PYTHON.is_file():
        pytest.fail(f"SGLang's environment is missing ({SGLANG_PYTHON}); run `make sglang-venv`")
    if not cluster.installed():
        pytest.fail(f"Mooncake is missing ({cluster.MOONCAKE}); run `make mooncake-venv`")
    m = models[family]
    work = tmp_path_factory.mktemp(f"epd-{family}-{backend}")
    f = m.proc.config.factor
    media = {
        "a": write_png(work / "a.png", image(2 * f, 3 * f, 0)),
        "b": write_png(work / "b.png", gradient(3 * f, 2 * f, 1)),
        "c": write_png(work / "c.png", image(2 * f, 2 * f, 2)),
        "clip": write_video(work / "clip.mov", video(2 * f, 2 * f)),
    }
    with contextlib.ExitStack() as stack:
        store = cluster.Cluster(work / "mooncake")
        store.work.mkdir()
        stack.callback(store.stop)
        store.start()
        ports = [cluster.free_port(), cluster.free_port()]
        encoders = start_encoders(m.path, store.url, work, ports=ports)
        stack.callback(lambda: [e.stop() for e in encoders])
        own = SglangServer.start(
            m.path, work / "encoder.log", "--encoder-only", "--encoder-transfer-backend", backend
        )
        stack.callback(own.stop)
        lang = LanguageServer.launch(m.path, work / "language.log", backend, [own.url])
        stack.callback(lang.stop)
        yield Epd(family, backend, m.path, media, own, lang, encoders, ports, store.url, f)


def mmferry_urls(epd: Epd) -> list[str]:
    return [e.url for e in epd.encoders]


def metric(url: str, name: str, labels: str = "") -> float:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    pat = re.compile(rf"^{name}(_total)?(\{{[^}}]*{labels}[^}}]*\}})? (\S+)$", re.M)
    return sum(float(m.group(3)) for m in pat.finditer(text))


def close(a, b) -> None:
    tokens_a, top_a = a
    tokens_b, top_b = b
    assert tokens_a == tokens_b
    for step_a, step_b in zip(top_a, top_b, strict=True):
        assert [t for t, _ in step_a] == [t for t, _ in step_b]
        for (_, la), (_, lb) in zip(step_a, step_b):
            assert abs(la - lb) <= LOGPROB_TOL, (step_a, step_b)


@pytest.fixture(scope="module")
def answers(epd) -> dict[str, dict]:
    """Each case's answer with SGLang's own encoder, then with mmferry's two."""
    runs = cases(epd.media)
    epd.lang.use([epd.own.url])
    own = {name: answer(epd.lang.generate(text, media)) for name, (text, media) in runs.items()}
    epd.lang.use(mmferry_urls(epd))
    ours = {name: answer(epd.lang.generate(text, media)) for name, (text, media) in runs.items()}
    text, media = runs["images"]
    swapped = answer(epd.lang.generate(text, {"image": media["image"][::-1]}))
    return {"own": own, "ours": ours, "swapped": swapped}


@pytest.mark.parametrize("case", ["image", "images", "same_twice", "image_video"])
def test_mmferry_rows_give_sglangs_own_answers(epd, answers, case, request):
    if epd.family == "qwen2_5_vl" and case == "image_video":
        # README: SGLang's Qwen2.5-VL tower lets a video's temporal patches attend to each
        # other (transformers', vLLM's and mmferry's do not), so its rows are not the model's.
        reason = "SGLang's Qwen2.5-VL tower attends across a video's frames"
        request.node.add_marker(pytest.mark.xfail(reason=reason, strict=True))
    if epd.family == "qwen3_vl" and case == "image_video":
        # Seen: other tokens from the first one. Not traced yet: SGLang's encoder logs that its
        # Qwen3-VL video processor skips qwen-vl-utils' per-frame pixel cap, which mmferry
        # applies (README).
        reason = "SGLang's encoder and mmferry size this Qwen3-VL video differently"
        request.node.add_marker(pytest.mark.xfail(reason=reason, strict=True))
    assert len(answers["own"][case][0]) == 8
    close(answers["own"][case], answers["ours"][case])


def test_other_rows_change_the_answer(answers):
    """The same prompt with its images in the other order: other rows, another answer."""
    with pytest.raises(AssertionError):
        close(answers["swapped"], answers["ours"]["images"])


def test_the_same_image_is_encoded_once_across_the_pool(epd):
    epd.lang.use(mmferry_urls(epd))
    f = epd.factor
    # In the folder the encoders allow (--allow-path), a new image to every cache.
    path = write_png(Path(epd.media["a"]).parent / "once.png", image(2 * f, 2 * f, 77))
    urls = mmferry_urls(epd)
    before = [metric(u, "mmferry_encoded_items") for u in urls]
    parts = [metric(u, "mmferry_sglang_parts", 'outcome="sent"') for u in urls]
    answers = [answer(epd.lang.generate(f"hi {IMAGE} ?", {"image": [path]})) for _ in range(10)]
    assert all(a == answers[0] for a in answers)
    # Until SGLang's random pick has sent it to both encoders (half a chance each time).
    for _ in range(20):
        got = [metric(u, "mmferry_sglang_parts", 'outcome="sent"') - p for u, p in zip(urls, parts)]
        if min(got) > 0:
            break
        answers.append(answer(epd.lang.generate(f"hi {IMAGE} ?", {"image": [path]})))
    assert min(got) > 0 and sum(got) == len(answers), got
    encoded = sum(metric(u, "mmferry_encoded_items") - b for u, b in zip(urls, before))
    assert encoded == 1


def test_refused_media_fails_the_request_and_the_server_stays_up(epd, models):
    epd.lang.use(mmferry_urls(epd))
    proc = models[epd.family].proc
    # A text prompt on zmq_to_scheduler takes SGLang down on any encoder failure; its
    # input_ids form survives (see the kill test), so that is the form sent there.
    text = f"hello {IMAGE} what ?"
    prompt = {"text": text} if epd.backend == "zmq_to_tokenizer" else {}
    if not prompt:
        prompt = {"input_ids": proc.tokenizer.encode(text)}
    body = {**prompt, "image_data": ["/etc/hostname"]}
    body["sampling_params"] = {"temperature": 0.0, "max_new_tokens": 4}
    t0 = time.monotonic()
    r = httpx.post(f"{epd.lang.url}/generate", json=body, timeout=300)
    assert r.status_code >= 400, r.text[:500]
    assert time.monotonic() - t0 < 60  # answered, not SGLang's 180 s wait
    assert epd.lang.alive()
    ok = answer(epd.lang.generate(text, {"image": [epd.media["a"]]}))
    assert len(ok[0]) == 8


def test_an_encoder_killed_mid_run(epd):
    """Last in the module: it kills an encoder (and, on zmq_to_scheduler, SGLang)."""
    epd.lang.use(mmferry_urls(epd))
    runs = list(cases(epd.media).values())
    results: list[httpx.Response | BaseException] = []

    def client(k: int) -> None:
        text, media = runs[k % len(runs)]
        try:
            results.append(epd.lang.generate(text, media))
        except BaseException as e:  # noqa: BLE001 - a hung or dropped request is the finding
            results.append(e)

    threads = [threading.Thread(target=client, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
        time.sleep(0.3)
    victim = epd.encoders[1]
    os.kill(victim.proc.pid, signal.SIGKILL)
    victim.proc.wait()
    for t in threads:
        t.join(400)
    if epd.backend == "zmq_to_scheduler":
        # SGLang 0.5.23: the scheduler's abort of a text prompt raises a TypeError and the
        # server exits (output_streamer.py). When this fails, SGLang survives encoder errors
        # on the scheduler path: update the README's advice.
        deadline = time.monotonic() + 60
        while epd.lang.alive() and time.monotonic() < deadline:
            time.sleep(1)
        assert not epd.lang.alive(), "SGLang's scheduler path survived an encoder failure"
        return
    assert len(results) == 8 and all(isinstance(r, httpx.Response) for r in results), results
    assert all(r.status_code in (200, 503) for r in results), [r.status_code for r in results]
    assert epd.lang.alive()
    # Back on its port: SGLang's health checks re-admit it, and requests split over both
    # encoders succeed again.
    args = ["--model", str(epd.model), "--store", epd.store, "--allow-path"]
    args += [str(Path(epd.media["a"]).parent), "--shm-mib", "0", "--port", str(epd.ports[1])]
    epd.encoders[1] = cluster.start_service(args)
    deadline = time.monotonic() + 120
    text, media = runs[1]
    while True:
        r = epd.lang.generate(text, media)
        if r.status_code == 200 and metric(epd.encoders[1].url, "mmferry_sglang_parts") > 0:
            break
        assert time.monotonic() < deadline, "SGLang did not send to the restarted encoder"
        time.sleep(2)
    for text, media in runs:
        assert len(answer(epd.lang.generate(text, media))[0]) == 8
