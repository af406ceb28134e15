"""vLLM's own serving benchmark against a plain vLLM and `mmferry proxy`, in one command.

    PYTHONPATH=. .venv/bin/python examples/bench_proxy.py --rounds 5 --json result.json

Starts every process itself, on loopback: the tiny Qwen2.5-VL checkpoint of the tests (or
--model DIR), a plain vLLM (pixels, no connector), two `mmferry serve` encoders, a second vLLM
whose MmferryECConnector loads from them and `mmferry proxy --mode connector` in front of it,
each as the proxy tests start it (tests/proxy/procs.py; vLLM from .vllm-venv). Before timing,
one greedy request with images goes to both set-ups and one text-only request to the proxied
vLLM directly and through the proxy; each pair must give the same tokens (and other images other
tokens, so the check can fail).

Then vLLM's benchmark (`vllm.benchmarks.serve`, the module: the CPU wheel's `vllm bench`
console script stops on its package name), OpenAI chat backend, at a fixed request rate:
- multimodal: its `random-mm` dataset, --images images per request. random-mm draws every image
  fresh, so nothing would repeat; the benchmark runs with its image generator wrapped: with
  probability --repeat-share (drawn from the dataset's own seeded generator) an image is one of
  --pool fixed images, the same in every round, else vLLM's own fresh one. Each round has its
  own seed, so fresh images and texts differ between rounds; both set-ups of a round get the
  same requests. A round runs plain, then the proxy; the encoders' cache hit rate of a round is
  the change of `mmferry_cache_hits_total` and `_misses_total` on their /metrics. One untimed
  warm-up round per set-up comes first.
- text-only: its `random` dataset, straight to the proxied vLLM, then through the proxy: what
  the proxy itself adds to a request.
Printed: median (min-max) over the rounds of TTFT p50 and p99 and of request throughput. Every
process is stopped at the end, on an error, on Ctrl-C and on SIGTERM.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the tests' tiny checkpoint and process helpers

from tests.engines.tiny_vlm import build_checkpoint  # noqa: E402
from tests.engines.vllm_harness import VLLM_PYTHON, vllm_env  # noqa: E402
from tests.proxy.procs import Proc, VllmServer, encoder, proxy, scrape  # noqa: E402

# Runs in vLLM's environment: vLLM's benchmark, its random-mm images wrapped so that a share
# repeats (argv[1]: [share, pool]; the rest is the benchmark's command line).
RUNNER = """\
import json, sys
import numpy as np
from PIL import Image
from vllm.benchmarks.datasets.datasets import RandomMultiModalDataset
from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser

share, pool = json.loads(sys.argv[1])
fresh = RandomMultiModalDataset.generate_synthetic_image


def image(self, width, height):
    if share > 0 and self._rng.random() < share:
        rng = np.random.default_rng([int(self._rng.integers(pool)), height, width])
        return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))
    return fresh(self, width, height)


RandomMultiModalDataset.generate_synthetic_image = image
p = FlexibleArgumentParser()
add_cli_args(p)
main(p.parse_args(sys.argv[2:]))
"""
FIGURES = (
    ("median_ttft_ms", "TTFT p50 ms", 1),
    ("p99_ttft_ms", "TTFT p99 ms", 1),
    ("request_throughput", "req/s", 2),
)
CHECK_TOKENS = 8
WARMUP_SEED = 1000


@dataclass
class Stack:
    model: Path
    plain: VllmServer
    llm: VllmServer
    encoders: list[Proc]
    front: Proc


def keep_logs(procs: list[VllmServer | Proc], logs: Path, failed: bool) -> None:
    """Every process's output into `logs`; after a failure, the tail of each on stderr."""
    logs.mkdir(parents=True, exist_ok=True)
    for i, p in enumerate(procs):
        if isinstance(p, VllmServer):
            name, text = f"{i}-vllm-{p.work.name}.log", p.log.read_text(errors="replace")
        else:
            name, text = f"{i}-mmferry-{p.args[0]}.log", "".join(p.lines)
        (logs / name).write_text(text)
        if failed:
            tail = "\n".join(text.splitlines()[-30:])
            print(f"--- {name} (last lines)\n{tail}", file=sys.stderr)


