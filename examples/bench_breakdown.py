"""Where one request's time goes, set-up by set-up: requests sent one at a time (nothing queues),
each request's share of what the processes' /metrics recorded meanwhile.

Per set-up, `--breakdown` requests with fresh images (every item encoded), then the same requests
again (every item a repeat). The client's TTFT (to the answer's first byte, streamed) beside:
- the LLM's vLLM: its own TTFT (from the request's arrival at its server), queue and prefill
  time (the prefill holds the tower's run in (a), the connector's load in (b) and (c));
- (b): the encoder-only vLLMs' whole request per item (the front waits for the slowest);
- (c): the proxy reading the body, each item's encoder call as the proxy waits for it, the
  proxy's TTFT (body read to vLLM's first chunk), and the encoders' stages per item (read,
  fetch, preprocess, queue, encode: the tower, respond) and the connector's lookups and loads
  as the encoders answered them (their read and respond stages also count those calls).

These are histogram sums divided by the requests sent: means, not medians.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import httpx
from bench_setups import Setup

from tests.proxy.procs import scrape

SERVICE_STAGES = ("read", "fetch", "preprocess", "queue", "encode", "respond")
# (label, metric, labels) summed over the processes named by the group
VLLM = (
    ("vLLM TTFT", "vllm:time_to_first_token_seconds_sum", {}),
    ("vLLM queue", "vllm:request_queue_time_seconds_sum", {}),
    ("vLLM prefill", "vllm:request_prefill_time_seconds_sum", {}),
)
PROXY = (
    ("proxy read", "mmferry_proxy_stage_seconds_sum", {"stage": "read"}),
    ("proxy TTFT", "mmferry_proxy_ttft_seconds_sum", {}),
    ("encoder calls (sum over items)", "mmferry_proxy_encoder_seconds_sum", {}),
    ("encoder calls (count)", "mmferry_proxy_encoder_seconds_count", {}),
)
SERVICE = tuple(
    (f"service {s} (sum over items)", "mmferry_stage_seconds_sum", {"stage": s})
    for s in SERVICE_STAGES
) + (
    ("service lookups (count)", "mmferry_cache_lookups_total", {}),
    # vLLM's lookups of items still being encoded (the request deferred a scheduler pass)
    ("service lookups pending (count)", "mmferry_cache_lookups_total", {"answer": "pending"}),
)
ENCODER_VLLM = (
    ("encoder vLLM request (sum over items)", "vllm:e2e_request_latency_seconds_sum", {}),
)


def snapshot(s: Setup) -> dict[str, float]:
    groups = [(VLLM, [s.llm.url])]
    if s.key == "b":
        groups.append((ENCODER_VLLM, [e.url for e in s.encoders]))
    if s.key in ("c", "ca", "cn", "c'"):
        groups.append((PROXY, [s.url]))
        alive = [e.url for e in s.encoders if e.proc is not None and e.proc.poll() is None]
        groups.append((SERVICE, alive))
    return {
        label: sum(scrape(url, metric, **labels) for url in urls)
        for spec, urls in groups
        for label, metric, labels in spec
    }


def first_byte(url: str, body: dict) -> float:
    """Seconds to the first chunk of a streamed chat answer (read to its end)."""
    t0 = time.perf_counter()
    ttft = None
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=300) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{url}: {r.status_code} {r.read()[:300]!r}")
        for chunk in r.iter_raw():
            if ttft is None and chunk:
                ttft = time.perf_counter() - t0
    assert ttft is not None
    return ttft


def breakdown(setups: list[Setup], model: Path, args: argparse.Namespace) -> dict[str, Any]:
    from bench_proxy import jpeg_part

    out: dict[str, Any] = {}
    for s in setups:
        if s.key not in ("a", "b", "c", "ca", "cn"):
            continue
        bodies = []
        for i in range(args.breakdown):
            parts = [{"type": "text", "text": f"request {i}: describe the images"}]
            parts += [jpeg_part([9, i, j], args.image_size) for j in range(args.images)]
            bodies.append({
                "model": str(model),
                "messages": [{"role": "user", "content": parts}],
                "max_tokens": args.output_len,
                "stream": True,
            })  # fmt: skip
        for phase in ("fresh", "repeated"):
            before = snapshot(s)
            ttfts = [first_byte(s.url, b) for b in bodies]
            after = snapshot(s)
            n = len(bodies)
            stages = {k: (after[k] - before[k]) / n for k in after}
            stages["client TTFT"] = sum(ttfts) / n
            out.setdefault(s.key, {})[phase] = stages
    return out


def breakdown_lines(result: dict[str, Any]) -> list[str]:
    lines = []
    for key, phases in result.get("breakdown", {}).items():
        for phase, stages in phases.items():
            cells = [
                f"{k} {v:.0f}" if "count" in k else f"{k} {v * 1000:.1f} ms"
                for k, v in stages.items()
            ]
            lines.append(f"- ({key}) {phase}, per request: " + "; ".join(cells))
    return lines
