"""Benchmark: encoder rows moved to a consumer process through a Mooncake Store, against HTTP
safetensors and same-host shared memory; encoder calls a shared store saves a pool of two.

Needs the `mooncake` extra (its `mooncake_master` and `mooncake_client` run on loopback TCP) and
the `server` extra. Run: python -m mmferry.bench.store [--quick]
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from mmferry.bench.harness import Figure, Report, check_equal, interleave, main_for
from mmferry.testing.ports import free_port

ITEMS = 8
MB = 1e6


def _wait_port(port: int, proc: subprocess.Popen, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[0]} exited with {proc.returncode}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise RuntimeError(f"nothing listens on {port}")


@contextmanager
def store_on_loopback(segment: str) -> Iterator[str]:
    """A Mooncake master and a holder lending it `segment` on 127.0.0.1; yields the address."""
    from mmferry.store.mooncake import import_mooncake

    bins = Path(import_mooncake().__file__).parent  # the binaries ship inside the package
    rpc, http, metrics, holder = (free_port() for _ in range(4))
    env = {**os.environ, "MC_TCP_BIND_ADDRESS": "127.0.0.1"}
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL, "env": env}
    procs = []
    try:
        procs.append(
            subprocess.Popen(
                [
                    str(bins / "mooncake_master"),
                    f"--rpc_port={rpc}",
                    "--rpc_address=127.0.0.1",
                    "--enable_http_metadata_server=true",
                    "--http_metadata_server_host=127.0.0.1",
                    f"--http_metadata_server_port={http}",
                    f"--metrics_port={metrics}",
                    "--metrics_host=127.0.0.1",
                ],
                **quiet,
            )
        )
        _wait_port(rpc, procs[0])
        _wait_port(http, procs[0])
        meta = f"http://127.0.0.1:{http}/metadata"
        procs.append(
            subprocess.Popen(
                [
                    str(bins / "mooncake_client"),
                    "--host=127.0.0.1",
                    f"--global_segment_size={segment}",
                    f"--master_server_address=127.0.0.1:{rpc}",
                    f"--metadata_server={meta}",
                    "--protocol=tcp",
                    f"--port={holder}",
                ],
                **quiet,
            )
        )
        _wait_port(holder, procs[1])
        yield f"mooncake://127.0.0.1:{rpc}?metadata={meta}"
    finally:
        for p in reversed(procs):
            p.kill()
            p.wait()


def transfers(report: Report, url: str, rounds: int) -> None:
    """8 items of [4096, 2048] float32 from a producer process into this one, three ways."""
    import httpx
    from safetensors.torch import load

    from mmferry.bench._store_producer import keys, rows
    from mmferry.store.entry import ModelIdentity, read_entry
    from mmferry.store.mooncake import MooncakeStore, StoreAddress
    from mmferry.transport.shm import ShmHandle, open_shared

    want = rows(ITEMS)
    total = sum(t.numel() * 4 for t in want)
    env = {**os.environ, "MC_TCP_BIND_ADDRESS": "127.0.0.1"}
    producer = subprocess.Popen(
        [sys.executable, "-m", "mmferry.bench._store_producer", url, str(ITEMS)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    store = None
    try:
        line = producer.stdout.readline()
        if not line.startswith("ready "):
            raise RuntimeError(f"the producer did not start: {line!r}")
        rows_url = f"http://127.0.0.1:{int(line.split()[1])}/rows"
        store = MooncakeStore(StoreAddress.parse(url))
        model = ModelIdentity("bench", "0" * 32)
        slot = want[0].numel() * 4 + 4096
        buf = torch.empty(ITEMS * slot, dtype=torch.uint8)
        store.register(buf.data_ptr(), buf.numel())
        names = keys(ITEMS)
        client = httpx.Client(timeout=120)

        def mooncake() -> list[torch.Tensor]:
            out = []
            for i, key in enumerate(names):
                part = buf[i * slot : (i + 1) * slot]
                got = store.get_into(key, part.data_ptr(), slot)
                embeds, _ = read_entry(
                    part[:got], key=key, model=model, dtype=torch.float32,
                    num_tokens=want[i].shape[0], hidden=want[i].shape[1], deepstack=0,
                )  # fmt: skip
                out.append(embeds)
            return out

        def http() -> list[torch.Tensor]:
            got = load(client.get(rows_url).content)
            return [got[f"{i}.embeds"] for i in range(ITEMS)]

        def shm() -> list[torch.Tensor]:
            producer.stdin.write("shm\n")
            producer.stdin.flush()
            docs = json.loads(producer.stdout.readline())
            return [open_shared(ShmHandle(**{**d, "shape": tuple(d["shape"])})) for d in docs]

        for name, fn in (("mooncake", mooncake), ("http", http), ("shm", shm)):
            for i, t in enumerate(fn()):
                check_equal(f"{name} item {i}", t, want[i])

        def timed(fn):
            def run() -> float:
                t0 = time.perf_counter()
                fn()
                return time.perf_counter() - t0

            return run

        times = interleave(
            {"mooncake": timed(mooncake), "http": timed(http), "shm": timed(shm)}, rounds=rounds
        )
        rate = {k: [total / MB / t for t in v] for k, v in times.items()}
        shape = f"{ITEMS} x [4096, 2048] f32 to a consumer process"
        report.add(
            Figure(
                f"{shape}: Mooncake get_into vs HTTP",
                "HTTP safetensors",
                rate["http"],
                rate["mooncake"],
                "MB/s",
                True,
                "loopback TCP; get_into a registered buffer, header checked",
            )
        )
        report.add(
            Figure(
                f"{shape}: Mooncake get_into vs shm",
                "same-host shm",
                rate["shm"],
                rate["mooncake"],
                "MB/s",
                True,
                "shm: the producer's copy into its arena and the consumer's mapping",
            )
        )
        client.close()
        store.unregister(buf.data_ptr())
    finally:
        producer.stdin.close()
        producer.wait(timeout=60)
        if store is not None:
            store.close()


def _serve(store: str | None) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "mmferry", "serve", "--port", "0", "--depth", "1"]
    cmd += ["--max-pixels", "65536", *(["--store", store] if store else [])]
    env = {**os.environ, "MC_TCP_BIND_ADDRESS": "127.0.0.1"}
    env.pop("MMFERRY_API_KEY", None)
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    for line in proc.stdout:
        if line.startswith("mmferry serve: listening on "):
            return proc, line.split("listening on ")[1].strip()
    raise RuntimeError("mmferry serve did not start")


def encoder_calls(report: Report, url: str, items: int) -> None:
    """Two encoders, each asked for `items` images, half of them the other one's too."""
    import io

    import httpx
    import numpy as np
    from PIL import Image

    from mmferry.server.client import EncoderClient, image_part

    def png(seed: int) -> bytes:
        pixels = np.random.default_rng(seed).integers(0, 256, (64, 64, 3), dtype=np.uint8)
        buf = io.BytesIO()
        Image.fromarray(pixels).save(buf, format="PNG")
        return buf.getvalue()

    asked = [range(items), range(items // 2, items // 2 + items)]
    counts = {}
    for name, store in (("private", None), ("shared", url)):
        started = [_serve(store) for _ in range(2)]
        try:
            for (_, base), seeds in zip(started, asked):
                with EncoderClient(base) as c:
                    for s in seeds:
                        c.encode([image_part(png(s))])
                time.sleep(1.0)  # the publications after the answers
            total = 0.0
            for _, base in started:
                text = httpx.get(base + "/metrics").text
                total += float(re.search(r"^mmferry_encoded_items_total (\S+)$", text, re.M)[1])
            counts[name] = total
        finally:
            for proc, _ in started:
                proc.terminate()
                proc.wait(timeout=60)
    report.add(
        Figure.of_values(
            f"encoder calls, 2 encoders x {items} items, half repeated across them",
            "two private caches",
            counts["private"],
            counts["shared"],
            unit="calls",
            note="one Mooncake Store shared by both",
        )
    )


def run(report: Report, quick: bool) -> None:
    with store_on_loopback("1 GB") as url:
        transfers(report, url, rounds=5 if quick else 9)
        encoder_calls(report, url, items=8 if quick else 16)


def main(argv: list[str] | None = None) -> int:
    return main_for(run, argv, __doc__.splitlines()[0])


if __name__ == "__main__":
    raise SystemExit(main())