@contextmanager
def started(model: Path, work: Path, logs: Path) -> Iterator[Stack]:
    """Both set-ups running; every process stopped on leaving, however that happens, and its
    output kept in `logs`."""
    procs: list[VllmServer | Proc] = []
    failed = True
    try:
        (work / "plain").mkdir()
        (work / "connector").mkdir()
        plain = VllmServer(model, work / "plain")
        procs.append(plain)
        plain.start()
        encoders = [encoder(model) for _ in range(2)]
        for e in encoders:
            procs.append(e)
            e.start()
        urls = [e.url for e in encoders]
        llm = VllmServer(model, work / "connector", {"urls": urls})
        procs.append(llm)
        llm.start()
        front = proxy(llm.url, urls, "connector")
        procs.append(front)
        front.start()
        yield Stack(model, plain, llm, encoders, front)
        failed = False
    finally:
        for p in reversed(procs):
            p.stop()
        keep_logs(procs, logs, failed)
        left = [
            path.name
            for p in procs
            if isinstance(p, Proc) and p.proc is not None
            for path in Path("/dev/shm").glob(f"mmferry-{p.proc.pid}-*")
        ]
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


def check_same(stack: Stack, images: int, size: int) -> dict[str, list[int]]:
    """One request with images to both set-ups, one text-only request to the proxied vLLM
    directly and through the proxy: the same greedy tokens, or no benchmark."""
    text = {"type": "text", "text": "describe the image"}
    media = [text, *(jpeg_part([7, i], size) for i in range(images))]
    other = [text, *(jpeg_part([8, i], size) for i in range(images))]
    got = {
        "images, plain vLLM": greedy(stack.plain.url, stack.model, media),
        "images, through the proxy": greedy(stack.front.url, stack.model, media),
        "text, vLLM directly": greedy(stack.llm.url, stack.model, [text]),
        "text, through the proxy": greedy(stack.front.url, stack.model, [text]),
        "other images, plain vLLM": greedy(stack.plain.url, stack.model, other),
    }
    a, b, c, d, e = got.values()
    if a != b or c != d:
        raise RuntimeError(f"the set-ups answer differently: {got}")
    # The tokens depend on the pixels, so the equality above says the images arrived.
    if a == e:
        raise RuntimeError(f"other images gave the same tokens, the check cannot tell: {got}")
    return got


def bench(
    url: str, model: Path, seed: int, args: list[str], repeat: list[float], out: Path
) -> dict[str, Any]:
    """One run of vLLM's benchmark; its saved result. Any failed request stops the benchmark
    with the errors vLLM's client recorded."""
    cmd = [str(VLLM_PYTHON), "-c", RUNNER, json.dumps(repeat)]
    cmd += ["--backend", "openai-chat", "--base-url", url, "--endpoint", "/v1/chat/completions"]
    cmd += ["--model", str(model), "--seed", str(seed), "--disable-tqdm"]
    # The processes are up (checked above); the ready check would send one request more.
    cmd += ["--ready-check-timeout-sec", "0"]
    cmd += ["--percentile-metrics", "ttft", "--metric-percentiles", "50,99"]
    cmd += ["--save-result", "--save-detailed"]
    cmd += ["--result-dir", str(out.parent), "--result-filename", out.name]
    run = subprocess.run([*cmd, *args], capture_output=True, text=True, env=vllm_env(False))
    if run.returncode != 0:
        raise RuntimeError(f"vLLM's benchmark failed:\n{run.stdout[-3000:]}{run.stderr[-3000:]}")
    result = json.loads(out.read_text())
    if result["failed"]:
        errors = Counter(e for e in result["errors"] if e).most_common(3)
        raise RuntimeError(f"{result['failed']} requests failed at {url}: {errors}")
    return result


