"""Neither engine is imported with mmferry; the vLLM connector names what to install."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest


def test_adapters_import_no_engine():
    code = (
        "import sys, mmferry, mmferry.engines.vllm, mmferry.engines.sglang;"
        "print(sorted(m for m in ('vllm', 'sglang') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed")
def test_connector_without_vllm_names_the_package():
    with pytest.raises(ImportError, match="pip install vllm"):
        import mmferry.engines.vllm_connector  # noqa: F401
