"""SGLang's own serving benchmark against one `--language-only` SGLang server, its images encoded
by SGLang's `--encoder-only` server or by two `mmferry serve` encoders sharing a Mooncake Store.

    PYTHONPATH=. .venv/bin/python examples/bench_sglang_epd.py --rounds 5 --json result.json

Starts every process itself, on loopback and on the CPU, as tests/engines/test_sglang_epd.py
does: the tests' tiny Qwen3-VL checkpoint (or --model DIR), a Mooncake master and holder, two
`mmferry serve --store` encoders, SGLang's encoder and the language server
(`zmq_to_tokenizer`), which is pointed at one encoder set or the other through its own encoder
registry between runs. Before timing, one greedy request goes through both encoder sets and must
give the same tokens.

SGLang's benchmark (`sglang.benchmark.serving`, `--backend sglang`) runs with its `image`
dataset (random JPEGs as data: URLs, --images per request, Poisson arrivals at --request-rate).
That dataset builds its prompts with the checkpoint's chat template and keeps the tokenizer's
special tokens out of its random text: the tiny checkpoint has neither, so the benchmark reads a
copy of it (the same weights and processor files) with a chat template that puts Qwen's
`<|vision_start|><|image_pad|><|vision_end|>` per image and the vision tokens named special.
- all distinct: the dataset as SGLang draws it;
- half repeated: the same, with the dataset wrapped so that each request's images are, with
  probability --repeat-share (a seeded draw), those of an earlier request of the run.
Every run has a seed of its own (no image repeats across runs, so no run finds another's images
in a cache); within a round both set-ups get the same seed, the order alternating each round.
One untimed warm-up run per set-up comes first. Printed: the median (min-max) over the rounds of
TTFT p50 and p99 and of request throughput, the items mmferry encoded, and the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the tests' tiny checkpoint and process helpers

from tests.engines.sglang_epd import (  # noqa: E402
    IMAGE_TOKEN,
    LanguageServer,
    SglangServer,
    answer,
    metric,
    start_encoders,
    write_png,
)
from tests.engines.sglang_harness import SGLANG_PYTHON, sglang_env  # noqa: E402
from tests.engines.tiny_vlm import build_checkpoint, image  # noqa: E402
from tests.store import cluster  # noqa: E402

BACKEND = "zmq_to_tokenizer"
# Runs in SGLang's environment: its benchmark, the dataset wrapped so that a share of the
# requests repeats an earlier request's images (argv[1]: the share; the rest is its CLI).
RUNNER = r"""
import random, sys
from sglang.benchmark import serving

share = float(sys.argv.pop(1))
if share > 0:
    own = serving.get_dataset

    def get_dataset(args, tokenizer, model_id=None):
        rows = own(args, tokenizer, model_id)
        rng = random.Random(args.seed)
        for k in range(1, len(rows)):
            if rng.random() < share:
                rows[k].image_data = list(rows[rng.randrange(k)].image_data)
        return rows

    serving.get_dataset = get_dataset
