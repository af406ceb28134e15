"""A consumer's view of a feature pool's store: a read-only host mapping, or a CUDA IPC tensor."""

from __future__ import annotations

import mmap
import os
import threading
import warnings
import weakref

import numpy as np
import torch

from mmferry.transport.segment import check_name, open_segment

_LOCK = threading.Lock()
# NOTE: weak, so a pool's store stays mapped only while a view or an open lease holds it.
_STORES: weakref.WeakValueDictionary[tuple, torch.Tensor] = weakref.WeakValueDictionary()


def _map_host(name: str) -> torch.Tensor:
    fd = open_segment(check_name(name), os.O_RDONLY)
    try:
        mm = mmap.mmap(fd, os.fstat(fd).st_size, prot=mmap.PROT_READ, flags=mmap.MAP_SHARED)
    finally:
        os.close(fd)
    with warnings.catch_warnings():
        # Read-only on purpose: a reader's in-place write faults instead of changing the store.
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(np.frombuffer(mm, dtype=np.uint8))


def open_store(store: tuple) -> torch.Tensor:
    """The flat uint8 store a pool handle names, mapped once per process while in use."""
    with _LOCK:
        flat = _STORES.get(store)
        if flat is None:
            if store[0] == "host" and len(store) == 2:
                flat = _map_host(store[1])
            elif store[0] == "cuda" and len(store) == 3:
                rebuild, args = store[1], store[2]
                flat = rebuild(*args)  # the IPC mapping is costly; slices of it are cheap
            else:
                raise ValueError(f"unknown pool store {store!r:.80} in handle")
            _STORES[store] = flat
        return flat
