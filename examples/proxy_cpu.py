"""The proxy's own cost a request, with nothing else on the path: CPU seconds and latency.

    PYTHONPATH=. .venv/bin/python examples/proxy_cpu.py
    PYTHONPATH=. .venv/bin/python examples/proxy_cpu.py --baseline /path/to/other/checkout
    PYTHONPATH=. .venv/bin/python examples/proxy_cpu.py --images 0 --name-ahead

Starts two `mmferry serve` encoders on the tests' tiny Qwen2.5-VL checkpoint, a recording
engine (a stdlib HTTP server answering every chat request at once, its connections kept open as
vLLM keeps them; tests/proxy/procs.py) and `mmferry proxy --mode connector` in front, then sends
requests one at a time, each with `--images` fresh 224x224 JPEGs as data: URLs (0: text only).
It prints the CPU time (the scheduler's count for every thread of each process and of its
children, a JSON parsing child included) the proxy spent a request and the encoders a call, and the
client's latency through the proxy beside the engine's own; the median and spread of
`--rounds` rounds.

With `--baseline`, a second set of the same processes runs another checkout's code (a `git
worktree` of an earlier commit), its rounds interleaved with this one's, the engine's answers
to both checked alike first. The encoders' floor is printed too: a call's tower and its JPEG
decodes, timed in this process on one thread, what an encoder cannot spend less than.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import re
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the tests' tiny checkpoint and process helpers

from tests.engines.tiny_vlm import build_checkpoint  # noqa: E402
from tests.proxy.procs import Proc, RecordingEngine, encoder, proxy  # noqa: E402

CHAT = "/v1/chat/completions"


@dataclass
class Setup:
    """One checkout's proxy and two encoders, and what each round measured."""

    name: str
    root: Path
    procs: list[Proc] = field(default_factory=list)
    proxy_ms: list[float] = field(default_factory=list)
    encoder_ms: list[float] = field(default_factory=list)  # a call, both encoders together
    latency_ms: list[float] = field(default_factory=list)

    def start(self, model: Path, engine: str, extra: list[str]) -> None:
        for _ in range(2):
            e = encoder(model)
            e.root = self.root
            self.procs.append(e.start())
        front = proxy(engine, [e.url for e in self.procs], "connector", *extra)
        front.root = self.root
        self.procs.insert(0, front.start())

    @property
    def url(self) -> str:
        return self.procs[0].url

    def stop(self) -> None:
        for p in self.procs:
            p.stop()


def cpu_seconds(pid: int) -> float:
    """CPU time so far of every thread of `pid` and of the processes under it, from the
    scheduler's own count (/proc/*/task/*/schedstat, nanoseconds): the tick-sampled user and
    system times are 10 ms grains, too coarse for a round of a millisecond a request on a
    loaded machine."""
    import os

    parents: dict[int, int] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    stat = f.read()
            except OSError:
                continue  # gone meanwhile
            parents[int(name)] = int(stat[stat.rindex(")") + 2 :].split()[1])
    tree, grew = {pid}, True
    while grew:
        below = {p for p, parent in parents.items() if parent in tree} - tree
        tree |= below
        grew = bool(below)
    ns = 0
    for p in tree:
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/schedstat") as f:
                    ns += int(f.read().split()[0])
        except OSError:
            continue
    return ns / 1e9


def jpeg_urls(rng: np.random.Generator, n: int) -> list[bytes]:
    out = []
    for _ in range(n):
        buf = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, (224, 224, 3), dtype=np.uint8)).save(buf, "JPEG")
        out.append(buf.getvalue())
    return out


def body(jpegs: list[bytes]) -> dict[str, Any]:
    parts: list[dict[str, Any]] = [{"type": "text", "text": "hi"}]
    for data in jpegs:
        url = "data:image/jpeg;base64," + base64.b64encode(data).decode()
        parts.append({"type": "image_url", "image_url": {"url": url}})
    return {"model": "m", "messages": [{"role": "user", "content": parts}], "max_tokens": 8}


def floor_ms(model: Path, jpegs: list[bytes]) -> tuple[float, float]:
    """One thread's CPU ms for the tower of a call of two of `jpegs`, and for one JPEG decode
    (the median of 20)."""
    import torch

    import mmferry as mf
    from mmferry.preprocess.decode import decode_image

    torch.set_num_threads(1)  # as each encoder worker runs its tower
    proc = mf.Processor.from_pretrained(model)
    enc = mf.VisionEncoder.from_pretrained(model)
    items = [proc.image(j, layout=proc.layouts[0]) for j in jpegs[:2]]
    tower, decode = [], []
    for _ in range(20):
        t0 = time.thread_time()
        enc(items)
        tower.append(time.thread_time() - t0)
        t0 = time.thread_time()
        decode_image(jpegs[0], 1 << 26)
        decode.append(time.thread_time() - t0)
    return statistics.median(tower) * 1e3, statistics.median(decode) * 1e3