def counters(stack: Stack) -> dict[str, float]:
    """The encoders' cache counters (summed), the proxy's encoder time and the items it sent
    to vLLM as pixels (no encoder held them)."""
    names = {
        "hits": "mmferry_cache_hits_total",
        "misses": "mmferry_cache_misses_total",
        "dedup": "mmferry_inflight_dedup_total",  # joined an identical item being encoded
    }
    out = {k: sum(scrape(e.url, name) for e in stack.encoders) for k, name in names.items()}
    for part in ("sum", "count"):
        out[f"encoder_{part}"] = scrape(stack.front.url, f"mmferry_proxy_encoder_seconds_{part}")
    out["fallback"] = scrape(stack.front.url, "mmferry_proxy_items_fallback_total")
    return out


def figures(result: dict[str, Any]) -> dict[str, float]:
    return {key: result[key] for key, _, _ in FIGURES} | {"completed": result["completed"]}


def spread(values: list[float], digits: int) -> str:
    """median (min-max)"""
    mid = statistics.median(values)
    return f"{mid:.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def mm_args(args: argparse.Namespace, prompts: int) -> list[str]:
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
        "--request-rate", str(args.request_rate),
        "--ignore-eos",
    ]  # fmt: skip


def text_args(args: argparse.Namespace) -> list[str]:
    return [
        "--dataset-name", "random",
        "--random-input-len", str(args.input_len),
        "--random-output-len", str(args.output_len),
        "--num-prompts", str(args.text_prompts),
        "--request-rate", str(args.text_rate),
        "--ignore-eos",
    ]  # fmt: skip


