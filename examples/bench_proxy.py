"""vLLM's own serving benchmark against plain vLLM, vLLM's EPD and `mmferry proxy`, in one command.

    PYTHONPATH=. .venv/bin/python examples/bench_proxy.py --rounds 3 --kill --json tiny.json
    PYTHONPATH=. .venv/bin/python examples/bench_proxy.py --model heavy --image-size 448 ...

Starts every process itself, on loopback (examples/bench_setups.py): (a) a plain vLLM with pixels,
(b) vLLM's encoder disaggregation (two encoder-only vLLMs, a PD vLLM, ECExampleConnector, the
front of vLLM's example), (c) two `mmferry serve` encoders, a vLLM with MmferryECConnector and
`mmferry proxy --mode connector`, (ca) the same with `--encode-ahead` (the request forwarded once
its items are preprocessed, the towers running meanwhile), (cn) the same with `--name-ahead` (the
proxy names each image from its header and forwards the request beside the encode), (c') the
same in embeds mode;
`--setups` picks some. The
checkpoint: the tests' tiny Qwen2.5-VL (encoding almost free: the figures are what the path
costs), "heavy" (the same with a deeper, wider tower: encoding a visible part of TTFT), or a
folder. Before timing, one greedy request with images goes to every set-up: the same tokens, or
no benchmark (and other images other tokens, so the check can fail).

Then vLLM's benchmark (random-mm, OpenAI chat backend, examples/bench_client.py) on every
set-up with the same requests: all-distinct images and half of them from a pool of repeats, at
two rates (`--rates`; `auto`: 0.3x and 0.85x the lowest throughput the set-ups reach in their
unpaced warm-up runs). A round runs every workload on every set-up, one after the other; each
workload of each round has its own seed, the same for every set-up (fresh images and texts are
fresh to every cache, the pool stays). Per
set-up and workload: TTFT p50 and p99 and req/s, the median (min-max) over the rounds, and the
encoder calls and cache hits of the runs (for (a): vLLM's processor cache, whose hits skip
preprocessing but not the tower). Then one request at a time through (a), (b) and (c), each
request's time split by the stages the proxy, the encoders and vLLM record (their /metrics,
examples/bench_breakdown.py); then, with `--kill`, one run per disaggregated set-up in which
one encoder is SIGKILLed halfway: its failed requests. Every process is stopped at the end, on
an error, on Ctrl-C and on SIGTERM.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the tests' tiny checkpoint and process helpers

from bench_breakdown import breakdown, breakdown_lines  # noqa: E402
from bench_client import Client  # noqa: E402
from bench_setups import (  # noqa: E402
    SETUPS,
    Setup,
    build_model,
    config_line,
    leftover_shm,
    pin,
    start_setup,
)

from tests.proxy.procs import Proc, VllmServer  # noqa: E402

FIGURES = (
    ("median_ttft_ms", "TTFT p50 ms", 1),
    ("p99_ttft_ms", "TTFT p99 ms", 1),
    ("request_throughput", "req/s", 2),
)
CHECK_TOKENS = 8
WARMUP_SEED = 1000
KILL_SEED = 2000
SHARES = (0.0, 0.5)


def keep_logs(procs: list[VllmServer | Proc], logs: Path, failed: bool) -> None:
    """Every process's output into `logs`; after a failure, the tail of each on stderr."""
    logs.mkdir(parents=True, exist_ok=True)
    for i, p in enumerate(procs):
        if isinstance(p, VllmServer):
            name, text = f"{i}-vllm-{p.work.name}.log", p.log.read_text(errors="replace")
        else:
            name, text = f"{i}-{p.module}-{p.args[0]}.log", "".join(p.lines)
        (logs / name).write_text(text)
        if failed:
            tail = "\n".join(text.splitlines()[-30:])
            print(f"--- {name} (last lines)\n{tail}", file=sys.stderr)


