"""SGLang's HTTP server (`python -m sglang.launch_server`, on the CPU) fed `to_sglang`'s items on
`POST /generate`: SGLang 0.5.23's request schema has no field for precomputed rows, so it
answers 400 naming the field it refuses, for both its precomputed forms, and stays up (text
requests still generate). When a release takes them, this test fails and the README's SGLang
section is to be updated."""

from __future__ import annotations

import contextlib
import os
import subprocess
import time

import httpx
import pytest

from mmferry.engines.sglang import to_sglang
from mmferry.testing.ports import free_port
from tests.engines.cases import cases, items
from tests.engines.sglang_harness import (
    SGLANG_PYTHON,
    START_TIMEOUT_S,
    ShmLeftovers,
    sglang_env,
    shm_names,
)

pytestmark = pytest.mark.slow
FAMILY = "qwen2_5_vl"


def server_command(model, port: int) -> list[str]:
    """The engine tests' options (sglang_harness.ENGINE_OPTIONS) as flags."""
    return [
        *(str(SGLANG_PYTHON), "-m", "sglang.launch_server", "--model-path", str(model)),
        *("--host", "127.0.0.1", "--port", str(port), "--device", "cpu"),
        *("--attention-backend", "torch_native", "--disable-cuda-graph"),
        *("--disable-radix-cache", "--skip-server-warmup", "--mem-fraction-static", "0.5"),
        *("--max-total-tokens", "4096", "--dtype", "float32", "--random-seed", "0"),
    ]


@pytest.fixture(scope="module")
def server(models, tmp_path_factory):
    if not SGLANG_PYTHON.is_file():
        pytest.fail(f"SGLang's environment is missing ({SGLANG_PYTHON}); run `make sglang-venv`")
    port = free_port()
    log = tmp_path_factory.mktemp("sglang-server") / "server.log"
    before = shm_names()
    with open(log, "w") as out:
        proc = subprocess.Popen(
            server_command(models[FAMILY].path, port),
            stdout=out,
            stderr=subprocess.STDOUT,
            env=sglang_env(),
            start_new_session=True,  # its scheduler and detokenizer end with it
        )
    url = f"http://127.0.0.1:{port}"
    leftovers = ShmLeftovers(proc.pid, before)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"SGLang's server did not start:\n{log.read_text()[-4000:]}")
            time.sleep(2)
        leftovers.note()
        yield url
    finally:
        leftovers.note()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, 9)
        proc.wait()
        leftovers.remove()
        # What the server made in /dev/shm goes with it (killed, it unlinks nothing itself).
        assert not leftovers.left()


def as_json(entry: dict) -> dict:
    return {k: v.tolist() if hasattr(v, "tolist") else v for k, v in entry.items()}


def test_generate_refuses_precomputed_items_and_stays_up(models, server):
    m = models[FAMILY]
    case = cases(m.proc.config.factor)["images"]
    its = items(m.proc, case)
    prompt = m.proc.expand_prompt(m.proc.tokenizer.encode(case.text), its)
    req = to_sglang(prompt, its, m.enc(its))
    (entry,) = req["image_data"]
    documented = {"format": "precomputed_embedding", "feature": entry["precomputed_embeddings"]}
    documented["image_grid_thw"] = entry["image_grid_thw"]
    params = {"temperature": 0.0, "max_new_tokens": 16, "ignore_eos": True}
    for form in (entry, documented):
        body = {"input_ids": req["input_ids"], "image_data": [as_json(form)]}
        r = httpx.post(f"{server}/generate", json={**body, "sampling_params": params}, timeout=300)
        assert r.status_code == 400, r.text[:500]
        assert "unknown field `format`" in r.json()["error"]
    assert httpx.get(f"{server}/health", timeout=30).status_code == 200
    text = {"input_ids": m.proc.tokenizer.encode("hello what ?"), "sampling_params": params}
    r = httpx.post(f"{server}/generate", json=text, timeout=300)
    assert r.status_code == 200, r.text[:500]
    assert len(r.json()["output_ids"]) == 16
