"""Test-only stand-in for `sgl_kernel`, put first on PYTHONPATH by the SGLang engine tests.

SGLang 0.5.23 runs its engine on a CPU with `SGLANG_USE_CPU_ENGINE=1`, but the registry's
`sglang-kernel` wheel is a CUDA build: importing it needs `libcuda.so.1`. Some SGLang modules
touch CPU kernels of that package at import time, for example
`from sgl_kernel import copy_all_layer_kv_cache_cpu` (`kernels/ops/kvcache/cache_move.py`) or
`torch.ops.sgl_kernel.fused_sigmoid_mul_cpu` (`models/qwen3_5.py`), although the tiny Qwen-VL
models of the tests never call them: the `torch_native` attention backend, plain torch layers
and SGLang's own scheduler and multimodal code do the work.

What this stubs: every name of `sgl_kernel` and of any `sgl_kernel.<submodule>`, and every
`torch.ops.sgl_kernel.<name>_cpu` op, is a function that raises `NotImplementedError` naming
itself when called, so a test that reaches a real kernel fails loudly instead of computing
something else.
One submodule is the real file: `sgl_kernel.scalar_type`, plain Python (dataclasses) that
quantization tables read at import.

What it leaves absent: every other op of `torch.ops.sgl_kernel`, and the six op names SGLang
probes with `hasattr` to pick a code path (`convert_weight_packed` would switch on its AMX
weight packing, the others fused norms, GDN attention, shared-memory collectives and host
pointers; two of them end in `_cpu`); for those `hasattr` stays False, as with no kernel
library at all (SGLang's `register_fake_if_exists` also probes CUDA op names that way).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from pathlib import Path

import torch

__version__ = "0.0.0+mmferry-test-shim"

# Probed with hasattr(torch.ops.sgl_kernel, name): must stay absent.
PROBED = frozenset(
    {
        "convert_weight_packed",
        "fused_qk_norm_cpu",
        "fused_qk_norm_rope_cpu",
        "gdn_attention",
        "get_device_accessible_ptr",
        "shm_group_initialize",
    }
)


def _stub(qualname: str):
    def call(*args, **kwargs):
        raise NotImplementedError(
            f"{qualname} is stubbed by the mmferry test shim (no CPU build of sgl_kernel)"
        )

    call.__name__ = call.__qualname__ = qualname.rsplit(".", 1)[-1]
    return call


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    return _stub(f"sgl_kernel.{name}")


class _StubModule(types.ModuleType):
    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _stub(f"{self.__name__}.{name}")


# Pure-Python submodules of the real package, loaded from its files.
REAL = ("scalar_type",)


def _real_file(name: str) -> Path | None:
    for entry in sys.path:
        path = Path(entry or ".") / "sgl_kernel" / f"{name}.py"
        if path.is_file() and path.parent != Path(__file__).parent:
            return path
    return None


class _Submodules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """`sgl_kernel.x.y` imports as a module of raising stubs (REAL ones from their files)."""

    def find_spec(self, fullname, path=None, target=None):
        if not fullname.startswith("sgl_kernel."):
            return None
        name = fullname.split(".", 1)[1]
        real = _real_file(name) if name in REAL else None
        if real is not None:
            return importlib.util.spec_from_file_location(fullname, real)
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec):
        module = _StubModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module) -> None:
        pass


class _Ops:
    """`torch.ops.sgl_kernel`: raising stubs for the CPU ops, the probed names absent."""

    def __getattr__(self, name: str):
        if not name.endswith("_cpu") or name in PROBED:
            raise AttributeError(name)
        return _stub(f"torch.ops.sgl_kernel.{name}")


sys.meta_path.insert(0, _Submodules())
torch.ops.sgl_kernel = _Ops()