def wait_named(url: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not httpx.get(url + "/health").json().get("names_ahead"):
        if time.monotonic() > deadline:
            raise RuntimeError("the proxy did not start naming items ahead")
        time.sleep(0.2)


def spread(xs: list[float]) -> str:
    return f"{statistics.median(xs):.2f} ({min(xs):.2f}-{max(xs):.2f})"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--requests", type=int, default=200, help="requests a round and set-up")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--images", type=int, default=4, help="images a request (0: text only)")
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--name-ahead", action="store_true", help="the proxy names images ahead")
    ap.add_argument("--baseline", type=Path, help="another checkout, run interleaved")
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    extra = ["--name-ahead"] if args.name_ahead else []
    setups = [Setup("this", ROOT)]
    if args.baseline is not None:
        setups.insert(0, Setup("baseline", args.baseline.resolve()))

    with tempfile.TemporaryDirectory(prefix="proxy-cpu-") as work:
        model = build_checkpoint("qwen2_5_vl", Path(work) / "model")
        engine = RecordingEngine({"id": "recorded", "choices": []}, keep_alive=True)
        try:
            for s in setups:
                s.start(model, engine.url, extra)
                if args.name_ahead:
                    wait_named(s.url)
            with httpx.Client(timeout=60) as client:
                # The same request through each: the engine must get the same body.
                check = body(jpeg_urls(rng, args.images))
                seen = []
                for s in setups:
                    client.post(s.url + CHAT, json=check).raise_for_status()
                    (got,) = engine.take()
                    seen.append(got.json())
                # NOTE: an item named ahead carries its rank among its encoders ("+<rank>"),
                # which the encoders' addresses decide: the rest must be the same.
                seen = [re.sub(r'\+\d+"', '"', json.dumps(x)) for x in seen]
                if any(x != seen[0] for x in seen):
                    raise SystemExit(f"the engine got different bodies: {seen}")
                for s in setups:
                    for _ in range(args.warmup):
                        b = body(jpeg_urls(rng, args.images))
                        client.post(s.url + CHAT, json=b).raise_for_status()
                engine.take()
                for _ in range(args.rounds):
                    for s in setups:
                        bodies = [body(jpeg_urls(rng, args.images)) for _ in range(args.requests)]
                        pids = [p.proc.pid for p in s.procs]
                        before = [cpu_seconds(p) for p in pids]
                        lat = []
                        for b in bodies:
                            t0 = time.perf_counter()
                            client.post(s.url + CHAT, json=b).raise_for_status()
                            lat.append(time.perf_counter() - t0)
                        used = [cpu_seconds(p) - b for p, b in zip(pids, before)]
                        s.proxy_ms.append(used[0] / args.requests * 1e3)
                        calls = args.requests * min(2, args.images)  # items spread on two
                        s.encoder_ms.append(sum(used[1:]) / max(calls, 1) * 1e3)
                        s.latency_ms.append(statistics.median(lat) * 1e3)
                        engine.take()
                direct = []
                for b in bodies[:50]:
                    t0 = time.perf_counter()
                    client.post(engine.url + CHAT, json=b).raise_for_status()
                    direct.append(time.perf_counter() - t0)
            engine.take()
            tower, decode = floor_ms(model, jpeg_urls(rng, 2)) if args.images else (0.0, 0.0)
        finally:
            for s in setups:
                s.stop()
            engine.close()
    named = ", named ahead" if args.name_ahead else ""
    print(
        f"{args.rounds} rounds of {args.requests} requests, {args.images} images each{named}, "
        "one at a time; median (spread) of the rounds"
    )
    for s in setups:
        # Text only: no encoder call (what the encoders spent is their probes' and idle work).
        calls = spread(s.encoder_ms) if args.images else "- (no call)"
        print(
            f"{s.name:>8}: proxy CPU ms a request {spread(s.proxy_ms)} | encoder CPU ms a call "
            f"{calls} | latency p50 {spread(s.latency_ms)} ms"
        )
    if len(setups) == 2:
        a, b = (statistics.median(s.proxy_ms) for s in setups)
        print(f"proxy CPU, this / baseline: {b / a:.2f}x")
    if args.images:
        per_call = tower + decode * args.images / 2
        above = [f"{s.name} {statistics.median(s.encoder_ms) - per_call:.2f}" for s in setups]
        print(
            f"encoder floor a call of {args.images // 2 or 1} items: tower {tower:.2f} ms, "
            f"JPEG decode {decode:.2f} ms an image; a call less its floor: " + ", ".join(above)
        )
    print(f"the engine directly: latency p50 {statistics.median(direct) * 1e3:.2f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
