"""glibc's malloc in a long-lived service: large blocks mapped on their own, at a fixed size.

glibc maps a block of 128 KiB or more on its own and unmaps it on free, but each such free
raises that threshold to the freed size (up to 32 MiB). One decoded 2000x2000 frame (Pillow's
16 MB image, the file's 12 MB of bytes) raises it past every later tensor of the encoder, which
then come from the heaps, where the frees of a long frame list and of the encoder between them
leave memory the process keeps: `mmferry serve`'s peak grew by about 2.7 MiB per listed frame
(98 MiB more for 40 frames than for 4, tests/server/test_frame_list_peak.py). A fixed threshold
keeps every block of `MMAP_BYTES` or more mapped on its own, so a freed frame goes back to the
system and a list costs one frame's working set whatever its length.
"""

from __future__ import annotations

import ctypes
import ctypes.util

# mallopt's parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MMAP_BYTES = 4 << 20
# As glibc pairs them: free memory at a heap's top past twice the threshold goes back.
TRIM_BYTES = 2 * MMAP_BYTES


def fix_malloc_thresholds() -> bool:
    """Fix glibc's mmap and trim thresholds for this process; False where malloc is not
    glibc's (nothing changed)."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
        libc.gnu_get_libc_version  # noqa: B018 - glibc's alone: musl has no such thresholds
    except (OSError, AttributeError, TypeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_BYTES) and mallopt(_M_TRIM_THRESHOLD, TRIM_BYTES))
