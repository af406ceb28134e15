"""The set-ups examples/bench_proxy.py compares, each started on loopback with its own processes:

    a   plain vLLM, pixels
    b   vLLM's own encoder disaggregation: two encoder-only vLLMs (`--mm-encoder-only`,
        ec_producer), a PD vLLM (ec_consumer), ECExampleConnector through a shared folder, and
        the front of vLLM's example (mmferry/bench/_vllm_epd.py)
    c   mmferry, connector mode: two `mmferry serve` encoders, a vLLM with MmferryECConnector,
        `mmferry proxy --mode connector`
    ca  the same with `mmferry proxy --encode-ahead`: the encoders answer once the items are
        preprocessed, and vLLM reads the request while the towers run ((c) forwards a
        request once its rows are held)
    cn  the same with `mmferry proxy --name-ahead`: the proxy names each image from its header
        and sends the request to vLLM beside the encode, vLLM's connector waiting for the rows
    c'  mmferry, embeds mode: two more encoders, a vLLM without a connector, `mmferry proxy
        --mode embeds` (the rows travel through the proxy)

Each set-up keeps its own caches (no encoder or engine is shared), so every set-up sees the same
requests in the same order. `counts()` gives a set-up's encoder calls and cache hits so far;
`kill_encoder()` SIGKILLs one of its encoders with every process under it.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the tests' tiny checkpoint and process helpers

from mmferry.testing.ports import free_port  # noqa: E402
from tests.engines import tiny_vlm  # noqa: E402
from tests.proxy import procs as _procs  # noqa: E402
from tests.proxy.procs import Proc, VllmServer, encoder, proxy, scrape  # noqa: E402

# Six vLLMs starting side by side on a busy 2-core machine take longer than the tests allow one.
_procs.START_TIMEOUT_S = 1800

SETUPS = {
    "a": "plain vLLM (pixels)",
    "b": "vLLM EPD (ECExampleConnector)",
    "c": "mmferry, connector mode",
    "ca": "mmferry, connector mode, --encode-ahead",
    "cn": "mmferry, connector mode, --name-ahead",
    "c'": "mmferry, embeds mode",
}
ENCODERS = 2  # per disaggregated set-up
# The heavy checkpoint's vision tower: depth and width (hidden size; MLP 2x), chosen so that one
# 448x448 image (1024 patches) takes over 20 ms on 2 CPU cores; measured in BENCHMARKS.md.
HEAVY_VISION = {"depth": 4, "hidden_size": 128, "intermediate_size": 256, "num_heads": 2}
HEAVY_TOKENS = 256  # the image budget: 448x448 exactly, so neither side resamples


def build_model(kind: str, path: Path) -> Path:
    """The tests' tiny Qwen2.5-VL checkpoint, or ("heavy") the same with a wider, deeper tower."""
    if kind == "tiny":
        return tiny_vlm.build_checkpoint("qwen2_5_vl", path)
    return tiny_vlm.build_checkpoint(
        "qwen2_5_vl", path, vision=HEAVY_VISION, max_tokens=HEAVY_TOKENS
    )


def descendants(pid: int) -> list[int]:
    """Every process under `pid` (Linux /proc), children first."""
    out = []
    try:
        tasks = Path(f"/proc/{pid}/task").iterdir()
        kids = [int(c) for t in tasks for c in (t / "children").read_text().split()]
    except OSError:
        return out
    for kid in kids:
        out += [kid, *descendants(kid)]
    return out


def pin_tree(pid: int, cpus: set[int]) -> None:
    """Every thread of `pid` and of the processes under it on `cpus` (threads and processes
    started later inherit it from their parent)."""
    for p in [pid, *descendants(pid)]:
        with contextlib.suppress(OSError):  # gone meanwhile
            for task in os.listdir(f"/proc/{p}/task"):
                with contextlib.suppress(OSError):
                    os.sched_setaffinity(int(task), cpus)


def pin(setups: list[Setup], engine: set[int], front: set[int]) -> None:
    """Each set-up's vLLM processes on `engine`, mmferry's (the proxy, the encoders) on
    `front`: an operator with cores to spare keeps the path's own CPU off the engine's."""
    for s in setups:
        for p in s.procs:
            assert p.proc is not None
            pin_tree(p.proc.pid, engine if isinstance(p, VllmServer) else front)


def kill_tree(pid: int) -> None:
    """SIGKILL `pid` and everything under it, as a machine or container loss would."""
    for p in [pid, *descendants(pid)]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGKILL)


@dataclass
class Setup:
    key: str
    url: str
    procs: list[VllmServer | Proc]  # in start order
    encoders: list[VllmServer | Proc]
    llm: VllmServer  # the vLLM that generates
    counts: Callable[[], dict[str, float]]
    killed: list[int] = field(default_factory=list)

    @property
    def label(self) -> str:
        return SETUPS[self.key]

    def kill_encoder(self) -> None:
        victim = self.encoders[0]
        assert victim.proc is not None
        self.killed.append(victim.proc.pid)
        kill_tree(victim.proc.pid)
        victim.proc.wait()


def vllm_counts(llm: VllmServer) -> dict[str, float]:
    """vLLM's multimodal processor cache: its hits skip preprocessing, not the tower."""
    return {
        "calls": scrape(llm.url, "vllm:mm_cache_queries_total"),
        "hits": scrape(llm.url, "vllm:mm_cache_hits_total"),
    }