@contextmanager
def started(keys: list[str], model: Path, work: Path, logs: Path) -> Iterator[list[Setup]]:
    """The set-ups running; every process stopped on leaving, however that happens, and its
    output kept in `logs`."""
    procs: list[VllmServer | Proc] = []
    setups: list[Setup] = []
    failed = True
    # NOTE: the set-ups start side by side (a vLLM takes minutes to start on a busy machine);
    # each appends its processes to `procs` as it starts them.
    pool = ThreadPoolExecutor(len(keys))
    try:
        futures = [
            pool.submit(start_setup, key, model, work / f"setup-{i}", procs)
            for i, key in enumerate(keys)
        ]
        setups += [f.result() for f in futures]
        print(f"started {keys}, load {os.getloadavg()}", flush=True)
        yield setups
        failed = False
    finally:
        for p in reversed(procs):
            p.stop()
        # The starts still running fail now that their processes are stopped; a process one
        # of them started meanwhile is stopped too.
        pool.shutdown(wait=True, cancel_futures=True)
        for p in reversed(procs):
            p.stop()
        keep_logs(procs, logs, failed)
        left = leftover_shm(setups)
        if left:
            print(f"shared memory left behind by the encoders: {left}", file=sys.stderr)


def jpeg_part(seed: list[int], size: int) -> dict:
    """An image part as vLLM's benchmark sends one: seeded random pixels, a JPEG data URL."""
    pixels = np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="JPEG")
    url = "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode()
    return {"type": "image_url", "image_url": {"url": url}}


def greedy(url: str, model: Path, content: list[dict]) -> list[int]:
    """The greedy token ids of one chat completion."""
    body = {
        "model": str(model),
        "messages": [{"role": "user", "content": content}],
        "max_tokens": CHECK_TOKENS,
        "temperature": 0.0,
        "logprobs": True,
        "return_tokens_as_token_ids": True,
    }
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=300)
    if r.status_code != 200:
        raise RuntimeError(f"{url}: {r.status_code} {r.text}")
    steps = r.json()["choices"][0]["logprobs"]["content"]
    return [int(s["token"].removeprefix("token_id:")) for s in steps]


def check_same(setups: list[Setup], model: Path, images: int, size: int) -> dict[str, list]:
    """One request with images to every set-up: the same greedy tokens, or no benchmark; and
    other images to the first, other tokens (so the check can fail)."""
    text = {"type": "text", "text": "describe the image"}
    media = [text, *(jpeg_part([7, i], size) for i in range(images))]
    other = [text, *(jpeg_part([8, i], size) for i in range(images))]
    got = {s.key: greedy(s.url, model, media) for s in setups}
    got["other images"] = greedy(setups[0].url, model, other)
    first = got[setups[0].key]
    if any(got[s.key] != first for s in setups):
        raise RuntimeError(f"the set-ups answer differently: {got}")
    # The tokens depend on the pixels, so the equality above says the images arrived.
    if got["other images"] == first:
        raise RuntimeError(f"other images gave the same tokens, the check cannot tell: {got}")
    return got


def mm_args(args: argparse.Namespace, prompts: int, rate: float) -> list[str]:
    size = args.image_size
    return [
        "--dataset-name", "random-mm",
        "--random-input-len", str(args.input_len),
        "--random-output-len", str(args.output_len),
        "--random-mm-base-items-per-request", str(args.images),
        "--random-mm-num-mm-items-range-ratio", "0",
        "--random-mm-limit-mm-per-prompt", json.dumps({"image": args.images, "video": 0}),
        "--random-mm-bucket-config", f"{{({size}, {size}, 1): 1.0}}",
        "--num-prompts", str(prompts),
        "--request-rate", str(rate),
        "--ignore-eos",
    ]  # fmt: skip


def figures(result: dict[str, Any]) -> dict[str, float]:
    keys = [key for key, _, _ in FIGURES]
    return {k: result[k] for k in keys} | {"completed": result["completed"]}


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before.get(k, 0.0) for k in after}


def measured(client: Client, s: Setup, seed: int, args: list[str], share: float, out: Path):
    """One benchmark run on `s`: its figures and the change of its counters."""
    before = s.counts()
    result = client.run(s.url, seed, args, [share, POOL[0]], out)
    return figures(result), delta(before, s.counts())


POOL = [8]  # the repeated images' pool size (--pool)


