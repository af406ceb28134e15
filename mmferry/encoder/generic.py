"""`GenericVisionEncoder`: a transformers model's own vision path with only its vision weights.

The model is built on `meta` from the checkpoint's config. Everything outside its language
model and output head (the vision tower and projector) is given real storage; checkpoint
tensors are renamed by transformers' own conversion rules and streamed in one at a time; the
language model stays on `meta` and is never read. `enc(items)` runs `get_image_features` once
for every batch of items whose tensors stack, and returns one `VisionOutput` per item.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from mmferry.encoder.loader import _shards
from mmferry.encoder.output import VisionOutput
from mmferry.models.generic import GenericItem, _transformers, hf_config


def _language_prefixes(model: nn.Module) -> tuple[str, ...]:
    """Key prefixes of the language model and the output head: what is never loaded."""
    heads = (model.get_decoder(), model.get_output_embeddings())
    names = {m: n for n, m in model.named_modules() if any(m is h for h in heads)}
    return tuple(n + "." for n in names.values() if n)


def _place(model: nn.Module, key: str, value: torch.Tensor) -> None:
    owner, _, name = key.rpartition(".")
    module = model.get_submodule(owner)
    if name in module._parameters:
        module._parameters[name] = nn.Parameter(value, requires_grad=False)
    else:
        module._buffers[name] = value


def _renamer(model: nn.Module):
    """A checkpoint key -> the model's key, by transformers' own loading rules."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightRenaming, rename_source_key

    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if not isinstance(t, WeightRenaming)]
    meta = model.state_dict()

    def rename(key: str) -> tuple[str, bool]:
        new, converted = rename_source_key(
            key, renamings, converters, model.base_model_prefix, meta
        )
        return new, converted is not None

    return rename


def _vision_tensors(
    root: Path, model: nn.Module, wanted: set[str], device: torch.device, dtype: torch.dtype
) -> Iterator[tuple[str, torch.Tensor]]:
    rename = _renamer(model)
    for shard, keys in _shards(root).items():
        with safe_open(str(shard), framework="pt") as sf:
            for key in keys:
                name, converted = rename(key)
                if name not in wanted:
                    continue
                if converted:
                    # NOTE: a converter merges or splits tensors across keys; streaming one
                    # tensor at a time cannot apply it, so such a tower is refused, not guessed.
                    raise ValueError(
                        f"{shard.name}: {key} needs transformers' weight conversion; "
                        "the generic family streams vision tensors as saved"
                    )
                t = sf.get_tensor(key)
                yield name, t.to(device=device, dtype=dtype if t.is_floating_point() else t.dtype)


def _skeleton(
    tf: Any, root: Path, attention: str = "sdpa"
) -> tuple[nn.Module, tuple[str, ...], set[str]]:
    """The checkpoint's model on `meta`, its language model's key prefixes, and the keys of
    what the generic family loads (everything else)."""
    config = hf_config(tf, root)
    config._attn_implementation = attention
    with torch.device("meta"):
        try:
            model = tf.AutoModelForImageTextToText.from_config(config)
        except ValueError:  # no image-text model class for this config
            raise ValueError(
                f"{root}: transformers has no image-text model for model_type "
                f"{config.model_type!r}, so the generic family cannot serve it"
            ) from None
    skip = _language_prefixes(model)
    wanted = {k for k in model.state_dict() if not k.startswith(skip)}
    if not wanted:
        raise ValueError(f"{root}: {type(model).__name__} has no vision weights")
    return model, skip, wanted


def iter_generic_vision_tensors(
    model_dir: str | Path, *, device: torch.device, dtype: torch.dtype
) -> Iterator[tuple[str, torch.Tensor]]:
    """(model key, tensor) for every checkpoint tensor the generic encoder loads, one at a
    time (what its store identity hashes)."""
    root = Path(model_dir)
    model, _, wanted = _skeleton(_transformers(), root)
    yield from _vision_tensors(root, model, wanted, device, dtype)


