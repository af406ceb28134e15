"""Tiny checkpoints and one vLLM engine per family, shared by every vLLM test of a session.

The vLLM tests need vLLM's own environment (`make vllm-venv`; `make test` creates it); without
it they fail, saying how to create it: the real engine is the oracle.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

import mmferry as mf
from tests.engines.tiny_vlm import build_checkpoint
from tests.engines.vllm_harness import VLLM_PYTHON, VllmEngine

FAMILIES = ("qwen2_5_vl", "qwen3_vl")


@dataclass
class Model:
    family: str
    path: Path
    proc: mf.Processor
    enc: mf.VisionEncoder


@pytest.fixture(scope="session")
def models(tmp_path_factory) -> dict[str, Model]:
    out = {}
    for family in FAMILIES:
        path = build_checkpoint(family, tmp_path_factory.mktemp(family))
        proc = mf.Processor.from_pretrained(path)
        out[family] = Model(family, path, proc, mf.VisionEncoder.from_pretrained(path))
    return out


def needs_vllm() -> None:
    if not VLLM_PYTHON.is_file():
        pytest.fail(f"vLLM's environment is missing ({VLLM_PYTHON}); run `make vllm-venv`")


def start_engines(
    models, tmp_path_factory, name: str, *, in_process: bool = True, **options
) -> dict[str, VllmEngine]:
    """One engine per family (`options` on top of the harness's); stopped by the caller."""
    needs_vllm()
    started: dict[str, VllmEngine] = {}
    try:
        for family, m in models.items():
            work = tmp_path_factory.mktemp(f"{name}-{family}")
            opts = {k: v(work) if callable(v) else v for k, v in options.items()}
            started[family] = VllmEngine.start(m.path, work, in_process=in_process, **opts)
    except BaseException:
        for e in started.values():
            e.stop()
        raise
    return started


@pytest.fixture(scope="session")
def engines(models, tmp_path_factory) -> Iterator[dict[str, VllmEngine]]:
    """One plain engine per family that takes pixels and embeddings (`enable_mm_embeds`)."""
    started = start_engines(models, tmp_path_factory, "vllm")
    yield started
    for e in started.values():
        e.stop()
