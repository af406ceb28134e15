"""The proxy's own cost a request, with nothing else on the path: CPU seconds and latency.

    PYTHONPATH=. .venv/bin/python examples/proxy_cpu.py --requests 200

Starts two `mmferry serve` encoders on the tests' tiny Qwen2.5-VL checkpoint, a recording
engine (a stdlib HTTP server answering every chat request at once, tests/proxy/procs.py) and
`mmferry proxy --mode connector` in front, then sends requests one at a time, each with
`--images` fresh 224x224 JPEGs as data: URLs. Prints the CPU time (the kernel's user and system
time of each process and its children, a JSON parsing child included) the proxy and each encoder
spent a request, and the client's latency
through the proxy beside the engine's own. Run it in two environments to compare them (a
package installed or not, two commits); its figures are per request, so the machine's other
work moves them less than it moves latency.
"""

from __future__ import annotations

import argparse
import base64
import io
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the tests' tiny checkpoint and process helpers

from tests.engines.tiny_vlm import build_checkpoint  # noqa: E402
from tests.proxy.procs import RecordingEngine, cpu_seconds, encoder, proxy  # noqa: E402

CHAT = "/v1/chat/completions"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--images", type=int, default=4, help="images a request")
    ap.add_argument("--warmup", type=int, default=10)
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)

    def body() -> dict[str, Any]:
        parts: list[dict[str, Any]] = [{"type": "text", "text": "hi"}]
        for _ in range(args.images):
            buf = io.BytesIO()
            pixels = rng.integers(0, 256, (224, 224, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(buf, "JPEG")
            url = "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode()
            parts.append({"type": "image_url", "image_url": {"url": url}})
        return {"model": "m", "messages": [{"role": "user", "content": parts}], "max_tokens": 8}

    with tempfile.TemporaryDirectory(prefix="proxy-cpu-") as work:
        model = build_checkpoint("qwen2_5_vl", Path(work) / "model")
        engine = RecordingEngine({"id": "recorded", "choices": []})
        encoders = [encoder(model).start() for _ in range(2)]
        front = None
        try:
            front = proxy(engine.url, [e.url for e in encoders], "connector").start()
            bodies = [body() for _ in range(args.warmup + args.requests)]
            direct, through = [], []
            with httpx.Client(timeout=60) as client:
                for b in bodies[: args.warmup]:
                    r = client.post(front.url + CHAT, json=b)
                    r.raise_for_status()
                pids = [front.proc.pid, *(e.proc.pid for e in encoders)]
                before = [cpu_seconds(p) for p in pids]
                for b in bodies[args.warmup :]:
                    t0 = time.perf_counter()
                    client.post(front.url + CHAT, json=b).raise_for_status()
                    through.append(time.perf_counter() - t0)
                used = [(cpu_seconds(p) - b) / args.requests * 1e3 for p, b in zip(pids, before)]
                for b in bodies[args.warmup :][:50]:
                    t0 = time.perf_counter()
                    client.post(engine.url + CHAT, json=b).raise_for_status()
                    direct.append(time.perf_counter() - t0)
            engine.take()
        finally:
            if front is not None:
                front.stop()
            for e in encoders:
                e.stop()
    print(f"{args.requests} requests, {args.images} images each, one at a time")
    print(f"CPU ms a request: proxy {used[0]:.2f}, encoders {used[1]:.2f} and {used[2]:.2f}")
    print(
        f"latency p50: through the proxy {statistics.median(through) * 1e3:.2f} ms, "
        f"the engine directly {statistics.median(direct) * 1e3:.2f} ms"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