serving.cli_main()
"""
# A chat template in Qwen's shape for the tiny checkpoint's word-level tokenizer (which has no
# <|im_start|>): each image part becomes its vision span, text parts follow.
CHAT_TEMPLATE = """\
{%- for message in messages -%}
{%- if message.content is string -%}{{ message.content }}
{%- else -%}{%- for part in message.content -%}
{%- if part.type == 'image' -%}<|vision_start|><|image_pad|><|vision_end|>
{%- elif part.type == 'video' -%}<|vision_start|><|video_pad|><|vision_end|>
{%- elif part.type == 'text' -%} {{ part.text }}
{%- endif -%}{%- endfor -%}{%- endif -%}
{%- endfor -%}
"""
VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]


def chat_checkpoint(src: Path, dst: Path) -> Path:
    """`src`'s files linked into `dst`, with a chat template and the vision tokens special."""
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.name != "tokenizer_config.json":
            (dst / f.name).symlink_to(f.resolve())
    cfg = json.loads((src / "tokenizer_config.json").read_text())
    cfg["extra_special_tokens"] = VISION_TOKENS
    (dst / "tokenizer_config.json").write_text(json.dumps(cfg, indent=1))
    (dst / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return dst


def bench(lang: LanguageServer, model: Path, args: argparse.Namespace, seed: int, share: float,
          prompts: int, out: Path) -> dict[str, Any]:  # fmt: skip
    cmd = [str(SGLANG_PYTHON), "-c", RUNNER, str(share), "--backend", "sglang"]
    cmd += ["--base-url", lang.url, "--model", str(model), "--tokenizer", str(model)]
    cmd += ["--dataset-name", "image", "--num-prompts", str(prompts), "--seed", str(seed)]
    cmd += ["--image-count", str(args.images), "--image-resolution", args.resolution]
    cmd += ["--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len)]
    cmd += ["--request-rate", str(args.request_rate), "--output-file", str(out)]
    cmd += ["--disable-tqdm"]
    out.unlink(missing_ok=True)
    load = os.getloadavg()[0]
    done = subprocess.run(cmd, capture_output=True, text=True, env=sglang_env(), timeout=3600)
    if done.returncode != 0:
        raise RuntimeError(f"the benchmark failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    result = json.loads(out.read_text().strip().splitlines()[-1])
    if result["completed"] != prompts:
        raise RuntimeError(
            f"{prompts - result['completed']} requests failed:\n{done.stdout[-3000:]}"
        )
    result["load_avg"] = [load, os.getloadavg()[0]]  # 1-minute load at start and end
    return result


def encoded(urls: list[str]) -> float:
    return sum(metric(u, "mmferry_encoded_items") for u in urls)


def spread(values: list[float], digits: int) -> str:
    lo, mid, hi = min(values), statistics.median(values), max(values)
    return f"{mid:.{digits}f} ({lo:.{digits}f}-{hi:.{digits}f})"


def report(runs: dict[str, list[dict[str, Any]]], args: argparse.Namespace) -> None:
    head = f"{'dataset / encoder':<26} {'TTFT p50 ms':>24} {'TTFT p99 ms':>24} {'req/s':>20}"
    print(head + f" {'mmferry encoded':>16}")
    for name, rs in runs.items():
        p50 = spread([x["median_ttft_ms"] for x in rs], 1)
        p99 = spread([x["p99_ttft_ms"] for x in rs], 1)
        tput = spread([x["request_throughput"] for x in rs], 3)
        items = "" if "sglang" in name else str([int(x["mmferry_encoded"]) for x in rs])
        print(f"{name:<26} {p50:>24} {p99:>24} {tput:>20} {items:>16}")
    loads = [v for rs in runs.values() for x in rs for v in x["load_avg"]]
    lo, mid, hi = min(loads), statistics.median(loads), max(loads)
    print(
        f"images per run: {args.num_prompts * args.images}; 1-minute load average during the runs:"
    )
    print(f"{lo:.1f}-{hi:.1f} (median {mid:.1f})")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", type=Path, help="a Qwen-VL checkpoint (default: the tests' tiny one)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--num-prompts", type=int, default=40)
    p.add_argument("--warmup-prompts", type=int, default=6)
    p.add_argument("--request-rate", type=float, default=2.0)
    p.add_argument("--images", type=int, default=2, help="per request")
    p.add_argument("--resolution", default="448x448", help="SGLang's --image-resolution")
    p.add_argument("--repeat-share", type=float, default=0.5)
    p.add_argument("--input-len", type=int, default=32, help="random text tokens")
    p.add_argument("--output-len", type=int, default=8)
    p.add_argument("--json", type=Path, help="write every run's figures here (after each run)")
    args = p.parse_args()
    with ExitStack() as stack:
        work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-sglang-")))
        # A real checkpoint has its chat template and special tokens; the tiny one gets them.
        model = args.model or chat_checkpoint(
            build_checkpoint("qwen3_vl", work / "tiny"), work / "model"
        )
        store = cluster.Cluster(work / "mooncake")
        store.work.mkdir()
        stack.callback(store.stop)
        store.start()
        encoders = start_encoders(model, store.url, work)
        stack.callback(lambda: [e.stop() for e in encoders])
        ours = [e.url for e in encoders]
        t0 = time.monotonic()
        own = SglangServer.start(
            model, work / "encoder.log", "--encoder-only", "--encoder-transfer-backend", BACKEND
        )
        stack.callback(own.stop)
        lang = LanguageServer.launch(model, work / "language.log", BACKEND, [own.url])
        stack.callback(lang.stop)
        print(f"SGLang's servers started in {time.monotonic() - t0:.0f} s", flush=True)
        check = write_png(work / "check.png", image(64, 96, 0))
        same = []
        for urls in ([own.url], ours):
            lang.use(urls)
            same.append(answer(lang.generate(f"hi {IMAGE_TOKEN} ?", {"image": [check]}))[0])
        assert same[0] == same[1], same
        setups = {"sglang": [own.url], "mmferry": ours}
        for urls in setups.values():
            lang.use(urls)
            bench(lang, model, args, 10_000, 0.0, args.warmup_prompts, work / "warm.jsonl")
        runs: dict[str, list[dict[str, Any]]] = {}
        for r in range(args.rounds):
            for k, (data, share) in enumerate(
                (("distinct", 0.0), ("half repeated", args.repeat_share))
            ):
                order = list(setups) if r % 2 == 0 else list(setups)[::-1]
                for setup in order:
                    lang.use(setups[setup])
                    before = encoded(ours)
                    seed = 2 * r + k
                    res = bench(lang, model, args, seed, share, args.num_prompts, work / "r.jsonl")
                    res["mmferry_encoded"] = encoded(ours) - before
                    runs.setdefault(f"{data} / {setup}", []).append(res)
                    print(
                        f"round {r} {data} / {setup}: TTFT p50 {res['median_ttft_ms']:.1f} ms, "
                        f"p99 {res['p99_ttft_ms']:.1f} ms, {res['request_throughput']:.3f} req/s, "
                        f"load {res['load_avg'][0]:.1f}-{res['load_avg'][1]:.1f}",
                        flush=True,
                    )
                    if args.json:
                        record = {"args": vars(args) | {"model": str(model), "json": None}}
                        args.json.write_text(json.dumps(record | {"runs": runs}, default=str))
        report(runs, args)


if __name__ == "__main__":
    main()