class GenericVisionEncoder:
    """`VisionEncoder` for any checkpoint transformers serves: its `get_image_features`."""

    moves_own_inputs = True
    accepted_layouts = ("hf",)
    # `get_image_features` rows carry no deepstack levels (what a store entry's header says).
    num_deepstack = 0

    def __init__(self, model: nn.Module, *, device: torch.device, dtype: torch.dtype) -> None:
        self.model = model.eval()
        self.device = device
        self.dtype = dtype
        self.config = model.config
        params = inspect.signature(model.get_image_features).parameters
        self._takes = {n for n, p in params.items() if p.kind is p.POSITIONAL_OR_KEYWORD}
        # NOTE: arguments the model's forward fills from its config when left out (InternVL's
        # `vision_feature_layer`, ...) are filled the same way here.
        self._from_config = {
            n: getattr(model.config, n) for n in self._takes if hasattr(model.config, n)
        }

    @classmethod
    def from_pretrained(
        cls,
        model_dir: str | Path,
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        attention: str = "sdpa",
    ) -> GenericVisionEncoder:
        """Build the checkpoint's model on `meta` and load only its vision tensors."""
        tf = _transformers()
        root = Path(model_dir)
        device = torch.device(device)
        model, skip, wanted = _skeleton(tf, root, attention)
        # Real (empty) storage for the vision part first; then the modules that own buffers
        # the checkpoint does not hold (rotary tables, position ids) compute them as
        # transformers does at load; then the checkpoint's tensors replace the parameters.
        for key, t in [*model.named_parameters(), *model.named_buffers()]:
            if not key.startswith(skip):
                kind = dtype if t.is_floating_point() and key in wanted else t.dtype
                _place(model, key, torch.empty(t.shape, device=device, dtype=kind))
        owners = [(n, m) for n, m in model.named_modules() if isinstance(m, tf.PreTrainedModel)]
        for name, module in model.named_modules():
            if not module._non_persistent_buffers_set or (name + ".").startswith(skip):
                continue
            # The innermost pretrained model knows its modules' buffers (a SigLIP tower inside
            # Gemma 3 has its own `_init_weights`). NOTE: this may also initialise the module's
            # parameters; every one is overwritten below (a missing one is an error).
            _, owner = max(
                ((n, m) for n, m in owners if not n or name == n or name.startswith(n + ".")),
                key=lambda nm: len(nm[0]),
            )
            owner._init_weights(module)
        loaded = set()
        with torch.no_grad():
            for key, tensor in _vision_tensors(root, model, wanted, device, dtype):
                _place(model, key, tensor)
                loaded.add(key)
        missing = sorted(wanted - loaded)
        if missing:
            shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
            raise ValueError(f"{root}: the checkpoint lacks {len(missing)} vision tensors: {shown}")
        return cls(model, device=device, dtype=dtype)

    @property
    def out_hidden_size(self) -> int:
        return int(self.config.get_text_config().hidden_size)

    def __repr__(self) -> str:
        return (
            f"GenericVisionEncoder({self.config.model_type}, out_hidden={self.out_hidden_size}, "
            f"device={self.device}, dtype={self.dtype})"
        )

    def _features(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """One `get_image_features` call; its rows as `[tokens, width]`."""
        kwargs: dict[str, Any] = {**self._from_config}
        for k, v in inputs.items():
            if k in self._takes:
                # Pixels on the tower's device and dtype; grids and counts stay integers.
                kind = self.dtype if v.is_floating_point() else v.dtype
                kwargs[k] = v.to(self.device, kind, non_blocking=True)
        with torch.inference_mode():
            out = self.model.get_image_features(**kwargs)
        rows = getattr(out, "pooler_output", out)
        if isinstance(rows, (tuple, list)):
            rows = torch.cat([r.reshape(-1, r.shape[-1]) for r in rows])
        return rows.reshape(-1, rows.shape[-1])

    def __call__(self, items: Sequence[GenericItem]) -> list[VisionOutput]:
        """Encode items in as few calls as their tensors allow; outputs in input order."""
        if not items:
            return []
        for i, item in enumerate(items):
            if not isinstance(item, GenericItem):
                raise ValueError(f"item {i} is not from the generic processor of this model")
        out: list[VisionOutput | None] = [None] * len(items)
        for group in _stackable(items):
            keys = items[group[0]].inputs.keys()
            batch = {k: torch.cat([items[i].inputs[k] for i in group]) for k in keys}
            rows = self._features(batch)
            sizes = [items[i].num_tokens for i in group]
            if rows.shape[0] != sum(sizes):
                raise ValueError(
                    f"the vision path gave {rows.shape[0]} rows for {sum(sizes)} prompt tokens"
                )
            for i, r in zip(group, rows.split(sizes), strict=True):
                out[i] = VisionOutput(r)
        return out  # type: ignore[return-value]


def _stackable(items: Sequence[GenericItem]) -> list[list[int]]:
    """Groups of items whose tensors have the same keys and trailing shapes (one call each)."""
    groups: dict[tuple, list[int]] = {}
    for i, item in enumerate(items):
        sig = tuple(sorted((k, tuple(v.shape[1:]), v.dtype) for k, v in item.inputs.items()))
        groups.setdefault(sig, []).append(i)
    return list(groups.values())
