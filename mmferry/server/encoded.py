"""`EncodedItem`: one item's encoder output as the service and `mmferry encode` hand it out.

Both write the same safetensors layout: tensors `{i}.embeds` and `{i}.deepstack.{k}`, and the
per-item facts (modality, grid, token count, hash, source) as JSON in the file's metadata.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch

FORMAT = "mmferry-encoded/1"


@dataclass(frozen=True)
class EncodedItem:
    """Vision embeddings [tokens, hidden] and deepstack rows of one image or video."""

    modality: str
    embeds: torch.Tensor
    deepstack: tuple[torch.Tensor, ...]
    # None for an item of the generic family whose processor gives no grid (Gemma 3).
    grid_thw: tuple[int, int, int] | None
    num_tokens: int
    hash: str
    source: str = ""

    def __post_init__(self) -> None:
        if self.embeds.dim() != 2 or self.embeds.shape[0] != self.num_tokens:
            raise ValueError(
                f"embeds of shape {tuple(self.embeds.shape)} do not hold {self.num_tokens} rows"
            )
        for k, d in enumerate(self.deepstack):
            if d.shape != self.embeds.shape:
                raise ValueError(
                    f"deepstack {k} has shape {tuple(d.shape)}, embeds {tuple(self.embeds.shape)}"
                )

    @classmethod
    def of(
        cls, item: Any, out: Any, *, source: str = "", dtype: torch.dtype | None = None
    ) -> EncodedItem:
        """A `MultimodalItem`'s encoder output (a `VisionOutput`), cast to `dtype` if given."""
        cast = (lambda t: t) if dtype is None else (lambda t: t.to(dtype))  # noqa: E731
        return cls(
            item.modality,
            cast(out.embeds),
            tuple(cast(d) for d in out.deepstack),
            item.grid_thw,
            item.num_tokens,
            item.hash,
            source,
        )

    def vision_output(self) -> Any:
        """The same rows as a `VisionOutput`, for the encoder cache and the merge step."""
        from mmferry.encoder.model import VisionOutput

        return VisionOutput(self.embeds, self.deepstack)

    def precomputed(self) -> Any:
        """This item as a `Precomputed` stand-in for `prefill_step` (no re-encode)."""
        from mmferry.embed.step import Precomputed

        return Precomputed(self.modality, self.vision_output())

    def facts(self) -> dict[str, Any]:
        """Everything but the tensors, as JSON-ready values."""
        return {
            "modality": self.modality,
            "grid_thw": None if self.grid_thw is None else list(self.grid_thw),
            "num_tokens": self.num_tokens,
            "hash": self.hash,
            "source": self.source,
            "deepstack": len(self.deepstack),
        }


def _tensors(items: Sequence[EncodedItem]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for i, it in enumerate(items):
        # NOTE: safetensors refuses tensors that share storage (row views of one batch output,
        # a repeated item), so each is made its own; owned tensors pass through untouched.
        out[f"{i}.embeds"] = _owned(it.embeds, seen)
        for k, d in enumerate(it.deepstack):
            out[f"{i}.deepstack.{k}"] = _owned(d, seen)
    return out


def _owned(t: torch.Tensor, seen: set[int]) -> torch.Tensor:
    t = t.detach().cpu()
    storage = t.untyped_storage()
    whole = t.is_contiguous() and storage.nbytes() == t.numel() * t.element_size()
    if not whole or t.storage_offset() or storage.data_ptr() in seen:
        t = t.clone()
    seen.add(t.untyped_storage().data_ptr())
    return t


def _metadata(items: Sequence[EncodedItem]) -> dict[str, str]:
    return {"format": FORMAT, "items": json.dumps([it.facts() for it in items])}


def to_bytes(items: Sequence[EncodedItem]) -> bytes:
    """One safetensors blob holding every item."""
    from safetensors.torch import save

    return save(_tensors(items), metadata=_metadata(items))


# torch dtype -> the safetensors name of it (encoder outputs are floating point).
_SAFETENSORS_DTYPES = {
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float64: "F64",
}


def write(items: Sequence[EncodedItem], f: BinaryIO) -> None:
    """Write every item to the open binary file `f` as safetensors, one tensor at a time."""
    # NOTE: written here rather than by safetensors' save_file, which builds the file under a
    # name of its own (mode 0600, never synced) and renames it over the path: the caller could
    # then neither sync nor remove what it writes. The layout is safetensors': a little-endian
    # u64 header length, the JSON header padded with spaces to 8 bytes, the tensors' bytes in
    # header order. The whole file is never held in memory.
    tensors = _tensors(items)
    header: dict[str, Any] = {"__metadata__": _metadata(items)}
    offset = 0
    for name, t in tensors.items():
        if t.dtype not in _SAFETENSORS_DTYPES:
            raise ValueError(f"{name} has dtype {t.dtype}; safetensors output takes floats")
        nbytes = t.numel() * t.element_size()
        header[name] = {
            "dtype": _SAFETENSORS_DTYPES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    f.write(struct.pack("<Q", len(raw)) + raw)
    for t in tensors.values():
        f.write(t.contiguous().reshape(-1).view(torch.uint8).numpy().data)


def save_file(items: Sequence[EncodedItem], path: str | Path) -> None:
    """Write every item to `path` as safetensors (the caller makes it atomic)."""
    with open(path, "wb") as f:
        write(items, f)


def _build(tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> list[EncodedItem]:
    if meta.get("format") != FORMAT:
        raise ValueError(f"not an mmferry encoded file (format {meta.get('format')!r})")
    items = []
    for i, f in enumerate(json.loads(meta["items"])):
        items.append(
            EncodedItem(
                modality=f["modality"],
                embeds=tensors[f"{i}.embeds"],
                deepstack=tuple(tensors[f"{i}.deepstack.{k}"] for k in range(f["deepstack"])),
                grid_thw=None if f["grid_thw"] is None else tuple(f["grid_thw"]),
                num_tokens=f["num_tokens"],
                hash=f["hash"],
                source=f.get("source", ""),
            )
        )
    return items


def from_bytes(data: bytes) -> list[EncodedItem]:
    """The items of a blob written by `to_bytes`."""
    from safetensors.torch import load

    if len(data) < 8:
        raise ValueError("truncated safetensors blob")
    (header_len,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + header_len])
    return _build(load(data), header.get("__metadata__") or {})


def load_file(path: str | Path) -> list[EncodedItem]:
    """The items of a file written by `save_file` (or `mmferry encode`)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open has no iter
    return _build(tensors, meta)
