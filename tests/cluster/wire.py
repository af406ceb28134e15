"""What an image's rows cost on a link, against sending its JPEG: hosts S (the Mooncake master
and holder), E (an encoder's place: it publishes entries of the rows' real sizes) and V (an
engine's place: it reads them from S, its link shaped by tbf); the JPEG goes from E to a sink
on V over the same link. Rows: bf16, Qwen2.5-VL-7B (3584 wide) and Qwen3-VL-8B (4096 wide,
main and 3 deepstack rows a token), for a 448x448 and a 1344x1344 image; JPEGs: the project's
photo (mmferry/assets/astronaut.jpg) resized to each size, quality 90. Each rate: 5 rounds,
rows and JPEG interleaved within a round; median and min-max of the per-item times.

Run as root: python -m tests.cluster.wire [--rates none,10gbit,1gbit] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from PIL import Image

from mmferry.testing.cluster import Net
from tests.cluster import mooncake, stack

ROOT = Path(__file__).resolve().parents[2]
WIDTHS = {"qwen2.5-vl-7b": (28, 3584, 1), "qwen3-vl-8b": (32, 4096, 4)}  # factor, width, rows
SIDES = (448, 1344)
ROUNDS = 5

READER = r"""
import json, sys, time
from mmferry.store.mooncake import MooncakeStore, StoreAddress
keys = json.loads(sys.argv[2])
store = MooncakeStore(StoreAddress.parse(sys.argv[1]))
out = {}
for k in keys:
    store.get(k)  # warm: the client's first read of a segment opens its connection
for r in range(int(sys.argv[3])):
    for k in keys:
        t = time.perf_counter()
        data = store.get(k)
        out.setdefault(k, []).append(time.perf_counter() - t)
        assert data is not None and data.numel() > 0
print(json.dumps(out))
store.close()
"""

WRITER = r"""
import json, os, sys, time
import torch
from mmferry.store.mooncake import MooncakeStore, StoreAddress
sizes = json.loads(sys.argv[2])
store = MooncakeStore(StoreAddress.parse(sys.argv[1] + "&local_mib=128"))
for k, n in sizes.items():
    store.put(k, [torch.randint(0, 255, (n,), dtype=torch.uint8).numpy()], replace=True)
print("written", flush=True)
store.close()
"""

SEND = r"""
import json, socket, sys, time
addr, port, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
files = json.loads(sys.argv[4])
out = {}
with socket.create_connection((addr, port), timeout=30) as s:  # warm: ARP, the first connect
    s.sendall(b"x")
    s.shutdown(socket.SHUT_WR)
    s.recv(64)
for r in range(rounds):
    for name, path in files.items():
        data = open(path, "rb").read()
        t = time.perf_counter()
        with socket.create_connection((addr, port), timeout=30) as s:
            s.sendall(data)
            s.shutdown(socket.SHUT_WR)
            assert int(s.recv(64)) == len(data)
        out.setdefault(name, []).append(time.perf_counter() - t)
print(json.dumps(out))
"""


def sizes() -> dict[str, int]:
    out = {}
    for model, (factor, width, rows) in WIDTHS.items():
        for side in SIDES:
            tokens = (side // factor) ** 2
            out[f"{model}-{side}"] = tokens * width * rows * 2
    return out


def jpegs(folder: Path) -> dict[str, Path]:
    src = Image.open(ROOT / "mmferry/assets/astronaut.jpg").convert("RGB")
    out = {}
    for side in SIDES:
        path = folder / f"jpeg-{side}.jpg"
        src.resize((side, side), Image.BICUBIC).save(path, quality=90)
        out[f"jpeg-{side}"] = path
    return out


def run(rates: list[str], work: Path) -> dict:
    net = Net(["s", "e", "v"], work).start()
    try:
        store = mooncake.Store(net["s"], segment="512 MB").start(net)
        e, v = net["e"], net["v"]
        want = sizes()
        out = e.run(
            [sys.executable, "-c", WRITER, store.url, json.dumps(want)],
            timeout=300,
            env=stack.env(**mooncake.env(e)),
        )
        assert "written" in out.stdout, out.stdout + out.stderr
        files = jpegs(work)
        port = 7200
        v.popen(
            [sys.executable, str(ROOT / "tests/cluster/sink.py"), v.addr, str(port)],
            log=work / "sink.log",
        )
        time.sleep(1)
        results = {"bytes": {**want, **{k: p.stat().st_size for k, p in files.items()}}}
        for rate in rates:
            if rate != "none":
                v.shape(rate)
            try:
                times: dict[str, list[float]] = {}
                for _ in range(ROUNDS):  # interleaved: one round of each, then again
                    got = v.run(
                        [sys.executable, "-c", READER, store.url, json.dumps(list(want)), "1"],
                        timeout=600,
                        env=stack.env(**mooncake.env(v)),
                    )
                    assert got.returncode == 0, got.stderr[-2000:]
                    for k, ts in json.loads(got.stdout.strip().splitlines()[-1]).items():
                        times.setdefault(k, []).extend(ts)
                    sent = e.run(
                        [
                            sys.executable,
                            "-c",
                            SEND,
                            v.addr,
                            str(port),
                            "1",
                            json.dumps({k: str(p) for k, p in files.items()}),
                        ]
                    )
                    assert sent.returncode == 0, sent.stderr[-2000:]
                    for k, ts in json.loads(sent.stdout).items():
                        times.setdefault(k, []).extend(ts)
            finally:
                v.unshape()
            results[rate] = {
                k: {"median_s": statistics.median(ts), "min_s": min(ts), "max_s": max(ts)}
                for k, ts in times.items()
            }
            print(rate, json.dumps(results[rate]), flush=True)
        return results
    finally:
        net.stop()
        left = net.leftovers()
        assert not left, left


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rates", default="none,10gbit,1gbit")
    p.add_argument("--json", metavar="FILE")
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as d:
        res = run(a.rates.split(","), Path(d))
    print(json.dumps(res, indent=1))
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
