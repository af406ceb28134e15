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
# The producer's own copy events by IPC handle, alive while its book keeps their slots.
_EVENTS: weakref.WeakValueDictionary[bytes, torch.cuda.Event] = weakref.WeakValueDictionary()


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


def keep_local(store: tuple, flat: torch.Tensor) -> None:
    """Serve the CUDA store `store` from `flat` in the process that exported it.

    CUDA IPC cannot open a handle in the process that made it (the driver answers "invalid
    device context"), so a reader in the producer's own process takes the store itself.
    """
    with _LOCK:
        _DEVICE[store] = flat


def keep_local_event(ipc: bytes, event: torch.cuda.Event) -> None:
    """Let readers in this process wait on `event` itself: its IPC handle opens elsewhere only."""
    with _LOCK:
        _EVENTS[ipc] = event


def ready_event(device: torch.device, ipc: bytes) -> torch.cuda.Event:
    """The producer's copy event: its own object in the producer's process, else imported."""
    with _LOCK:
        event = _EVENTS.get(ipc)
    return event if event is not None else torch.cuda.Event.from_ipc_handle(device, ipc)


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
