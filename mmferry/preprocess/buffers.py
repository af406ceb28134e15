"""Output buffers for large features, backed by transparent huge pages where the OS allows.

A fresh 100+ MB tensor costs more in first-touch page faults than in the arithmetic that fills
it (a 4000x3000 image's hf features are ~290 MB). Private anonymous mappings advised with
MADV_HUGEPAGE fault 2 MiB at a time instead of 4 KiB, which makes filling them several times
faster. The tensor holds the mapping alive and frees it with its storage.
"""

from __future__ import annotations

import math
import mmap

import torch

# Below this, torch's allocator is as good (and small blocks are often recycled).
_HUGE_MIN_BYTES = 4 << 20
_HUGE_PAGE = 2 << 20
_CAN_ADVISE = hasattr(mmap, "MADV_HUGEPAGE") and hasattr(mmap, "MAP_PRIVATE")


def empty_host(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised contiguous CPU tensor; huge-page backed when large and supported."""
    numel = math.prod(shape)
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if nbytes < _HUGE_MIN_BYTES or not _CAN_ADVISE:
        return torch.empty(shape, dtype=dtype)
    try:
        # NOTE: MAP_PRIVATE: shared anonymous memory is shmem, which THP usually skips.
        mm = mmap.mmap(-1, nbytes + _HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        mm.madvise(mmap.MADV_HUGEPAGE)
    except (OSError, ValueError):
        return torch.empty(shape, dtype=dtype)
    raw = torch.frombuffer(mm, dtype=torch.uint8)
    # Start on a 2 MiB boundary so every full huge page of the tensor can be backed by one.
    start = -raw.data_ptr() % _HUGE_PAGE
    return raw[start : start + nbytes].view(dtype).view(shape)