def mmferry_counts(front: Proc, encoders: list[Proc]) -> dict[str, float]:
    """The proxy's encoder calls; the encoders' cache hits (and joins to an item in flight),
    the items sent to vLLM as pixels."""
    out = {
        "calls": scrape(front.url, "mmferry_proxy_encoder_seconds_count"),
        "encoder_s": scrape(front.url, "mmferry_proxy_encoder_seconds_sum"),
        "fallback": scrape(front.url, "mmferry_proxy_items_fallback_total"),
    }
    alive = [e for e in encoders if e.proc is not None and e.proc.poll() is None]
    for key, name in (
        ("hits", "mmferry_cache_hits_total"),
        ("dedup", "mmferry_inflight_dedup_total"),
    ):
        out[key] = sum(scrape(e.url, name) for e in alive)
    return out


def epd_counts(front: Proc, folder: Path) -> dict[str, float]:
    """The front's encoder calls; a hit is a call whose item the shared folder already held
    (the encoder-only vLLM then skips its tower): calls less the files written."""
    calls = scrape(front.url, "epd_front_encoder_calls_total")
    written = sum(1 for _ in folder.glob("*/encoder_cache.safetensors"))
    return {
        "calls": calls,
        "written": written,
        "failed": scrape(front.url, "epd_front_encoder_failures_total"),
    }


def start(group: list[VllmServer | Proc], procs: list) -> None:
    """The processes of `group` started side by side (a vLLM takes a minute or more to start);
    each is listed in `procs` first, so a failed start is stopped too."""
    procs += group
    with ThreadPoolExecutor(len(group)) as pool:
        for f in [pool.submit(p.start) for p in group]:
            f.result()


def start_setup(key: str, model: Path, work: Path, procs: list) -> Setup:
    """Set-up `key` running; every process it starts is appended to `procs` for the caller to
    stop."""
    work.mkdir(parents=True)
    if key == "a":
        (work / "plain").mkdir()
        llm = VllmServer(model, work / "plain")
        start([llm], procs)
        return Setup(key, llm.url, [llm], [], llm, lambda: vllm_counts(llm))
    if key == "b":
        folder = work / "ec"
        folder.mkdir()
        ec = {
            "ec_connector": "ECExampleConnector",
            "ec_connector_extra_config": {"shared_storage_path": str(folder)},
        }
        producer = {**ec, "ec_role": "ec_producer"}
        only = ["--mm-encoder-only", "--no-enable-prefix-caching"]
        for name in [f"e{i}" for i in range(ENCODERS)] + ["pd"]:
            (work / name).mkdir()
        mine = [
            VllmServer(model, work / f"e{i}", ec_transfer=producer, extra=only)
            for i in range(ENCODERS)
        ]
        pd = VllmServer(model, work / "pd", ec_transfer={**ec, "ec_role": "ec_consumer"})
        start([*mine, pd], procs)
        args = [a for e in mine for a in ("--encoder", e.url)] + ["--pd", pd.url]
        front = Proc(args, module="mmferry.bench._vllm_epd")
        start([front], procs)
        counts = lambda: epd_counts(front, folder)  # noqa: E731
        return Setup(key, front.url, [*mine, pd, front], mine, pd, counts)
    mode = {"c": "connector", "ca": "connector", "cn": "connector", "c'": "embeds"}[key]
    ports = [free_port() for _ in range(ENCODERS)]
    encs = [encoder(model, port) for port in ports]
    urls = [f"http://127.0.0.1:{port}" for port in ports]
    (work / "llm").mkdir()
    llm = VllmServer(model, work / "llm", {"urls": urls} if mode == "connector" else None)
    start([*encs, llm], procs)
    flags = {"ca": ["--encode-ahead"], "cn": ["--name-ahead"]}.get(key, [])
    front = proxy(llm.url, urls, mode, *flags)
    start([front], procs)
    if key == "cn":
        names_ahead(front.url)
    counts = lambda: mmferry_counts(front, encs)  # noqa: E731
    return Setup(key, front.url, [*encs, llm, front], encs, llm, counts)


def names_ahead(url: str, timeout_s: float = 60) -> None:
    """Waits until the proxy at `url` has learnt its encoders' settings (--name-ahead)."""
    import time

    import httpx

    deadline = time.monotonic() + timeout_s
    while not httpx.get(f"{url}/health", timeout=10).json()["names_ahead"]:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the proxy at {url} never named items ahead")
        time.sleep(0.1)


def leftover_shm(setups: list[Setup]) -> list[str]:
    """/dev/shm segments of mmferry encoders SIGKILLed on purpose, removed; others named."""
    left = []
    for s in setups:
        for p in s.encoders:
            if not isinstance(p, Proc) or p.proc is None:
                continue
            for path in Path("/dev/shm").glob(f"mmferry-{p.proc.pid}-*"):
                if p.proc.pid in s.killed:
                    path.unlink(missing_ok=True)  # a crash leaves them; the run must not
                else:
                    left.append(path.name)
    return left


def config_line(model: Path) -> str:
    cfg = json.loads((model / "config.json").read_text())["vision_config"]
    return f"vision tower depth {cfg['depth']}, width {cfg['hidden_size']}"
