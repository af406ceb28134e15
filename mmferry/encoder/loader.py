"""Streams only the vision tower's tensors out of a safetensors checkpoint.

Single-file (`model.safetensors`) and sharded (`model.safetensors.index.json`) checkpoints are
read one shard at a time with `safe_open`, one tensor at a time, keeping only keys under a vision
prefix. The tower is built on `meta` and the tensors are assigned into it, so host memory peaks
near one tensor (plus the tower itself when the target is the CPU), never the checkpoint.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from mmferry.models.base import ModelSpec


def _shards(root: Path) -> dict[Path, list[str]]:
    """Shard file -> checkpoint keys in it; raises when no safetensors file exists."""
    index = root / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text()).get("weight_map")
        except (json.JSONDecodeError, AttributeError):
            weight_map = None
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index}: no `weight_map` object (key -> shard file name)")
        inside = root.resolve()
        by_file: dict[Path, list[str]] = {}
        for key, name in weight_map.items():
            shard = (root / str(name)).resolve()
            # NOTE: an index names files; a path that leaves the model folder is refused, so a
            # checkpoint cannot make the loader read arbitrary files.
            if not shard.is_relative_to(inside):
                raise ValueError(f"{index}: weight_map[{key!r}] = {name!r} is outside {root}")
            by_file.setdefault(shard, []).append(key)
        return by_file
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no model.safetensors(.index.json) in {root}")
    return {f: _keys(f) for f in files}


def _keys(path: Path) -> list[str]:
    try:
        with safe_open(str(path), framework="pt") as sf:
            return list(sf.keys())
    except Exception as e:  # safetensors raises its own error types, naming no file
        raise ValueError(f"{path}: not a readable safetensors file ({e})") from None


def _pick_prefix(keys: list[str], prefixes: tuple[str, ...]) -> str:
    for prefix in prefixes:
        if any(k.startswith(prefix) for k in keys):
            return prefix
    raise ValueError(f"checkpoint has no vision tower: no key starts with any of {prefixes}")


def _rename(key: str, renames: tuple[tuple[str, str], ...]) -> str:
    for pattern, repl in renames:
        key = re.sub(pattern, repl, key)
    return key


def iter_vision_tensors(
    model_dir: str | Path, spec: ModelSpec, *, device: torch.device, dtype: torch.dtype
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (tower key, tensor on device in dtype) for every vision tensor, one at a time.

    The spec says where the tower lives in the checkpoint (`vision_prefixes`, most specific
    first) and which keys it spells differently (`key_renames`).
    """
    root = Path(model_dir)
    shards = _shards(root)
    prefix = _pick_prefix([k for keys in shards.values() for k in keys], spec.vision_prefixes)
    for path, keys in shards.items():
        wanted = [k for k in keys if k.startswith(prefix)]
        if not wanted:
            continue  # shards holding only language-model weights are never opened
        try:
            sf = safe_open(str(path), framework="pt", device="cpu")
        except Exception as e:  # safetensors' errors name no file
            raise ValueError(f"{path}: not a readable safetensors file ({e})") from None
        with sf:
            for key in wanted:
                try:
                    tensor = sf.get_tensor(key)
                except Exception as e:
                    raise ValueError(f"{path}: cannot read {key} ({e})") from None
                if not tensor.is_floating_point():
                    raise ValueError(
                        f"{path}: {key} has dtype {tensor.dtype}; vision weights are floating point"
                    )
                yield _rename(key[len(prefix) :], spec.key_renames), tensor.to(device, dtype)


def assign_state(module: nn.Module, tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
    """Assign `tensors` into `module` (built on meta); ValueError naming missing/unexpected keys."""
    expected = set(module.state_dict().keys())
    state: dict[str, torch.Tensor] = {}
    unexpected: list[str] = []
    for key, tensor in tensors:
        if key in expected:
            state[key] = tensor
        else:
            unexpected.append(key)
    missing = sorted(expected - state.keys())
    if missing or unexpected:
        parts = []
        for label, keys in (("missing", missing), ("unexpected", sorted(unexpected))):
            if keys:
                more = f" (+{len(keys) - 8} more)" if len(keys) > 8 else ""
                parts.append(f"{label} vision keys: {', '.join(keys[:8])}{more}")
        raise ValueError(
            "checkpoint does not match the vision tower's architecture ("
            + "; ".join(parts)
            + "); check config.json's vision_config against the weights"
        )
    shapes = module.state_dict()
    for key, tensor in state.items():
        if tuple(tensor.shape) != tuple(shapes[key].shape):
            raise ValueError(
                f"vision key {key} has shape {tuple(tensor.shape)} in the checkpoint, "
                f"the config implies {tuple(shapes[key].shape)}"
            )
    module.load_state_dict(state, strict=True, assign=True)
    module.requires_grad_(False)
