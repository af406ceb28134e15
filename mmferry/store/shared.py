"""`SharedStore`: a pool of encoders shares one cache in a Mooncake Store (`serve --store`).

Before an item is queued for the encoder, its entry is looked for in the store (on a thread of
its own, never the event loop; the request waits at most the address's `lookup_s`, and while a
lookup older than that is still running, none) and, when found and checked, put in the local
cache, so the batcher answers it without an encoder call; every item this service encodes is
published after its request is answered (on another thread, off the request's path; while a
publication older than the address's `publish_s` is still out, later ones are skipped, and a
drain waits at most `publish_s` for those still queued, so a store cut off never holds the
process). The store is only ever a shortcut: a store that is down, full or holding a bad entry
leaves the service as it is without one (local cache, local encode, rows over HTTP), counts it,
and logs the change once.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from mmferry.encoder.model import VisionOutput
from mmferry.store.entry import EntryError, ModelIdentity, entry_key, entry_parts, read_entry
from mmferry.store.mooncake import MooncakeStore, StoreAddress, StoreError, import_mooncake
from mmferry.store.worker import Worker

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from mmferry.embed.cache import EncoderCache
    from mmferry.encoder.model import VisionEncoder
    from mmferry.items import MultimodalItem

log = logging.getLogger("mmferry.store")
MAX_PUBLISHING = 64  # entries waiting to be published; past it an entry is skipped and counted
_KNOWN = 1 << 16  # item hashes known to be in the store, remembered to skip re-publishing


class StoreMetrics:
    """The store's counters, in the service's registry."""

    def __init__(self, r: CollectorRegistry) -> None:
        from prometheus_client import Counter

        self.hits = Counter("mmferry_store_hits", "items taken from the store", registry=r)
        self.misses = Counter("mmferry_store_misses", "items the store lacked", registry=r)
        self.refused = Counter(
            "mmferry_store_refused",
            "store entries refused (wrong header, length or model) and re-encoded",
            registry=r,
        )
        self.errors = Counter(
            "mmferry_store_errors", "store calls that failed or were skipped", ["op"], registry=r
        )
        self.published = Counter("mmferry_store_published", "items published", registry=r)
        self.publish_failures = Counter(
            "mmferry_store_publish_failures", "items not published (store down or full)", registry=r
        )
        self.bytes = Counter("mmferry_store_bytes", "entry bytes moved", ["direction"], registry=r)
        for op in ("get", "put", "connect"):
            self.errors.labels(op)
        for d in ("read", "written"):
            self.bytes.labels(d)


class SharedStore:
    """The service's side of the store, in front of its batcher (`server/batching.py`'s
    `Store`): look up before encoding, publish after."""

    def __init__(
        self,
        url: str,
        encoder: VisionEncoder,
        model: str,
        registry: CollectorRegistry,
        *,
        family: str | None = None,
    ) -> None:
        self.address = StoreAddress.parse(url)
        import_mooncake()  # the extra's message now, not on the first lookup's thread
        self.encoder = encoder
        # A checkpoint folder's identity is read from its files, so engines can compute it;
        # `family` is the path the encoder was loaded through ("generic", or None: native
        # where a spec exists), so its rows are keyed apart from the other path's.
        self.identity = (
            ModelIdentity.of_checkpoint(model, family)
            if Path(model).is_dir()
            else ModelIdentity.of(model, encoder.tower)
        )
        self.metrics = StoreMetrics(registry)
        self._store: MooncakeStore | None = None
        self._connect_after = 0.0
        self._healthy = True
        self._known: OrderedDict[str, None] = OrderedDict()
        self._replace: set[str] = set()
        self._lock = threading.Lock()
        self._connecting = threading.Lock()
        self._connect_pending = False
        self._publishing = 0
        self._reading_since: float | None = None  # when the lookup running now began
        self._writing_since: float | None = None  # when the publication running now began
        # One thread reads, one publishes: a slow publish never holds up a lookup. Daemon
        # threads: a call the store never answers must not keep the process from exiting.
        self._reader = Worker("mmferry-store-get")
        self._writer = Worker("mmferry-store-put")
        self._connect_soon()  # in the background, while the service starts

    def __repr__(self) -> str:
        return f"SharedStore(mooncake://{self.address.master}, {self.identity})"

    def key(self, item_hash: str) -> str:
        return entry_key(item_hash, self.identity, self.encoder.dtype)

    # -- the client, connected on first use and again after a failed connect ----------------

    def _client(self) -> MooncakeStore:
        with self._connecting:  # the reader and the writer share one client
            if self._store is not None:
                return self._store
            if time.monotonic() < self._connect_after:
                raise StoreError("not connected")
            try:
                self._store = MooncakeStore(self.address)
            except StoreError as e:
                self._connect_after = time.monotonic() + self.address.retry_s
                self.metrics.errors.labels("connect").inc()
                self._note(False, str(e))
                raise
            return self._store

    def _note(self, ok: bool, why: str = "") -> None:
        """Log the store's state when it changes (not every failed call)."""
        with self._lock:
            changed, self._healthy = self._healthy != ok, ok
        if changed and ok:
            log.warning(
                "mmferry store: the Mooncake store at %s answers again", self.address.master
            )
        elif changed:
            log.warning(
                "mmferry store: the Mooncake store at %s failed (%s); serving without it until "
                "it answers",
                self.address.master,
                why,
            )

    # -- lookup -------------------------------------------------------------------------

    def _fetch(self, items: list[MultimodalItem]) -> dict[str, VisionOutput]:
        """On the reader thread: the checked rows of every item found in the store."""
        with self._lock:
            self._reading_since = time.monotonic()
        try:
            return self._fetch_all(items)
        finally:
            with self._lock:
                self._reading_since = None

    def _fetch_all(self, items: list[MultimodalItem]) -> dict[str, VisionOutput]:
        found: dict[str, VisionOutput] = {}
        enc = self.encoder
        for it in items:
            key = self.key(it.hash)
            try:
                data = self._client().get(key)
            except StoreError as e:
                self.metrics.errors.labels("get").inc()
                self._note(False, str(e))
                break  # the rest are misses too: encoded here
            self._note(True)
            if data is None:
                self.metrics.misses.inc()
                continue
            try:
                embeds, deepstack = read_entry(
                    data,
                    key=key,
                    model=self.identity,
                    dtype=enc.dtype,
                    num_tokens=it.num_tokens,
                    hidden=enc.out_hidden_size,
                    deepstack=enc.num_deepstack,
                )
            except EntryError as e:
                self.metrics.refused.inc()
                log.warning("mmferry store: refused the entry %s (%s); re-encoding", key, e)
                with self._lock:
                    self._replace.add(key)
                continue
            self.metrics.hits.inc()
            self.metrics.bytes.labels("read").inc(data.numel())
            dev = enc.device
            found[it.hash] = VisionOutput(
                embeds.to(dev, copy=True), tuple(d.to(dev, copy=True) for d in deepstack)
            )
        return found

    async def fill(self, items: Sequence[MultimodalItem], cache: EncoderCache) -> None:
        """Put the store's entries for `items` (neither cached nor in flight) in `cache`."""
        wanted: dict[str, MultimodalItem] = {}
        for it in items:
            wanted.setdefault(it.hash, it)
        if self._store is None:
            # Never on a request's path: the writer thread connects, these are misses.
            self._connect_soon()
            self.metrics.misses.inc(len(wanted))
            return
        with self._lock:
            reading = self._reading_since
        if reading is not None and time.monotonic() - reading > self.address.lookup_s:
            # The last lookup has not come back (a store cut off answers nothing, fails
            # nothing): these are misses at once, not another wait behind it.
            self.metrics.errors.labels("get").inc()
            self.metrics.misses.inc(len(wanted))
            return
        loop = asyncio.get_running_loop()
        call = loop.run_in_executor(self._reader, self._fetch, list(wanted.values()))
        try:
            found = await asyncio.wait_for(asyncio.shield(call), self.address.lookup_s)
        except TimeoutError:
            self.metrics.errors.labels("get").inc()
            self.metrics.misses.inc(len(wanted))
            self._note(False, f"no answer to a lookup within {self.address.lookup_s:g} s")
            return
        for h, out in found.items():
            cache.put(h, out)
            self._remember(h)

    def _connect_soon(self) -> None:
        with self._lock:
            if self._connect_pending or time.monotonic() < self._connect_after:
                return
            self._connect_pending = True

        def connect() -> None:
            try:
                self._client()
            except StoreError:
                pass  # counted and logged by _client
            finally:
                with self._lock:
                    self._connect_pending = False

        try:
            self._writer.submit(connect)
        except RuntimeError:  # closed: the service is stopping, nothing to connect for
            with self._lock:
                self._connect_pending = False

    # -- publication --------------------------------------------------------------------

    def _remember(self, item_hash: str) -> bool:
        """Mark the item as in the store; False when it already was."""
        with self._lock:
            if item_hash in self._known:
                self._known.move_to_end(item_hash)
                return False
            self._known[item_hash] = None
            while len(self._known) > _KNOWN:
                self._known.popitem(last=False)
            return True

    def _forget(self, item_hash: str) -> None:
        with self._lock:
            self._known.pop(item_hash, None)

    def _put(self, item_hash: str, out: VisionOutput) -> None:
        """On the writer thread: one entry; a failure is counted and the item forgotten, so
        the next request for it publishes it again."""
        key = self.key(item_hash)
        with self._lock:
            replace = key in self._replace
            self._writing_since = time.monotonic()
        try:
            parts = entry_parts(key, self.identity, out.embeds, out.deepstack)
            size = self._client().put(key, parts, replace=replace)
        except StoreError as e:
            self.metrics.publish_failures.inc()
            self.metrics.errors.labels("put").inc()
            self._note(False, str(e))
            self._forget(item_hash)
        else:
            self._note(True)
            self.metrics.published.inc()
            self.metrics.bytes.labels("written").inc(size)
            with self._lock:
                self._replace.discard(key)
        finally:
            with self._lock:
                self._publishing -= 1
                self._writing_since = None

    def publish(self, items: Sequence[MultimodalItem], outs: Sequence[VisionOutput]) -> None:
        """Queue the entries of the items not known to be in the store."""
        for it, out in zip(items, outs):
            if not self._remember(it.hash):
                continue
            with self._lock:
                writing = self._writing_since
                # NOTE: a publication out past publish_s is one a store cut off holds: the
                # next ones are skipped, not queued behind it for minutes.
                stuck = writing is not None and time.monotonic() - writing > self._publish_s
                skip = stuck or self._publishing >= MAX_PUBLISHING
                if not skip:
                    self._publishing += 1
            if skip:
                self.metrics.publish_failures.inc()
                self._forget(it.hash)
                continue
            try:
                self._writer.submit(self._put, it.hash, out)
            except RuntimeError:  # closed: the service is stopping
                with self._lock:
                    self._publishing -= 1
                self.metrics.publish_failures.inc()

    @property
    def _publish_s(self) -> float:
        return self.address.publish_s

    def close(self) -> None:
        """Finish the queued publications within `publish_s`, then disconnect. Publications
        not finished by then are dropped (counted as failures); while a call is still out
        in the store, the client is left open (its close would wait on the store too)."""
        deadline = time.monotonic() + self._publish_s
        self._reader.shutdown(wait=False, cancel_futures=True)
        writer_done = self._writer.shutdown(timeout=self._publish_s)
        if not writer_done:
            dropped = self._writer.cancel_pending()
            self.metrics.publish_failures.inc(dropped)
        reader_done = self._reader.shutdown(timeout=max(deadline - time.monotonic(), 0.0))
        if not (reader_done and writer_done):
            with self._lock:
                left = self._publishing
            log.warning(
                "mmferry store: the Mooncake store at %s did not finish within publish_s "
                "(%g s); %d publication(s) dropped, the client left open",
                self.address.master,
                self._publish_s,
                left,
            )
            return
        if self._store is not None:
            self._store.close()
