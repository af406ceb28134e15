"""SGLang's encode/language disaggregation on the CPU for the tests and the benchmark: stock
`sglang.launch_server` processes (`--encoder-only`, `--language-only`) in SGLang's environment,
`mmferry serve` encoders sharing a Mooncake Store, and the language server's own registry of
encoders (its bootstrap port) to swap which encoders it sends to without a restart."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from PIL import Image

from mmferry.testing.ports import free_port
from tests.engines.sglang_harness import (
    SGLANG_PYTHON,
    START_TIMEOUT_S,
    ShmLeftovers,
    sglang_env,
    shm_names,
)
from tests.engines.tiny_vlm import VIDEO_FPS
from tests.store import cluster

BACKENDS = ("zmq_to_tokenizer", "zmq_to_scheduler")
IMAGE_TOKEN = "<|vision_start|><|image_pad|><|vision_end|>"
VIDEO_TOKEN = "<|vision_start|><|video_pad|><|vision_end|>"
# The engine tests' CPU options (sglang_harness.ENGINE_OPTIONS) as flags.
CPU_FLAGS = [
    *("--device", "cpu", "--attention-backend", "torch_native", "--disable-cuda-graph"),
    *("--disable-radix-cache", "--skip-server-warmup", "--mem-fraction-static", "0.5"),
    *("--max-total-tokens", "4096", "--dtype", "float32", "--random-seed", "0"),
]


def ffmpeg_env(folder: Path) -> dict[str, str]:
    """What SGLang's video path needs here: it decodes with torchcodec, which loads FFmpeg's
    shared libraries by their plain names, and this machine has none; PyAV's wheel (mmferry's
    `video` extra) carries FFmpeg's under hashed names, linked in `folder` by the plain ones."""
    import av

    libs = Path(av.__file__).resolve().parent.parent / "av.libs"
    folder.mkdir(parents=True, exist_ok=True)
    for lib in libs.glob("lib*.so.*"):
        m = re.match(r"(lib(?:av|sw)[a-z]+)-[0-9a-f]+\.so\.(\d+)\.", lib.name)
        link = folder / f"{m.group(1)}.so.{m.group(2)}" if m else None
        if link is not None and not link.is_symlink():
            # NOTE: a family's servers start side by side and link the same folder.
            with contextlib.suppress(FileExistsError):
                link.symlink_to(lib)
    return {"LD_LIBRARY_PATH": f"{folder}:{libs}"}


@dataclass
class SglangServer:
    """One `sglang.launch_server` process group, its log in a file; `stop` removes what the
    group made in /dev/shm (its load-report file and semaphores: killed, it unlinks none)."""

    proc: subprocess.Popen
    url: str
    log: Path
    shm: ShmLeftovers

    @classmethod
    def start(cls, model: Path, log: Path, *flags: str, port: int | None = None) -> SglangServer:
        port = port or free_port()
        cmd = [str(SGLANG_PYTHON), "-m", "sglang.launch_server", "--model-path", str(model)]
        cmd += ["--host", "127.0.0.1", "--port", str(port), *CPU_FLAGS, *flags]
        before = shm_names()
        with open(log, "w") as out:
            proc = subprocess.Popen(
                cmd,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=sglang_env(**ffmpeg_env(log.parent / "ffmpeg")),
                start_new_session=True,  # its scheduler and detokenizer end with it
            )
        server = cls(proc, f"http://127.0.0.1:{port}", log, ShmLeftovers(proc.pid, before))
        try:
            server.wait_healthy()
        except BaseException:
            server.stop()
            raise
        server.shm.note()
        return server

    def wait_healthy(self, timeout: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                    return
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"SGLang did not start:\n{self.tail()}")
            time.sleep(1)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def tail(self, n: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-n:]

    def stop(self) -> None:
        self.shm.note()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, 9)
        self.proc.wait()
        self.shm.remove()

    def left(self) -> set[str]:
        """What the group made in /dev/shm that is still there (nothing once stopped)."""
        return self.shm.made & shm_names()


