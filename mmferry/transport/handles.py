"""Checks every field of a handle received from another process, before anything is mapped."""

from __future__ import annotations

import math

import torch

# Every dtype a feature can have; a handle naming anything else is refused.
DTYPES: dict[str, torch.dtype] = {
    str(d): d
    for d in (
        torch.float64,
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
        torch.complex64,
        torch.complex128,
    )
}
MAX_DIMS = 16
MAX_DIM = 1 << 48


def dtype_of(name: object) -> torch.dtype:
    """The torch dtype a handle names, or ValueError."""
    dtype = DTYPES.get(name) if isinstance(name, str) else None
    if dtype is None:
        raise ValueError(f"unknown dtype {name!r} in handle")
    return dtype


def is_int(v: object) -> bool:
    return type(v) is int


def check_layout(shape: object, dtype: object, nbytes: object) -> torch.dtype:
    """The dtype, once `shape` is a tuple of ints >= 0 whose size in `dtype` is `nbytes`."""
    dt = dtype_of(dtype)
    if (
        not isinstance(shape, tuple)
        or len(shape) > MAX_DIMS
        or not all(is_int(d) and 0 <= d <= MAX_DIM for d in shape)
    ):
        raise ValueError(f"handle shape must be a tuple of ints >= 0 (at most 2^48), got {shape!r}")
    want = math.prod(shape) * dt.itemsize
    if not is_int(nbytes) or nbytes != want:
        raise ValueError(
            f"handle says {nbytes!r} bytes, but shape {shape} of {dt} needs {want}: forged or "
            "corrupt handle refused"
        )
    return dt


def check_lease(slot: object, gen: object, reader: object, readers: object) -> None:
    """Lease fields: a slot >= 0, a generation >= 1, and 0 <= reader < readers."""
    if not (is_int(slot) and slot >= 0 and is_int(gen) and gen >= 1):
        raise ValueError(f"handle has an invalid slot {slot!r} or generation {gen!r}")
    if not (is_int(readers) and readers >= 1 and is_int(reader) and 0 <= reader < readers):
        raise ValueError(f"handle has an invalid reader {reader!r} of {readers!r}")


def check_range(offset: object, nbytes: int, start: int, length: int) -> None:
    """`[offset, offset + nbytes)` lies inside the data region `[start, start + length)`."""
    if not is_int(offset) or offset < start or offset + nbytes > start + length:
        raise ValueError(
            f"handle range [{offset!r}, +{nbytes}) is outside the segment's data region "
            f"[{start}, {start + length}): forged or corrupt handle refused"
        )