def warm_up(client: Client, setups: list[Setup], args: argparse.Namespace, tmp: Path):
    """One unpaced untimed run per set-up; the throughput each reached."""
    reached = {}
    for s in setups:
        a = mm_args(args, args.warmup_prompts, float("inf"))
        got, _ = measured(client, s, WARMUP_SEED, a, 0.5, tmp / f"warmup-{s.key}.json")
        reached[s.key] = got["request_throughput"]
        print(f"warm-up ({s.key}): {reached[s.key]:.2f} req/s unpaced", flush=True)
    return reached


def multimodal(
    client: Client,
    setups: list[Setup],
    args: argparse.Namespace,
    rates: list[float],
    tmp: Path,
    done: Callable[[dict[str, Any]], None],
) -> dict[str, Any]:
    """Every round's runs; `done` gets the figures so far after each round."""
    runs: dict[str, dict[str, list]] = {}
    counts: dict[str, dict[str, list]] = {}
    for r in range(args.rounds):
        for i, share in enumerate(SHARES):
            for j, rate in enumerate(rates):
                work = f"share {share:g}, {rate:.2f} req/s"
                # NOTE: a seed per round and workload: fresh images (and texts) are fresh to
                # every set-up's caches (vLLM's prefix cache would otherwise serve a whole
                # repeated request); every set-up gets the same ones.
                seed = (r * len(SHARES) + i) * len(rates) + j
                for s in setups:
                    a = mm_args(args, args.num_prompts, rate)
                    out = tmp / f"mm-{r}-{share}-{rate}-{s.key}.json"
                    got, c = measured(client, s, seed, a, share, out)
                    runs.setdefault(work, {}).setdefault(s.key, []).append(got)
                    counts.setdefault(work, {}).setdefault(s.key, []).append(c)
        print(f"round {r + 1}/{args.rounds} done, load {os.getloadavg()}", flush=True)
        done({"runs": runs, "counts": counts, "rounds_done": r + 1})
    return {"runs": runs, "counts": counts, "rounds_done": args.rounds}


def text_only(client: Client, setups: list[Setup], args: argparse.Namespace, tmp: Path):
    """(c)'s vLLM directly, then through its proxy, on random text: what the proxy itself adds
    to a request (no encoder in the path)."""
    c = next(s for s in setups if s.key == "c")
    a = [
        "--dataset-name", "random",
        "--random-input-len", str(args.input_len),
        "--random-output-len", str(args.output_len),
        "--num-prompts", str(args.num_prompts),
        "--request-rate", str(args.text_rate),
        "--ignore-eos",
    ]  # fmt: skip
    runs: dict[str, list] = {"vLLM directly": [], "through the proxy": []}
    for r in range(args.rounds):
        for name, url in zip(runs, (c.llm.url, c.url)):
            out = tmp / f"text-{r}-{len(runs[name])}-{name[:3]}.json"
            runs[name].append(figures(client.run(url, r, a, [0.0, 0], out)))
    return runs


def kill_runs(client: Client, setups: list[Setup], args: argparse.Namespace, rate, tmp: Path):
    """One run per disaggregated set-up with one encoder SIGKILLed halfway through."""
    out = {}
    for s in setups:
        if not s.encoders:
            continue
        a = mm_args(args, args.num_prompts, rate)
        client.start(s.url, KILL_SEED, a, [0.5, POOL[0]], tmp / f"kill-{s.key}.json")
        time.sleep(args.num_prompts / rate / 2)
        s.kill_encoder()
        result = client.finish(allow_failed=True)
        errors: dict[str, int] = {}
        for e in result["errors"]:
            if e:
                errors[e[:120]] = errors.get(e[:120], 0) + 1
        out[s.key] = {
            "failed": result["failed"],
            "completed": result["completed"],
            "errors": errors,
            "counts": s.counts(),
        }
        print(f"kill ({s.key}): {result['failed']} failed of {args.num_prompts}", flush=True)
    return out


def spread(values: list[float], digits: int) -> str:
    """median (min-max)"""
    mid = statistics.median(values)
    return f"{mid:.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def count_cell(key: str, c: list[dict[str, float]]) -> str:
    """Encoder calls and cache hits over the rounds (summed)."""
    total = {k: sum(x.get(k, 0.0) for x in c) for k in c[0]}
    if key == "a":
        return f"- | {total['hits']:.0f}/{total['calls']:.0f} (processor cache)"
    if key == "b":
        return f"{total['calls']:.0f} | {total['calls'] - total['written']:.0f}"
    extra = f", {total['fallback']:.0f} as pixels" if total.get("fallback") else ""
    return f"{total['calls']:.0f} | {total['hits']:.0f} (+{total['dedup']:.0f} joined){extra}"


