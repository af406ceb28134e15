"""SGLang's encoder-to-language wire format, written without SGLang installed (pure).

A `--language-only` SGLang server receives each part of a request's media rows as one ZMQ
message of two frames: a pickle of its `EmbeddingData` object without the tensor, then the raw
bytes of a contiguous `[tokens, width]` tensor. It loads the pickle with an allow-list
unpickler (its `EmbeddingData`, `Modality` and torch dtypes), so the pickle is written here
opcode by opcode: importing SGLang to pickle its class would tie the service to its
environment. An error is the same object with `error_msg` and `error_code` and no tensor
frame.

These are SGLang-internal names, pinned to the release the tests run (`SGLANG_RELEASE`): the
class path, the attribute names of the object's state and the modality numbers.
"""

from __future__ import annotations

import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

SGLANG_RELEASE = "0.5.23"
# The classes the receiver's allow-list admits, at the paths it admits them.
EMBEDDING_DATA = ("sglang.srt.disaggregation.encoder.receiver", "EmbeddingData")
MODALITY = ("sglang.srt.managers.schedule_batch", "Modality")
# SGLang's `Modality` enum values (`auto()` in declaration order).
MODALITIES = {"IMAGE": 1, "VIDEO": 2, "AUDIO": 3}
# Float dtypes a part's rows may travel in (the receiver casts them to its own).
DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


@dataclass(frozen=True)
class Global:
    """A module-level name in the pickle (a class, an enum, a torch dtype)."""

    module: str
    name: str


@dataclass(frozen=True)
class Call:
    """`func(*args)` in the pickle (the enum's value lookup)."""

    func: Global
    args: tuple[Any, ...]


def modality(name: str) -> Call:
    """SGLang's `Modality[name]`, as its pickle reduces it: `Modality(value)`."""
    return Call(Global(*MODALITY), (MODALITIES[name],))


def dtype_global(dtype: torch.dtype) -> Global:
    if dtype not in DTYPES:
        raise ValueError(f"rows travel as {', '.join(DTYPES.values())}, not {dtype}")
    return Global("torch", DTYPES[dtype])


# Protocol 2 opcodes (pickletools' names), the few this format needs.
_PROTO2 = b"\x80\x02"
_GLOBAL, _REDUCE, _NEWOBJ, _BUILD, _STOP = b"c", b"R", b"\x81", b"b", b"."
_MARK, _TUPLE, _EMPTY_TUPLE = b"(", b"t", b")"
_EMPTY_LIST, _APPENDS, _EMPTY_DICT, _SETITEMS = b"]", b"e", b"}", b"u"
_NONE, _TRUE, _FALSE = b"N", b"\x88", b"\x89"
_BININT, _LONG1, _BINFLOAT, _BINUNICODE = b"J", b"\x8a", b"G", b"X"


def _write(value: Any, out: list[bytes]) -> None:
    """One value's opcodes (no memo: the state holds no shared references)."""
    if value is None:
        out.append(_NONE)
    elif isinstance(value, bool):
        out.append(_TRUE if value else _FALSE)
    elif isinstance(value, int):
        if -(2**31) <= value < 2**31:
            out.append(_BININT + struct.pack("<i", value))
        else:
            raw = value.to_bytes((value.bit_length() + 8) // 8, "little", signed=True)
            out.append(_LONG1 + bytes([len(raw)]) + raw)
    elif isinstance(value, float):
        out.append(_BINFLOAT + struct.pack(">d", value))
    elif isinstance(value, str):
        raw = value.encode("utf-8", "surrogatepass")
        out.append(_BINUNICODE + struct.pack("<I", len(raw)) + raw)
    elif isinstance(value, Global):
        out.append(_GLOBAL + f"{value.module}\n{value.name}\n".encode("ascii"))
    elif isinstance(value, Call):
        _write(value.func, out)
        _write(tuple(value.args), out)
        out.append(_REDUCE)
    elif isinstance(value, tuple):
        out.append(_MARK)
        for v in value:
            _write(v, out)
        out.append(_TUPLE)
    elif isinstance(value, list):
        out.append(_EMPTY_LIST)
        if value:
            out.append(_MARK)
            for v in value:
                _write(v, out)
            out.append(_APPENDS)
    elif isinstance(value, dict):
        out.append(_EMPTY_DICT)
        if value:
            out.append(_MARK)
            for k, v in value.items():
                _write(k, out)
                _write(v, out)
            out.append(_SETITEMS)
    else:
        raise TypeError(f"no pickle form for a {type(value).__name__}")


def dumps_object(cls: Global, state: dict[str, Any]) -> bytes:
    """The pickle of an instance of `cls` whose `__dict__` is `state` (what `pickle.dumps`
    writes for a plain object: `cls.__new__(cls)`, then the state set)."""
    out = [_PROTO2]
    _write(cls, out)
    out += [_EMPTY_TUPLE, _NEWOBJ]
    _write(state, out)
    out += [_BUILD, _STOP]
    return b"".join(out)


@dataclass(frozen=True)
class Part:
    """Which part of which request: SGLang's `/encode` fields that the answer echoes."""

    req_id: str
    num_parts: int
    part_idx: int
    modality: str  # IMAGE, VIDEO or AUDIO


def _state(part: Part, **fields: Any) -> dict[str, Any]:
    # The attributes of SGLang's EmbeddingData as its `copy_without_embedding` leaves them.
    state = {
        "req_id": part.req_id,
        "num_parts": part.num_parts,
        "part_idx": part.part_idx,
        "grid_dim": None,
        "modality": modality(part.modality),
        "embedding": None,
        "send_time": time.time(),
        "dtype": None,
        "shape": None,
        "error_msg": None,
        "error_code": None,
        "_mr_ptr": None,  # its Mooncake memory region: none for ZMQ
    }
    state.update(fields)
    return state


def rows_message(
    part: Part,
    rows: torch.Tensor,
    grids: Sequence[Sequence[int]],
    *,
    video_timestamps: Sequence[Sequence[float]] | None = None,
    second_per_grid_ts: Sequence[float] | None = None,
) -> tuple[bytes, memoryview]:
    """The two frames of one part: the pickled state and `rows`' bytes (a view that keeps
    `rows` alive; contiguous `[tokens, width]`)."""
    if rows.dim() != 2:
        raise ValueError(f"rows must be [tokens, width], got shape {tuple(rows.shape)}")
    rows = rows.detach().to("cpu").contiguous()
    extra: dict[str, Any] = {}
    if video_timestamps is not None:
        extra["video_timestamps"] = [[float(t) for t in ts] for ts in video_timestamps]
    if second_per_grid_ts is not None:
        extra["second_per_grid_ts"] = [float(s) for s in second_per_grid_ts]
    state = _state(
        part,
        grid_dim=[[int(x) for x in g] for g in grids],
        dtype=dtype_global(rows.dtype),
        shape=[int(rows.shape[0]), int(rows.shape[1])],
        **extra,
    )
    head = dumps_object(Global(*EMBEDDING_DATA), state)
    # NOTE: bytes through a uint8 view: numpy has no bfloat16.
    return head, memoryview(rows.view(torch.uint8).numpy()).cast("B")


def error_message(part: Part, message: str, code: int) -> bytes:
    """The one frame of a part that failed: the receiver fails the request with it."""
    state = _state(part, error_msg=message, error_code=int(code))
    return dumps_object(Global(*EMBEDDING_DATA), state)
