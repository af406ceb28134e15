"""`StoreReader`: an engine's side of the store: which items it holds, and their rows read
straight into a registered buffer, whichever encoder published them.

The scheduler never waits on Mooncake beyond its lookup deadline: the client connects on a
thread of its own, started with the reader (Mooncake's setup retries an absent master for about
a minute and a half), and until it is up, or for `retry_s` after it failed, a lookup is a
`StoreError` at once; each lookup runs on another thread and is a `StoreError` when it has not
answered within `lookup_timeout_s` (and the next one too while it still runs). A worker's
read of an entry waits at most `connect_wait_s` (the connector's `timeout_s`); while any call
to the store is out past its deadline (a store cut off mid-call neither answers nor fails),
lookups and reads skip the store at once and the items come from the services. The connector's
`Presence` reads any `StoreError` as "absent" and leaves the store alone for a while, as it
does a service that is down or late.

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
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import Any

import torch

from mmferry.store.entry import ALIGN, EntryError, ModelIdentity, entry_key, read_entry
from mmferry.store.mooncake import MooncakeStore, StoreAddress, StoreError, import_mooncake

log = logging.getLogger("mmferry.store")
# One Mooncake client per address in a process, however many readers (vLLM builds the connector
# twice, scheduler and worker, in one process when its engine core runs in-process).
_CLIENTS: dict[StoreAddress, tuple[MooncakeStore, int]] = {}
_CLIENTS_LOCK = threading.Lock()
# One setup at a time per address, outside _CLIENTS_LOCK: a setup stuck on one master holds up
# no other address, and no reader's close.
_SETUPS: dict[StoreAddress, threading.Lock] = {}
# Calls per address that ran past their deadline and have not returned (a store cut off
# mid-call neither answers nor fails): while one is out, lookups and loads skip the store at
# once, in every reader of the process, scheduler's and worker's alike.
_STUCK: dict[StoreAddress, list[Future]] = {}
LEASE_S = 10.0  # Mooncake's default --default_kv_lease_ttl
LOOKUP_TIMEOUT_S = 1.0  # as the connector's lookup of a service
CONNECT_WAIT_S = 30.0  # how long a load waits for a connect in progress
_HEADER_SLACK = 4096  # bytes read past an entry's rows for its prefix and JSON header


def identity_for(model: str, family: str | None = None) -> ModelIdentity:
    """A model's identity from `name@weights` (as `mmferry serve --store` prints it) or from
    its checkpoint folder (the vision weights hashed as the service hashes them, through the
    path `family` picks as `--family` does: None or "auto", the native spec where mmferry has
    one, else the generic family; "generic" for encoders served with `--family generic`)."""
    if Path(model).is_dir():
        return ModelIdentity.of_checkpoint(model, family)
    name, sep, weights = model.rpartition("@")
    if not sep or not name or len(weights) != 32:
        raise ValueError(
            f"store model {model!r} is neither a checkpoint folder nor NAME@WEIGHTS as "
            "`mmferry serve --store` prints it"
        )
    return ModelIdentity(name, weights)


class _Caller:
    """One daemon thread running calls in turn for callers that wait on each with a deadline;
    a call stuck in Mooncake holds up neither its caller nor the process's exit."""

    def __init__(self, name: str) -> None:
        self._calls: queue.SimpleQueue[tuple[Future, Callable[..., Any], tuple]] = (
            queue.SimpleQueue()
        )
        threading.Thread(target=self._run, name=name, daemon=True).start()

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        future: Future = Future()
        self._calls.put((future, fn, args))
        return future

    def _run(self) -> None:
        while True:
            future, fn, args = self._calls.get()
            if fn is None:
                return
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as e:  # noqa: BLE001 - handed to the waiting caller
                future.set_exception(e)

    def close(self) -> None:
        self._calls.put((Future(), None, ()))  # type: ignore[arg-type]


