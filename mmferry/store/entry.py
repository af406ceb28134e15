"""Store entries: the key of an item's rows, and the bytes that hold them with a header.

An entry is one object: a fixed prefix (magic, layout version, header length), a JSON header
(key, model identity, dtype, shape, deepstack count), zero padding to 64 bytes, then the
embeddings rows and each deepstack's rows, contiguous. A reader checks every header field
against what it asked for and the object's length against the header before it trusts a byte,
so a corrupt, truncated or foreign entry is refused, never fed to a model. Pure: imports no
store client, so the service and an engine's connector read entries the same way.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from blake3 import blake3

MAGIC = b"MMFE"
VERSION = 1  # the layout version: in the key, so a new layout never reads an old entry
_PREFIX = struct.Struct("<4sII")  # magic, version, header bytes
ALIGN = 64
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class EntryError(ValueError):
    """An entry that is not the rows asked for (wrong header, length, model or layout)."""


@dataclass(frozen=True)
class ModelIdentity:
    """What makes two encoders' rows interchangeable: the checkpoint's name and a hash of the
    tower's weights (name, dtype and shape of each tensor, then its bytes) and, for the generic
    family, of the family's name."""

    name: str
    weights: str

    def __str__(self) -> str:
        return f"{self.name}@{self.weights}"

    @classmethod
    def of(cls, name: str, tower: torch.nn.Module) -> ModelIdentity:
        """A tower built in this process (the random towers)."""
        return cls(name, _weights_hash(tower.state_dict().items()))

    @classmethod
    def of_checkpoint(cls, model_dir: str | Path, family: str | None = None) -> ModelIdentity:
        """A checkpoint folder's: its name and its vision weights as stored, read one tensor
        at a time, so an encoder and an engine's connector on the same checkpoint agree
        whatever dtype or device each runs in. `family` picks the path as the loaders do
        (None or "auto": the native spec where there is one, else the generic family)."""
        from mmferry.models.generic import GENERIC, uses_generic

        cpu, name = torch.device("cpu"), Path(model_dir).resolve().name
        if uses_generic(model_dir, family):
            from mmferry.encoder.generic import iter_generic_vision_tensors

            tensors = iter_generic_vision_tensors(model_dir, device=cpu, dtype=torch.float32)
            # NOTE: the family is hashed too: transformers' rows of a checkpoint mmferry also
            # reads natively differ from the native ones in float rounding, so the two must
            # never share a key, even should both paths name the same tensors alike.
            return cls(name, _weights_hash(tensors, family=GENERIC))
        from mmferry.encoder.loader import iter_vision_tensors
        from mmferry.models import load_model_config, spec_for

        spec = spec_for(load_model_config(model_dir).model_type)
        tensors = iter_vision_tensors(model_dir, spec, device=cpu, dtype=torch.float32)
        return cls(name, _weights_hash(tensors))


def _weights_hash(tensors: Iterable[tuple[str, torch.Tensor]], family: str = "") -> str:
    """BLAKE3 over each tensor's name, dtype, shape and bytes, in name order (after `family`,
    none for the native families)."""
    each = []
    for key, t in tensors:
        t = t.detach().contiguous().cpu()
        h = blake3(f"{key}:{t.dtype}:{tuple(t.shape)};".encode(), max_threads=blake3.AUTO)
        h.update(t.reshape(-1).view(torch.uint8).numpy() if t.numel() else b"")
        each.append((key, h.digest()))
    head = f"{family};".encode() if family else b""
    return blake3(head + b"".join(d for _, d in sorted(each))).hexdigest(length=16)


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise ValueError(f"rows of dtype {name} cannot be stored (one of {tuple(_DTYPES)})")
    return name


def entry_key(item_hash: str, model: ModelIdentity, dtype: torch.dtype) -> str:
    """The store key of one item's rows: layout version, model identity, dtype, item hash."""
    # NOTE: the name is cleaned of the characters other tools treat as separators; the
    # weights hash alone tells models apart.
    name = "".join(c if c.isalnum() or c in "-_." else "_" for c in model.name)[-64:]
    return f"mmferry/v{VERSION}/{name}@{model.weights}/{dtype_name(dtype)}/{item_hash}"


def header_bytes(key: str, model: ModelIdentity, rows: list[torch.Tensor]) -> bytes:
    """The prefix, JSON header and padding that precede `rows` (embeds, then deepstack)."""
    first = rows[0]
    header = {
        "key": key,
        "model": str(model),
        "dtype": dtype_name(first.dtype),
        "shape": list(first.shape),
        "deepstack": len(rows) - 1,
    }
    text = json.dumps(header, separators=(",", ":")).encode()
    size = _PREFIX.size + len(text)
    pad = -size % ALIGN
    return _PREFIX.pack(MAGIC, VERSION, len(text) + pad) + text + b" " * pad


def entry_parts(
    key: str, model: ModelIdentity, embeds: torch.Tensor, deepstack: tuple[torch.Tensor, ...]
) -> list[Any]:
    """The buffers of one entry in order (header, then each tensor's bytes, not copied when
    contiguous on the CPU)."""
    rows = [embeds, *deepstack]
    for t in rows[1:]:
        if t.shape != embeds.shape or t.dtype != embeds.dtype:
            raise ValueError("deepstack rows must match the embeddings' shape and dtype")
    views = [t.detach().cpu().contiguous().view(torch.uint8).reshape(-1).numpy() for t in rows]
    return [header_bytes(key, model, rows), *views]


def entry_nbytes(num_tokens: int, hidden: int, deepstack: int, dtype: torch.dtype) -> int:
    """The bytes of the rows alone (an entry is its header plus these)."""
    return (1 + deepstack) * num_tokens * hidden * torch.empty((), dtype=dtype).element_size()


def read_entry(
    data: memoryview | bytes | torch.Tensor,
    *,
    key: str,
    model: ModelIdentity,
    dtype: torch.dtype,
    num_tokens: int,
    hidden: int,
    deepstack: int,
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """The rows of an entry read from the store, as views of `data` (a uint8 tensor is viewed
    in place; bytes are copied once); EntryError unless every fact matches what was asked."""
    buf = (
        data
        if isinstance(data, torch.Tensor)
        else torch.frombuffer(bytearray(data), dtype=torch.uint8)
    )
    n = buf.numel()
    if n < _PREFIX.size:
        raise EntryError(f"{n} bytes: shorter than an entry's prefix")
    magic, version, hlen = _PREFIX.unpack(bytes(buf[: _PREFIX.size].numpy()))
    if magic != MAGIC or version != VERSION:
        raise EntryError(f"not an mmferry entry of layout {VERSION}")
    start = _PREFIX.size + hlen
    if start > n or start % ALIGN:
        raise EntryError("the header runs past the entry or is not padded")
    try:
        header = json.loads(bytes(buf[_PREFIX.size : start].numpy()))
    except ValueError:
        raise EntryError("the header is not JSON") from None
    want = {
        "key": key,
        "model": str(model),
        "dtype": dtype_name(dtype),
        "shape": [num_tokens, hidden],
        "deepstack": deepstack,
    }
    if header != want:
        wrong = sorted(k for k in want if not isinstance(header, dict) or header.get(k) != want[k])
        raise EntryError(f"the header's {', '.join(wrong) or 'fields'} differ from the item's")
    body = entry_nbytes(num_tokens, hidden, deepstack, dtype)
    if n != start + body:
        raise EntryError(f"{n - start} bytes of rows, {body} expected")
    rows = buf[start:].view(dtype).view(1 + deepstack, num_tokens, hidden)
    return rows[0], tuple(rows[1:].unbind(0))