def tables(mm: dict[str, Any]) -> list[str]:
    lines = []
    for work, per in mm["runs"].items():
        lines += ["", f"#### {work}", ""]
        head = " | ".join(label for _, label, _ in FIGURES)
        lines += [f"| set-up | {head} | encoder calls | cache hits |", "|---" * 6 + "|"]
        for key, rounds in per.items():
            cells = [spread([x[k] for x in rounds], d) for k, _, d in FIGURES]
            counts = count_cell(key, mm["counts"][work][key])
            lines.append(f"| ({key}) {SETUPS[key]} | " + " | ".join(cells) + f" | {counts} |")
    return lines


def p50(mm: dict[str, Any], work: str, key: str, figure: str = "median_ttft_ms") -> float:
    return statistics.median(x[figure] for x in mm["runs"][work][key])


def goals(mm: dict[str, Any], kills: dict[str, Any], heavy: bool) -> list[str]:
    """The issue's goals, each as the ratio or difference of medians over the rounds."""
    lines = []
    for work in mm["runs"]:
        per = mm["runs"][work]
        if "c" not in per:
            continue
        c = p50(mm, work, "c")
        if "b" in per:
            b = p50(mm, work, "b")
            rps = p50(mm, work, "c", "request_throughput") / p50(
                mm, work, "b", "request_throughput"
            )
            bound = 0.7 if (heavy and work.startswith("share 0.5")) else 1.0
            verdict = "met" if c <= bound * b and (bound == 1.0 or rps >= 1.0) else "missed"
            goal = f"(c) <= {bound}x (b)" + (", req/s >= (b)'s" if bound < 1 else "")
            lines.append(
                f"- {work}: (c)/(b) TTFT p50 {c / b:.2f}x, req/s {rps:.2f}x "
                f"[goal {goal}: {verdict if heavy else 'not a goal on this checkpoint'}]"
            )
        if "a" in per:
            gap = c - p50(mm, work, "a")
            verdict = "met" if gap <= 10 else "missed"
            lines.append(
                f"- {work}: (c) - (a) TTFT p50 {gap:+.1f} ms "
                f"[goal <= 10 ms: {verdict if not heavy else 'not a goal on this checkpoint'}]"
            )
    for key, k in kills.items():
        verdict = "met" if k["failed"] == 0 else "missed"
        goal = f" [goal 0: {verdict}]" if key == "c" else ""
        lines.append(f"- encoder killed, ({key}): {k['failed']} failed{goal}")
    return lines


def report(result: dict[str, Any], args: argparse.Namespace) -> None:
    print(f"\n{result['model']}; {args.images} images of {args.image_size}x{args.image_size} a "
          f"request, {args.num_prompts} requests a run, {args.rounds} rounds; repeats from a "
          f"pool of {args.pool}")  # fmt: skip
    print("\n".join(tables(result["multimodal"])))
    print("\n".join(["", "per stage, one request at a time:", *breakdown_lines(result)]))
    print("\n".join(["", "goals:", *goals(result["multimodal"], result["kill"], result["heavy"])]))
    for name, rounds in result.get("text", {}).items():
        cells = [spread([x[k] for x in rounds], d) for k, _, d in FIGURES]
        print(f"text-only, {name}: " + " | ".join(cells))
    for key, k in result["kill"].items():
        print(f"kill ({key}): {k['failed']} failed, {k['completed']} completed: {k['errors']}")
    if "pinned" in result:
        print(f"pinned: vLLM on CPUs {result['pinned']['engine']}, mmferry on "
              f"{result['pinned']['front']}")  # fmt: skip
    print(f"\nload average: {result['load']}")


def cpu_list(text: str) -> set[int]:
    """`0-3,6` as {0, 1, 2, 3, 6}."""
    out: set[int] = set()
    for part in text.split(","):
        first, _, last = part.partition("-")
        out |= set(range(int(first), int(last or first) + 1))
    return out


