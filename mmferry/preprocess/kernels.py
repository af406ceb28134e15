"""The compiled one-pass patch-row kernel (`_patches.c`), when it was built, and its packer of
RGB held in 4-byte pixels into 3-byte pixels (for the item key: decode.py, PackedRGB).

`pip install` compiles it where a C compiler is present (it is an optional extension); without
it, `patch_rows` returns False and patchify.py uses its torch path, which gives the same rows.
The kernel reads RGB frames in HWC memory (pixel stride 3, or 4 with the 4th byte unused;
channel stride 1; rows of any stride), which is what the resize writes; other strides take
the torch path.

One build serves every x86-64 CPU: the kernel asks the CPU at run time and takes its AVX-512
path where the CPU has AVX-512 with VBMI (`isa()`), else its portable path (itself built for
AVX2/FMA and for plain x86-64, picked by the loader). Both give the same bits.
"""

from __future__ import annotations

import ctypes
import importlib.util
from functools import cache

import torch

from mmferry.preprocess.threads import run_split

_P = ctypes.c_void_p
_N = ctypes.c_ssize_t
_I = ctypes.c_int
# Outputs from this size on are written with non-temporal stores (AVX-512 path): past the
# caches they skip a read of every line written; a smaller output is read back from cache
# by the next stage, so it is stored the usual way. NOTE: measured on a Xeon with AVX-512
# (docs/incoming/preprocess-intel.md).
STREAM_MIN_BYTES = 4 << 20


@cache
def _library() -> ctypes.CDLL | None:
    spec = importlib.util.find_spec("mmferry.preprocess._patches")
    if spec is None or not spec.origin:
        return None
    try:
        lib = ctypes.CDLL(spec.origin)
    except OSError:
        return None
    if not hasattr(lib, "mmferry_patches_isa"):  # a build of an older source: not used
        return None
    lib.mmferry_patches_u8.argtypes = [_P, _N, _N, _N, _N, _N, _N, _N, _N, _N, _N, _P, _I, _I]
    lib.mmferry_patches_f32.argtypes = [
        *(_P, _N, _N, _N, _N, _N, _N, _N, _N, _N, _P, _P, _N, _N, _P, _I, _I)
    ]
    lib.mmferry_patches_u8.restype = lib.mmferry_patches_f32.restype = ctypes.c_int
    lib.mmferry_patches_isa.restype = ctypes.c_int
    if not hasattr(lib, "mmferry_pack_rgb"):  # a build of an older source: not used
        return None
    lib.mmferry_pack_rgb.argtypes = [_P, _N, _N, _N, _P, _I]
    lib.mmferry_pack_rgb.restype = ctypes.c_int
    return lib


@cache
def isa() -> int:
    """The kernel's widest path on this CPU: 1 AVX-512 (F, BW, VL, VBMI), 0 the portable one
    (AVX2/FMA where the CPU has it), -1 no kernel."""
    lib = _library()
    return -1 if lib is None else int(lib.mmferry_patches_isa())


def available() -> bool:
    """Whether the compiled kernel was built and loads."""
    return _library() is not None


def _hwc_strides(frames: torch.Tensor) -> tuple[int, int, int] | None:
    """(frame, row, pixel) strides in bytes when `frames` [F, 3, H, W] uint8 lies in HWC memory
    of 3 bytes a pixel, or 4 (RGBX, the 4th unused)."""
    if frames.dtype != torch.uint8 or frames.device.type != "cpu" or frames.shape[1] != 3:
        return None
    sf, sc, sh, sw = frames.stride()
    if sc != 1 or sw not in (3, 4) or sh < sw * frames.shape[3] or sf < sh * frames.shape[2]:
        return None
    return sf, sh, sw


def patch_rows(
    frames: torch.Tensor,
    out: torch.Tensor,
    *,
    group: int,
    temporal: int,
    patch: int,
    merge: int,
    affine: tuple[torch.Tensor, torch.Tensor] | None,
    threads: int,
    level: int | None = None,
) -> bool:
    """Fill `out` (contiguous: uint8 rows when `affine` is None, else float32 rows normalised
    by `affine` = (scale, shift) per channel) from `frames`; False (nothing written) when the
    kernel is missing or the frames do not lie in HWC memory. `level`: the kernel path, at
    most `isa()` (default: the widest; the tests take each)."""
    lib = _library()
    strides = _hwc_strides(frames)
    if lib is None or strides is None or not out.is_contiguous():
        return False
    f, _, h, w = frames.shape
    bands = (f // group) * (h // (patch * merge))
    src, dst = frames.data_ptr(), out.data_ptr()
    geometry = (src, *strides, h, w, patch, merge, group)
    path = (isa() if level is None else min(level, isa()), out.nbytes >= STREAM_MIN_BYTES)
    if affine is not None:
        scale, shift = (t.contiguous().float() for t in affine)

        def fill(first: int, last: int) -> None:
            # NOTE: ctypes releases the GIL for the call, so bands run in parallel.
            code = lib.mmferry_patches_f32(
                *geometry, temporal, scale.data_ptr(), shift.data_ptr(), first, last, dst, *path
            )
            if code:
                raise MemoryError("the patch-row kernel could not allocate its band buffer")
    else:

        def fill(first: int, last: int) -> None:
            if lib.mmferry_patches_u8(*geometry, first, last, dst, *path):
                raise MemoryError("the patch-row kernel could not allocate its band buffer")

    run_split(bands, threads, fill)
    return True


def pack_rgb(
    src: int, row_stride: int, width: int, rows: int, dst: int, *, level: int | None = None
) -> bool:
    """Pack `rows` rows of `width` RGB pixels held 4 bytes a pixel (the 4th unused), starting at
    address `src`, `row_stride` bytes apart, into contiguous 3-byte pixels at `dst`; False
    (nothing written) when the kernel is missing. `level` as in `patch_rows`."""
    lib = _library()
    if lib is None:
        return False
    lib.mmferry_pack_rgb(src, row_stride, width, rows, dst, isa() if level is None else level)
    return True
