"""`PrivatePages`: a reader's own copy-on-write mapping of the pages under one leased range.

A reader maps only the pages under its lease, MAP_PRIVATE from a read-only descriptor. A write
through its view lands in a page the kernel copies for this mapping alone: the writer does not
fault, and the producer and every other reader (in this process or another) keep seeing the
segment's bytes. Nothing is copied until a page is written. The copied pages die with the
mapping, which dies with the lease's last view, so a written page never shows through a later
lease of the same bytes.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import weakref

import numpy as np

_LIBC = ctypes.CDLL(None, use_errno=True)
_LIBC.mmap.restype = ctypes.c_void_p
_LIBC.mmap.argtypes = (
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
)
_LIBC.munmap.restype = ctypes.c_int
_LIBC.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
_MAP_FAILED = ctypes.c_void_p(-1).value
# No swap is reserved for pages that are copied only if the reader writes them.
_MAP_NORESERVE = 0x4000
# cudaHostRegisterReadOnly: the device only reads, so registering copies no page.
_HOST_REGISTER_READ_ONLY = 8


def clear_cuda_error() -> None:
    """Reset the CUDA runtime's last error after a call that failed on purpose or was handled.

    A failed runtime call (a refused cudaHostRegister, say) stays as the thread's last error,
    and torch raises it from the next unrelated kernel launch it checks.
    """
    with open("/proc/self/maps") as f:
        paths = {line.split()[-1] for line in f if "libcudart.so" in line}
    for path in sorted(paths):
        ctypes.CDLL(path).cudaGetLastError()


def _unmap(addr: int, length: int, pinned: list[int]) -> None:
    # NOTE: the registration ends while its pages are still mapped.
    if pinned:
        import torch

        torch.cuda.cudart().cudaHostUnregister(pinned.pop())
    _LIBC.munmap(addr, length)


class PrivatePages:
    """`[offset, offset + nbytes)` of the file `fd`, mapped copy-on-write for this reader.

    `np.asarray(pages)` is the range as uint8; the mapping lives while that array (or anything
    viewing it) lives. It takes no reference to `fd`, which the caller may close.
    """

    def __init__(self, fd: int, offset: int, nbytes: int) -> None:
        if nbytes <= 0 or offset < 0:
            raise ValueError(f"cannot map {nbytes} bytes at offset {offset}")
        start = offset - offset % mmap.ALLOCATIONGRANULARITY
        length = offset + nbytes - start
        flags = mmap.MAP_PRIVATE | _MAP_NORESERVE
        addr = _LIBC.mmap(None, length, mmap.PROT_READ | mmap.PROT_WRITE, flags, fd, start)
        if addr is None or addr == _MAP_FAILED:
            err = ctypes.get_errno()
            raise OSError(err, f"cannot map {nbytes} shared bytes: {os.strerror(err)}")
        self.addr, self.length = addr, length
        self._pinned: list[int] = []
        self.__array_interface__ = {
            "data": (addr + offset - start, False),
            "shape": (nbytes,),
            "typestr": "|u1",
            "version": 3,
        }
        # NOTE: not at interpreter exit, where live tensors may still point here; the kernel
        # unmaps everything when the process ends.
        weakref.finalize(self, _unmap, addr, length, self._pinned).atexit = False

    def array(self) -> np.ndarray:
        """The range as a writable uint8 array that keeps this mapping alive."""
        return np.asarray(self)

    def pin(self) -> None:
        """Page-lock the mapping once, so host->device copies read it directly.

        The registration is read-only, so it copies nothing. It holds the pages as they were
        when pinned: for a page this reader writes later, the device may read the segment's
        bytes rather than the reader's own.
        """
        if self._pinned:
            return
        import torch

        err = torch.cuda.cudart().cudaHostRegister(self.addr, self.length, _HOST_REGISTER_READ_ONLY)
        if int(err) != 0:
            clear_cuda_error()
            raise RuntimeError(f"cudaHostRegister failed for a shared-memory view: error {err}")
        self._pinned.append(self.addr)


def pages_of(array: np.ndarray) -> PrivatePages:
    """The mapping under an array made by `PrivatePages.array`."""
    base = array.base
    if not isinstance(base, PrivatePages):
        raise TypeError("not an array over a private mapping")
    return base