def save(result: dict[str, Any], path: Path | None) -> None:
    if path is not None:
        path.write_text(json.dumps(result, indent=1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="tiny", help="tiny, heavy, or a Qwen-VL checkpoint folder")
    p.add_argument("--setups", default="a,b,c,c'", help="of " + ",".join(SETUPS))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--num-prompts", type=int, default=24, help="multimodal requests per run")
    p.add_argument("--warmup-prompts", type=int, default=12, help="0: none (give --rates)")
    p.add_argument("--rates", default="auto", help="two req/s, as LOW,HIGH, or auto")
    p.add_argument("--images", type=int, default=4, help="per request")
    # 224 = 8 x 28: the tiny checkpoint's 64-token budget exactly, so neither side resamples
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--pool", type=int, default=8, help="the repeated images")
    p.add_argument("--input-len", type=int, default=64, help="random text tokens")
    p.add_argument("--output-len", type=int, default=8)
    p.add_argument("--breakdown", type=int, default=6, help="requests, one at a time; 0: none")
    p.add_argument("--text", action="store_true", help="text-only, (c) directly and proxied")
    p.add_argument("--text-rate", type=float, default=4.0)
    p.add_argument("--kill", action="store_true", help="the encoder-kill runs, at the low rate")
    p.add_argument(
        "--pin",
        help="ENGINE:FRONT, CPU lists (as 0 or 0-3,6): vLLM's processes on ENGINE, mmferry's "
        "(the proxy, the encoders) on FRONT, every thread",
    )
    p.add_argument("--json", type=Path, help="write every run's figures here")
    default_logs = Path(tempfile.gettempdir()) / "bench-proxy-logs"
    p.add_argument("--logs", type=Path, default=default_logs, help="the processes' output")
    args = p.parse_args()
    POOL[0] = args.pool
    keys = args.setups.split(",")
    unknown = [k for k in keys if k not in SETUPS]
    if unknown:
        p.error(f"unknown set-ups {unknown}; choose from {list(SETUPS)}")
    if args.rates == "auto" and args.warmup_prompts == 0:
        p.error("--rates auto needs the warm-up: with --warmup-prompts 0 give --rates LOW,HIGH")
    # SIGTERM unwinds like Ctrl-C, so every process started is stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    result: dict[str, Any] = {"command": sys.argv, "load": [os.getloadavg()]}
    with tempfile.TemporaryDirectory(prefix="bench-proxy-") as name:
        tmp = Path(name)
        if args.model in ("tiny", "heavy"):
            model = build_model(args.model, tmp / "model")
        else:
            model = Path(args.model)
        result["model"] = f"{args.model} checkpoint, {config_line(model)}"
        result["heavy"] = args.model != "tiny"
        with started(keys, model, tmp, args.logs) as setups:
            if args.pin:
                engine, front = (cpu_list(x) for x in args.pin.split(":"))
                pin(setups, engine, front)
                result["pinned"] = {"engine": sorted(engine), "front": sorted(front)}
            client = Client(model)
            try:
                result["check"] = check_same(setups, model, args.images, args.image_size)
                print(f"same tokens every way: {result['check']}", flush=True)
                reached = warm_up(client, setups, args, tmp) if args.warmup_prompts else {}
                if args.rates == "auto":
                    low = min(reached.values())
                    rates = [round(0.3 * low, 2), round(0.85 * low, 2)]
                else:
                    rates = [float(x) for x in args.rates.split(",")]
                result |= {"warmup_req_s": reached, "rates": rates}
                result["load"].append(os.getloadavg())

                def keep(mm: dict[str, Any]) -> None:
                    # A later round may not finish (a process killed): the rounds done stand.
                    save(result | {"multimodal": mm}, args.json)

                result["multimodal"] = multimodal(client, setups, args, rates, tmp, keep)
                result["load"].append(os.getloadavg())
                save(result, args.json)  # a later step may fail; these figures stand
                if args.breakdown:
                    result["breakdown"] = breakdown(setups, model, args)
                    save(result, args.json)
                if args.text and "c" in keys:
                    result["text"] = text_only(client, setups, args, tmp)
                result["kill"] = kill_runs(client, setups, args, rates[0], tmp) if args.kill else {}
                result["load"].append(os.getloadavg())
            finally:
                client.stop()
    save(result, args.json)
    report(result, args)


if __name__ == "__main__":
    main()