def multimodal(stack: Stack, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    targets = {"plain vLLM (pixels)": stack.plain.url, "proxy, connector mode": stack.front.url}
    repeat = [args.repeat_share, args.pool]
    for i, url in enumerate(targets.values() if args.warmup_prompts > 0 else ()):
        warmup = mm_args(args, args.warmup_prompts)
        bench(url, stack.model, WARMUP_SEED, warmup, repeat, tmp / f"warmup-{i}.json")
    runs: dict[str, list[dict]] = {name: [] for name in targets}
    cache: list[dict[str, float]] = []
    for r in range(args.rounds):
        for i, (name, url) in enumerate(targets.items()):
            before = counters(stack)
            out = tmp / f"mm-{r}-{i}.json"
            result = bench(url, stack.model, r, mm_args(args, args.num_prompts), repeat, out)
            runs[name].append(figures(result))
            if url == stack.front.url:
                after = counters(stack)
                cache.append({k: after[k] - before[k] for k in after})
        print(f"multimodal round {r + 1}/{args.rounds} done, load {os.getloadavg()}", flush=True)
    return {"runs": runs, "cache": cache}


def text_only(stack: Stack, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    targets = {"vLLM directly": stack.llm.url, "through the proxy": stack.front.url}
    runs: dict[str, list[dict]] = {name: [] for name in targets}
    for r in range(args.rounds):
        for i, (name, url) in enumerate(targets.items()):
            out = tmp / f"text-{r}-{i}.json"
            runs[name].append(figures(bench(url, stack.model, r, text_args(args), [0, 0], out)))
        print(f"text-only round {r + 1}/{args.rounds} done, load {os.getloadavg()}", flush=True)
    return {"runs": runs}


def table(runs: dict[str, list[dict]]) -> list[str]:
    head = "| target | " + " | ".join(label for _, label, _ in FIGURES) + " |"
    lines = [head, "|---" * (len(FIGURES) + 1) + "|"]
    for name, rounds in runs.items():
        cells = [spread([x[key] for x in rounds], digits) for key, _, digits in FIGURES]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def p50_gap(runs: dict[str, list[dict]]) -> str:
    """The second target's TTFT p50 less the first's, paired by round."""
    first, second = runs.values()
    gaps = [b["median_ttft_ms"] - a["median_ttft_ms"] for a, b in zip(first, second, strict=True)]
    return spread(gaps, 1)


def report(result: dict[str, Any], args: argparse.Namespace) -> None:
    mm, text = result["multimodal"], result["text"]
    print(
        f"\nmultimodal: {args.num_prompts} requests at {args.request_rate} req/s, "
        f"{args.images} images of {args.image_size}x{args.image_size} each, a share "
        f"{args.repeat_share} from a pool of {args.pool}; {args.rounds} rounds"
    )
    print("\n".join(table(mm["runs"])))
    rates = [c["hits"] / (c["hits"] + c["misses"]) * 100 for c in mm["cache"]]
    per_item = [c["encoder_sum"] / c["encoder_count"] * 1000 for c in mm["cache"]]
    total = {k: sum(c[k] for c in mm["cache"]) for k in ("hits", "misses", "dedup", "fallback")}
    print(
        f"encoders' cache hit rate per round: {spread(rates, 1)} % (in all {total['hits']:.0f} "
        f"hits, {total['misses']:.0f} misses, {total['dedup']:.0f} joined to the same item in "
        f"flight; {total['fallback']:.0f} items sent to vLLM as pixels)"
    )
    print(f"an item's encode as the proxy waits for it: {spread(per_item, 1)} ms")
    print(f"proxy less plain, TTFT p50 per round: {p50_gap(mm['runs'])} ms")
    print(
        f"\ntext-only: {args.text_prompts} requests at {args.text_rate} req/s; {args.rounds} rounds"
    )
    print("\n".join(table(text["runs"])))
    print(f"through the proxy less directly, TTFT p50 per round: {p50_gap(text['runs'])} ms")
    print(f"\nload average: {result['load']}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", type=Path, help="a Qwen-VL checkpoint (default: the tests' tiny one)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--num-prompts", type=int, default=40, help="multimodal requests per round")
    p.add_argument("--warmup-prompts", type=int, default=8, help="0: no warm-up round")
    p.add_argument("--request-rate", type=float, default=2.0, help="multimodal, req/s")
    p.add_argument("--images", type=int, default=4, help="per request")
    # 224 = 8 x 28: the tiny checkpoint's 64-token budget exactly, so neither side resamples
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--repeat-share", type=float, default=0.5)
    p.add_argument("--pool", type=int, default=8, help="the repeated images")
    p.add_argument("--input-len", type=int, default=64, help="random text tokens")
    p.add_argument("--output-len", type=int, default=8)
    p.add_argument("--text-prompts", type=int, default=40)
    p.add_argument("--text-rate", type=float, default=4.0)
    p.add_argument("--json", type=Path, help="write every round's figures here")
    default_logs = Path(tempfile.gettempdir()) / "bench-proxy-logs"
    p.add_argument("--logs", type=Path, default=default_logs, help="the processes' output")
    args = p.parse_args()
    # SIGTERM unwinds like Ctrl-C, so every process started is stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    result: dict[str, Any] = {"command": sys.argv, "load": [os.getloadavg()]}
    with tempfile.TemporaryDirectory(prefix="bench-proxy-") as name:
        tmp = Path(name)
        model = args.model or build_checkpoint("qwen2_5_vl", tmp / "model")
        with started(model, tmp, args.logs) as stack:
            result["check"] = check_same(stack, args.images, args.image_size)
            print(f"same tokens both ways: {result['check']}", flush=True)
            result["load"].append(os.getloadavg())
            result["multimodal"] = multimodal(stack, args, tmp)
            result["load"].append(os.getloadavg())
            result["text"] = text_only(stack, args, tmp)
            result["load"].append(os.getloadavg())
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    report(result, args)


if __name__ == "__main__":
    main()