@dataclass
class LanguageServer(SglangServer):
    """A `--language-only` server; `use(urls)` makes `urls` its encoders (its bootstrap
    registry: register the new, unregister the others)."""

    bootstrap: str = ""
    encoders: list[str] = field(default_factory=list)

    @classmethod
    def launch(cls, model: Path, log: Path, backend: str, encoders: list[str]) -> LanguageServer:
        boot = free_port()
        flags = ["--language-only", "--encoder-transfer-backend", backend]
        flags += ["--encoder-bootstrap-port", str(boot), "--encoder-urls", *encoders]
        server = cls.start(model, log, *flags)
        lang = cls(server.proc, server.url, server.log, server.shm)
        lang.bootstrap, lang.encoders = f"http://127.0.0.1:{boot}", list(encoders)
        return lang

    def use(self, urls: list[str]) -> None:
        for url in urls:
            r = httpx.post(f"{self.bootstrap}/register_encoder_url", json={"url": url}, timeout=30)
            r.raise_for_status()
        for url in self.encoders:
            if url not in urls:
                r = httpx.request(
                    "DELETE", f"{self.bootstrap}/unregister_encoder_url", json={"url": url}
                )
                r.raise_for_status()
        listed = httpx.get(f"{self.bootstrap}/list_encoder_urls", timeout=30).json()
        assert sorted(listed["encoder_urls"]) == sorted(urls), listed
        self.encoders = list(urls)

    def generate(self, text: str, media: dict[str, list[str]], **extra: Any) -> httpx.Response:
        body = {
            "text": text,
            **{f"{k}_data": v for k, v in media.items()},
            "sampling_params": {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True},
            "return_logprob": True,
            "top_logprobs_num": 5,
            **extra,
        }
        return httpx.post(f"{self.url}/generate", json=body, timeout=600)


# The same weights in float32 on both sides; the towers' kernels differ, so their logprobs
# agree to float32 rounding carried through two layers, not bit for bit.
LOGPROB_TOL = 1e-4


def close(a: tuple, b: tuple) -> None:
    """Two `answer`s alike: the same greedy tokens and top tokens, logprobs within the bound."""
    tokens_a, top_a = a
    tokens_b, top_b = b
    assert tokens_a == tokens_b
    for step_a, step_b in zip(top_a, top_b, strict=True):
        assert [t for t, _ in step_a] == [t for t, _ in step_b]
        for (_, la), (_, lb) in zip(step_a, step_b):
            assert abs(la - lb) <= LOGPROB_TOL, (step_a, step_b)


def answer(r: httpx.Response) -> tuple[list[int], list[list[tuple[int, float]]]]:
    """(greedy token ids, each step's top logprobs as (id, logprob)) of a /generate answer."""
    assert r.status_code == 200, r.text[:2000]
    meta = r.json()["meta_info"]
    tokens = [t[1] for t in meta["output_token_logprobs"]]
    top = [[(e[1], e[0]) for e in step] for step in meta["output_top_logprobs"]]
    return tokens, top


def metric(url: str, name: str, labels: str = "") -> float:
    """The sum of a counter's samples (those whose labels hold `labels`) on `url`/metrics."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    pat = re.compile(rf"^{name}(_total)?(\{{[^}}]*{labels}[^}}]*\}})? (\S+)$", re.M)
    return sum(float(m.group(3)) for m in pat.finditer(text))


def start_encoders(
    model: Path, store: str, media: Path, n: int = 2, ports: list[int] | None = None
) -> list[cluster.Service]:
    """`n` `mmferry serve` encoders of `model` sharing `store`, reading files under `media`."""
    started: list[cluster.Service] = []
    try:
        for k in range(n):
            args = ["--model", str(model), "--store", store, "--allow-path", str(media)]
            args += ["--shm-mib", "0"]
            if ports:
                args += ["--port", str(ports[k])]
            started.append(cluster.start_service(args))
    except BaseException:
        for s in started:
            s.stop()
        raise
    return started


def write_png(path: Path, pixels: np.ndarray) -> str:
    Image.fromarray(pixels).save(path)
    return str(path)


def write_video(path: Path, frames: np.ndarray) -> str:
    """A lossless clip (PNG frames in QuickTime at VIDEO_FPS), so every decoder reads back the
    same RGB pixels."""
    import av

    assert len(frames) % 2 == 0, "whole temporal patches"
    with av.open(str(path), "w") as out:
        stream = out.add_stream("png", rate=int(VIDEO_FPS))
        stream.height, stream.width = frames.shape[1:3]
        stream.pix_fmt = "rgb24"
        for f in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(f, format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return str(path)
