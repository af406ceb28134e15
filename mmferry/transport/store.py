"""A consumer's way into a feature pool's store: a host store, from which each lease maps its own
range copy-on-write, or the CUDA IPC store, of which each lease is a slice."""

from __future__ import annotations

import os
import threading
import weakref

import torch

from mmferry.transport.private import PrivatePages
from mmferry.transport.segment import check_name, open_segment

_LOCK = threading.Lock()
# NOTE: weak, so a CUDA store stays imported only while a view or an open lease holds it.
_DEVICE: weakref.WeakValueDictionary[tuple, torch.Tensor] = weakref.WeakValueDictionary()


class HostStore:
    """A host store opened read-only: no mapping of it can write the store."""

    def __init__(self, name: str) -> None:
        self._fd = open_segment(check_name(name), os.O_RDONLY)
        self.nbytes = os.fstat(self._fd).st_size
        weakref.finalize(self, os.close, self._fd)

    def range(self, offset: int, nbytes: int) -> torch.Tensor:
        """The bytes of one lease, mapped for this reader alone: its writes stay its own."""
        return torch.from_numpy(PrivatePages(self._fd, offset, nbytes).array())


class DeviceStore:
    """The CUDA IPC store, imported once per process while in use."""

    def __init__(self, flat: torch.Tensor) -> None:
        self.flat = flat
        self.nbytes = flat.numel()

    def range(self, offset: int, nbytes: int) -> torch.Tensor:
        """The bytes of one lease: a slice of the store, shared with its other readers."""
        return self.flat[offset : offset + nbytes]


def open_store(store: tuple) -> HostStore | DeviceStore:
    """The store a pool handle names; nothing of it is mapped until a lease asks for a range."""
    if store[0] == "host" and len(store) == 2:
        return HostStore(store[1])
    if store[0] != "cuda" or len(store) != 3:
        raise ValueError(f"unknown pool store {store!r:.80} in handle")
    with _LOCK:
        flat = _DEVICE.get(store)
        if flat is None:
            rebuild, args = store[1], store[2]
            flat = rebuild(*args)  # the IPC mapping is costly; slices of it are cheap
            _DEVICE[store] = flat
        return DeviceStore(flat)