def _stuck(address: StoreAddress, future: Future | None = None) -> bool:
    """Whether a call to `address` is still out past its deadline (`future`: one more)."""
    with _CLIENTS_LOCK:
        calls = [f for f in _STUCK.get(address, []) if not f.done()]
        if future is not None and not future.done():
            calls.append(future)
        _STUCK[address] = calls
        return bool(calls)


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
        lookup_timeout_s: float = LOOKUP_TIMEOUT_S,
        connect_wait_s: float = CONNECT_WAIT_S,
    ) -> None:
        self.address = StoreAddress.parse(url)
        import_mooncake()
        self.url = f"mooncake://{self.address.master}"
        self.identity = identity
        self.dtype = dtype  # the rows' dtype in the store (the encoders' --dtype)
        self.hidden = hidden
        self.deepstack = deepstack
        self.lease_s = lease_s
        self.lookup_timeout_s = lookup_timeout_s
        self.connect_wait_s = connect_wait_s
        self._store: MooncakeStore | None = None
        self._lock = threading.Lock()
        self._closed = False
        self._buf: torch.Tensor | None = None
        # NOTE: a connect and a lookup each on a thread of their own: a lookup never waits
        # behind a connect, and the scheduler waits on neither past its deadline.
        self._connector = _Caller("mmferry-store-connect")
        self._lookups = _Caller("mmferry-store-lookup")
        self._loads = _Caller("mmferry-store-load")
        self._abandoned: list[torch.Tensor] = []  # buffers a late read may still write into
        self._connect: Future | None = None
        self._connect_after = 0.0
        self._lookup: Future | None = None
        self._connecting()  # in the background, while the engine starts

    def key(self, item_hash: str) -> str:
        return entry_key(item_hash, self.identity, self.dtype)

    # -- the client, connected in the background and again `retry_s` after a failure -------

    def _connecting(self) -> Future:
        """The connect in progress (or done), a new one when the last failed `retry_s` ago."""
        with self._lock:
            f = self._connect
            failed = f is not None and f.done() and f.exception() is not None
            if f is None or (failed and time.monotonic() >= self._connect_after):
                f = self._connect = self._connector.submit(self._open)
            return f

    def _open(self) -> MooncakeStore:
        """On the connect thread: this process's client for the address (one per address)."""
        with _CLIENTS_LOCK:
            setup = _SETUPS.setdefault(self.address, threading.Lock())
        try:
            with setup:
                with _CLIENTS_LOCK:
                    store, users = _CLIENTS.get(self.address, (None, 0))
                    if store is not None:
                        _CLIENTS[self.address] = (store, users + 1)
                if store is None:
                    store = MooncakeStore(self.address)
                    with _CLIENTS_LOCK:
                        _CLIENTS[self.address] = (store, 1)
        except Exception as e:  # noqa: BLE001 - whatever setup raises, the store is down
            with self._lock:
                self._connect_after = time.monotonic() + self.address.retry_s
            if isinstance(e, StoreError):
                raise
            raise StoreError(f"cannot connect to {self.url}: {type(e).__name__}: {e}") from None
        with self._lock:
            if not self._closed:
                self._store = store
                return store
        _release(self.address)  # closed while connecting
        raise StoreError("the reader is closed")

    def ready(self, wait_s: float = 0.0) -> bool:
        """Whether the client is connected, waiting at most `wait_s` for it."""
        try:
            self._client(wait_s)
        except StoreError:
            return False
        return True

    def _client(self, wait_s: float) -> MooncakeStore:
        """The connected client, waiting at most `wait_s` for a connect; StoreError."""
        store = self._store
        if store is not None:
            return store
        try:
            return self._connecting().result(timeout=wait_s)
        except FutureTimeout:
            raise StoreError(f"still connecting to {self.url}") from None

    # -- scheduler side -------------------------------------------------------------------

    def lookup_pins(self, hashes: list[str]) -> list[float]:
        """Per item, the seconds from this call it stays loadable (the lease; 0.0 when absent);
        StoreError when the store cannot answer within `lookup_timeout_s` (not connected yet,
        left alone after an error, or late)."""
        store = self._client(0.0)
        if _stuck(self.address):
            raise StoreError("an earlier call to the store has not returned")
        keys = [self.key(h) for h in hashes]
        with self._lock:
            if self._lookup is not None and not self._lookup.done():
                raise StoreError("the previous lookup has not ended yet")
            future = self._lookup = self._lookups.submit(lambda: [store.exists(k) for k in keys])
        try:
            present = future.result(timeout=self.lookup_timeout_s)
        except FutureTimeout:
            _stuck(self.address, future)
            raise StoreError(f"no answer within {self.lookup_timeout_s:g} s") from None
        return [self.lease_s if p else 0.0 for p in present]

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
            store = self._client(self.connect_wait_s)
        except StoreError as e:
            log.warning("mmferry store: %s unusable for %d item(s): %s", self.url, len(need), e)
            return out
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        for h, tokens in need.items():
            if _stuck(self.address):
                # A store cut off: what is left comes from the services, not after a wait.
                log.warning("mmferry store: %s has a call out past its deadline", self.url)
                break
            rows = (1 + self.deepstack) * tokens * self.hidden * itemsize
            size = rows + _HEADER_SLACK + ALIGN
            key = self.key(h)
            try:
                buf = self._buffer(store, size)
                call = self._loads.submit(store.get_into, key, buf.data_ptr(), buf.numel())
                try:
                    got = call.result(timeout=self.connect_wait_s)
                except FutureTimeout:
                    # NOTE: the read may still land in the buffer: the next one gets another.
                    _stuck(self.address, call)
                    self._abandoned.append(buf)
                    self._buf = None
                    raise StoreError(f"no answer within {self.connect_wait_s:g} s") from None
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
            self._closed = True
            store, self._store = self._store, None
            buf, self._buf = self._buf, None
        self._connector.close()
        self._lookups.close()
        self._loads.close()
        if store is not None:
            if buf is not None:
                store.unregister(buf.data_ptr())
            _release(self.address)


def _release(address: StoreAddress) -> None:
    """One reader less on the address's client; the last one closes it."""
    with _CLIENTS_LOCK:
        store, users = _CLIENTS[address]
        if users > 1:
            _CLIENTS[address] = (store, users - 1)
        else:
            del _CLIENTS[address]
            store.close()
