"""One stack per model family for the proxy tests: vLLM's OpenAI server with the encoder-cache
connector and `--enable-mm-embeds`, three `mmferry serve` encoders, and helpers to send chat
completions. vLLM starts once per family (the tests of one family run together)."""

from __future__ import annotations

import base64
import io
import json
from collections.abc import Iterator
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

import av
import httpx
import numpy as np
import pytest
from PIL import Image

import mmferry as mf
from tests.engines.conftest import needs_vllm
from tests.engines.tiny_vlm import build_checkpoint
from tests.proxy.procs import Proc, VllmServer, encoder

FAMILIES = ("qwen2_5_vl", "qwen3_vl")
NEW_TOKENS = 8
LOGPROB_ATOL = 1e-4


@dataclass
class Stack:
    family: str
    model: Path
    factor: int
    vllm: VllmServer
    encoders: list[Proc]


def data_url(pixels: np.ndarray) -> str:
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def image_part(pixels: np.ndarray) -> dict:
    return {"type": "image_url", "image_url": {"url": data_url(pixels)}}


def mp4(frames: np.ndarray, fps: int) -> bytes:
    """[n, H, W, 3] uint8 frames as a lossless H.264 RGB MP4 at `fps` (every frame decodes to
    the very pixels given, whichever FFmpeg-based decoder reads it: vLLM's OpenCV, mmferry's
    PyAV)."""
    out = io.BytesIO()
    with av.open(out, "w", format="mp4") as container:
        stream = container.add_stream("libx264rgb", rate=fps)
        stream.width, stream.height = frames.shape[2], frames.shape[1]
        stream.pix_fmt = "rgb24"
        stream.options = {"qp": "0", "preset": "ultrafast"}
        for i, f in enumerate(frames):
            frame = av.VideoFrame.from_ndarray(f, format="rgb24")
            frame.pts, frame.time_base = i, Fraction(1, fps)
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return out.getvalue()


def video_part(frames: np.ndarray, fps: int) -> dict:
    url = "data:video/mp4;base64," + base64.b64encode(mp4(frames, fps)).decode()
    return {"type": "video_url", "video_url": {"url": url}}


def first_choice(urls: list[str], part: dict) -> str:
    """The encoder the proxy's routing ranks first for `part` among `urls`."""
    from mmferry.proxy import Router
    from mmferry.proxy.media import find_media
    from mmferry.server.limits import Limits
    from mmferry.server.sources import source_policy

    body = {"messages": [{"role": "user", "content": [part]}]}
    return Router(urls).choices(find_media(body, source_policy(Limits()))[0].key)[0]


@dataclass
class Answer:
    status: int
    tokens: list[int]
    top: list[list[tuple[int, float]]]
    text: str = ""

    def same_as(self, want: Answer) -> None:
        """The same greedy tokens, and top logprobs equal within LOGPROB_ATOL."""
        assert self.status == 200, self.text
        assert self.tokens == want.tokens
        for a, b in zip(self.top, want.top, strict=True):
            assert [t for t, _ in a] == [t for t, _ in b]
            assert max(abs(x - y) for (_, x), (_, y) in zip(a, b)) <= LOGPROB_ATOL


def _ids(steps: list[dict]) -> tuple[list[int], list[list[tuple[int, float]]]]:
    ids = lambda t: int(t.removeprefix("token_id:"))  # noqa: E731
    tokens = [ids(s["token"]) for s in steps]
    top = [[(ids(t["token"]), t["logprob"]) for t in s["top_logprobs"]] for s in steps]
    return tokens, top


def chat_body(content: list[dict], *, stream: bool = False, tokens: int = NEW_TOKENS) -> dict:
    return {
        "model": "m",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": tokens,
        "temperature": 0.0,
        "logprobs": True,
        "top_logprobs": 3,
        "return_tokens_as_token_ids": True,
        "stream": stream,
    }


def chat(
    url: str, model: Path, content: list[dict], *, stream: bool = False, client=None
) -> Answer:
    """One chat completion; a stream is read event by event and its tokens joined."""
    body = chat_body(content, stream=stream)
    body["model"] = str(model)
    http = client or httpx
    if not stream:
        r = http.post(f"{url}/v1/chat/completions", json=body, timeout=300)
        if r.status_code != 200:
            return Answer(r.status_code, [], [], r.text)
        return Answer(200, *_ids(r.json()["choices"][0]["logprobs"]["content"]))
    steps: list[dict] = []
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=300) as r:
        if r.status_code != 200:
            r.read()
            return Answer(r.status_code, [], [], r.text)
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"][0]
            steps += (choice.get("logprobs") or {}).get("content") or []
    return Answer(200, *_ids(steps))


@pytest.fixture(scope="module", params=FAMILIES)
def stack(request, tmp_path_factory) -> Iterator[Stack]:
    """vLLM (its connector over the three encoders, embeddings on) and three encoders."""
    needs_vllm()
    family = request.param
    model = build_checkpoint(family, tmp_path_factory.mktemp(family))
    encoders: list[Proc] = []
    vllm = None
    try:
        encoders = [encoder(model).start() for _ in range(3)]
        connector = {"urls": [e.url for e in encoders]}
        vllm = VllmServer(model, tmp_path_factory.mktemp(f"vllm-{family}"), connector).start()
        factor = mf.Processor.from_pretrained(model).config.factor
        yield Stack(family, model, factor, vllm, encoders)
    finally:
        if vllm is not None:
            vllm.stop()
        for e in encoders:
            e.stop()
