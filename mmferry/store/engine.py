"""`StoreReader`: an engine's side of the store: which items it holds, and their rows read
straight into a registered buffer, whichever encoder published them.

Presence comes with Mooncake's lease: asking whether a key exists leases the object for the
master's `--default_kv_lease_ttl` (10 s by default), during which the store neither evicts nor
removes it, so an item answered present stays loadable while the lease lasts (`lookup_pins`
answers the lease as the item's pin, in the form the connector's `Presence` takes from the
service). Rows are read into one host buffer registered with the store (grown when an entry
needs more) and copied once from it onto the device, into the engine's `[main | ds0 | ds1 ...]`
layout and dtype. Every entry is checked against the item (header, length, model) before a byte
is used; a bad or missing entry is left to the caller, which loads it another way.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import torch

from mmferry.store.entry import ALIGN, EntryError, ModelIdentity, entry_key, read_entry
from mmferry.store.mooncake import MooncakeStore, StoreAddress, StoreError, import_mooncake

log = logging.getLogger("mmferry.store")
# One Mooncake client per address in a process, however many readers (vLLM builds the connector
# twice, scheduler and worker, in one process when its engine core runs in-process).
_CLIENTS: dict[StoreAddress, tuple[MooncakeStore, int]] = {}
_CLIENTS_LOCK = threading.Lock()
LEASE_S = 10.0  # Mooncake's default --default_kv_lease_ttl
_HEADER_SLACK = 4096  # bytes read past an entry's rows for its prefix and JSON header


def identity_for(model: str) -> ModelIdentity:
    """A model's identity from `name@weights` (as `mmferry serve --store` prints it) or from
    its checkpoint folder (the vision weights hashed as the service hashes them)."""
    if Path(model).is_dir():
        return ModelIdentity.of_checkpoint(model)
    name, sep, weights = model.rpartition("@")
    if not sep or not name or len(weights) != 32:
        raise ValueError(
            f"store model {model!r} is neither a checkpoint folder nor NAME@WEIGHTS as "
            "`mmferry serve --store` prints it"
        )
    return ModelIdentity(name, weights)


class StoreReader:
    """Presence and rows of items in a Mooncake Store, for one model, dtype and row layout."""

    def __init__(
        self,
        url: str,
        identity: ModelIdentity,
        *,
        dtype: torch.dtype,
        hidden: int,
        deepstack: int,
        lease_s: float = LEASE_S,
    ) -> None:
        self.address = StoreAddress.parse(url)
        import_mooncake()
        self.url = f"mooncake://{self.address.master}"
        self.identity = identity
        self.dtype = dtype  # the rows' dtype in the store (the encoders' --dtype)
        self.hidden = hidden
        self.deepstack = deepstack
        self.lease_s = lease_s
        self._store: MooncakeStore | None = None
        self._connect_after = 0.0
        self._lock = threading.Lock()
        self._buf: torch.Tensor | None = None

    def key(self, item_hash: str) -> str:
        return entry_key(item_hash, self.identity, self.dtype)

    def _client(self) -> MooncakeStore:
        with self._lock:
            if self._store is None:
                if time.monotonic() < self._connect_after:
                    raise StoreError("not connected")
                with _CLIENTS_LOCK:
                    store, users = _CLIENTS.get(self.address, (None, 0))
                    if store is None:
                        try:
                            store = MooncakeStore(self.address)
                        except StoreError:
                            self._connect_after = time.monotonic() + self.address.retry_s
                            raise
                    _CLIENTS[self.address] = (store, users + 1)
                self._store = store
            return self._store

    # -- scheduler side -------------------------------------------------------------------

    def lookup_pins(self, hashes: list[str]) -> list[float]:
        """Per item, the seconds from this call it stays loadable (the lease; 0.0 when absent);
        StoreError when the store cannot answer."""
        store = self._client()
        return [self.lease_s if store.exists(self.key(h)) else 0.0 for h in hashes]

    # -- worker side ----------------------------------------------------------------------

    def _buffer(self, store: MooncakeStore, size: int) -> torch.Tensor:
        if self._buf is None or self._buf.numel() < size:
            if self._buf is not None:
                store.unregister(self._buf.data_ptr())
            self._buf = None  # the old buffer is freed before a larger one is made
            buf = torch.empty(max(size, 1 << 20), dtype=torch.uint8)
            store.register(buf.data_ptr(), buf.numel())
            self._buf = buf
        return self._buf

    def load(
        self, need: dict[str, int], device: torch.device, out_dtype: torch.dtype
    ) -> dict[str, torch.Tensor]:
        """The `[tokens, hidden * (1 + deepstack)]` rows on `device` in `out_dtype` of each item
        found in the store with a sound entry; the others are left out (logged)."""
        out: dict[str, torch.Tensor] = {}
        try:
            store = self._client()
        except StoreError as e:
            log.warning("mmferry store: %s unusable for %d item(s): %s", self.url, len(need), e)
            return out
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        for h, tokens in need.items():
            rows = (1 + self.deepstack) * tokens * self.hidden * itemsize
            size = rows + _HEADER_SLACK + ALIGN
            key = self.key(h)
            try:
                buf = self._buffer(store, size)
                got = store.get_into(key, buf.data_ptr(), buf.numel())
            except StoreError as e:
                log.warning("mmferry store: cannot read %s: %s", key, e)
                continue
            if got == 0:
                continue
            try:
                embeds, deepstack = read_entry(
                    buf[:got],
                    key=key,
                    model=self.identity,
                    dtype=self.dtype,
                    num_tokens=tokens,
                    hidden=self.hidden,
                    deepstack=self.deepstack,
                )
            except EntryError as e:
                log.warning("mmferry store: refused the entry %s: %s", key, e)
                continue
            # The one copy: out of the registered buffer onto the device, into the engine's
            # layout and dtype (the buffer is reused for the next item).
            dst = torch.empty(
                tokens, self.hidden * (1 + self.deepstack), dtype=out_dtype, device=device
            )
            for k, part in enumerate((embeds, *deepstack)):
                dst[:, k * self.hidden : (k + 1) * self.hidden].copy_(part)
            out[h] = dst
        return out

    def close(self) -> None:
        with self._lock:
            store, self._store = self._store, None
            if store is not None:
                if self._buf is not None:
                    store.unregister(self._buf.data_ptr())
                with _CLIENTS_LOCK:
                    _, users = _CLIENTS[self.address]
                    if users > 1:
                        _CLIENTS[self.address] = (store, users - 1)
                    else:
                        del _CLIENTS[self.address]
                        store.close()
            self._buf = None
