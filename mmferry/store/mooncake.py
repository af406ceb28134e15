"""A Mooncake Store client: the address form, and get/put of whole entries (the `mooncake` extra).

`mooncake://MASTER_HOST:PORT?metadata=URL` names a Mooncake master and its metadata server;
optional parameters: `protocol` (tcp; rdma where the hosts have it), `host` (the address this
client's transfer engine advertises; default: the local address that routes to the master),
`local_mib` (the client's registered staging buffer: an entry larger than it is not published;
default 256), `retry_s` (after a store error, the store is left alone this long; default 5),
`lookup_s` (`serve --store`: the longest a request waits on the store's lookup before it
encodes its items itself; default 1; a store cut off mid-call does not answer, or fail, at all),
`publish_s` (`serve --store`: the longest a publication may be out before the next ones are
skipped rather than queued behind it, and the longest a drain waits for the publications still
queued; default 5).

Mooncake's own semantics used here: a `put` is readable only once complete (a reader never sees
half an object), a `put` to an existing key keeps the old value (`upsert` replaces it), and
objects not pinned are evicted by the store when its memory runs short (its own LRU; the
master's `--eviction_high_watermark_ratio`), which is an entry's lifetime.
"""

from __future__ import annotations

import socket
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs, urlsplit

import torch

SCHEME = "mooncake"
NOT_FOUND = -704  # Mooncake's OBJECT_NOT_FOUND
PROBE_S = 2.0  # a master that does not accept a connection within this is down
UNREACHABLE = -800  # Mooncake's transfer (-800s) and RPC (-900s) failures, and below


class StoreError(RuntimeError):
    """The store answered with an error code (down, full, refused), or is being left alone."""


def import_mooncake() -> Any:
    """Mooncake's store module, or an ImportError naming the extra."""
    try:
        from mooncake import store
    except ImportError as e:
        raise ImportError(
            "a Mooncake store needs the Mooncake transfer engine: pip install 'mmferry[mooncake]' "
            f"(and libibverbs on the library path): {e}"
        ) from None
    return store


@dataclass(frozen=True)
class StoreAddress:
    """A parsed `mooncake://` address."""

    master: str
    metadata: str
    protocol: str = "tcp"
    host: str = ""
    local_bytes: int = 256 << 20
    retry_s: float = 5.0
    lookup_s: float = 1.0
    publish_s: float = 5.0

    @classmethod
    def parse(cls, url: str) -> StoreAddress:
        parts = urlsplit(url)
        if parts.scheme != SCHEME or not parts.hostname or parts.port is None:
            raise ValueError(
                f"a store address is mooncake://MASTER_HOST:PORT?metadata=URL, got {url!r}"
            )
        query = {k: v[-1] for k, v in parse_qs(parts.query, keep_blank_values=True).items()}
        known = {"metadata", "protocol", "host", "local_mib", "retry_s", "lookup_s", "publish_s"}
        unknown = sorted(set(query) - known)
        if unknown:
            raise ValueError(f"unknown store parameter(s) {', '.join(unknown)} in {url!r}")
        if not query.get("metadata"):
            raise ValueError(
                f"the store address needs ?metadata=URL (the metadata server): {url!r}"
            )
        try:
            local = int(query.get("local_mib", 256)) << 20
            retry = float(query.get("retry_s", 5.0))
            lookup = float(query.get("lookup_s", 1.0))
            publish = float(query.get("publish_s", 5.0))
        except ValueError:
            raise ValueError(
                f"local_mib, retry_s, lookup_s and publish_s must be numbers in {url!r}"
            ) from None
        if local <= 0 or retry < 0 or not lookup > 0 or not publish > 0:
            raise ValueError(
                "local_mib, lookup_s and publish_s must be positive and retry_s not negative "
                f"in {url!r}"
            )
        return cls(
            master=f"{parts.hostname}:{parts.port}",
            metadata=query["metadata"],
            protocol=query.get("protocol", "tcp"),
            host=query.get("host", ""),
            local_bytes=local,
            retry_s=retry,
            lookup_s=lookup,
            publish_s=publish,
        )

    def local_host(self) -> str:
        """The address to advertise: `host`, else the local address that routes to the master
        (a UDP socket's connect sends nothing)."""
        if self.host:
            return self.host
        name, port = self.master.rsplit(":", 1)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                s.connect((name, int(port)))
                return s.getsockname()[0]
            except OSError:
                return socket.gethostbyname(socket.gethostname())


def _metadata_answers(url: str) -> None:
    """StoreError unless the HTTP metadata server at `url` answers within PROBE_S (any status:
    a key it lacks is a 404). Other metadata servers (etcd, P2P handshake) are not probed."""
    if not url.startswith(("http://", "https://")):
        return
    try:
        urllib.request.urlopen(f"{url}?key=mmferry-probe", timeout=PROBE_S).close()
    except urllib.error.HTTPError:
        return  # it answered
    except (OSError, ValueError) as e:
        raise StoreError(f"the Mooncake metadata server at {url} does not answer: {e}") from None


class MooncakeStore:
    """One Mooncake client with a breaker: after an error the store is left alone for
    `retry_s` (a master that is down costs a request its timeout once, not every item)."""

    def __init__(self, address: StoreAddress) -> None:
        self.address = address
        store = import_mooncake()
        # NOTE: Mooncake's setup retries an absent master for about 90 s; a refused or silent
        # port fails here within PROBE_S instead.
        name, port = address.master.rsplit(":", 1)
        try:
            socket.create_connection((name, int(port)), timeout=PROBE_S).close()
        except OSError as e:
            raise StoreError(f"cannot reach the Mooncake master at {address.master}: {e}") from None
        # NOTE: Mooncake's setup holds the GIL for as long as it retries (about a minute and a
        # half against a master that accepts connections and never answers), stopping every
        # thread of the process, an engine's scheduler or the service's event loop included.
        # The master's metadata server (embedded in it by default) must answer first.
        _metadata_answers(address.metadata)
        self._client = store.MooncakeDistributedStore()
        # Segment 0: this client lends the store no memory; the holders (mooncake_client) do,
        # so entries outlive an encoder that is killed.
        rc = self._client.setup(
            address.local_host(),
            address.metadata,
            0,
            address.local_bytes,
            address.protocol,
            "",
            address.master,
        )
        if rc != 0:
            raise StoreError(f"cannot reach the Mooncake master at {address.master} (code {rc})")
        self._lock = threading.Lock()
        self._down_until = 0.0
        self.last_error = ""

    def available(self) -> bool:
        """False while the breaker is open (the last error is younger than `retry_s`)."""
        return time.monotonic() >= self._down_until

    def _failed(self, what: str, code: int) -> StoreError:
        with self._lock:
            self.last_error = f"{what} failed with code {code}"
            # Transport and RPC failures (codes from -800 down) mean the store is unreachable:
            # left alone for a while. A full store or a refused key costs only that call.
            if code <= UNREACHABLE:
                self._down_until = time.monotonic() + self.address.retry_s
        return StoreError(self.last_error)

    def _check(self) -> None:
        if not self.available():
            raise StoreError(f"left alone after an error ({self.last_error})")

    def get(self, key: str) -> torch.Tensor | None:
        """The entry's bytes as a uint8 tensor, None when the key is absent; StoreError."""
        self._check()
        size = self._client.get_size(key)
        if size == NOT_FOUND:
            return None
        if size < 0:
            raise self._failed("get_size", size)
        buf = torch.empty(size, dtype=torch.uint8)
        got = self._client.get_into(key, buf.data_ptr(), size)
        if got == NOT_FOUND:  # evicted or removed between the two calls
            return None
        if got < 0:
            raise self._failed("get_into", got)
        return buf[:got]

    def get_into(self, key: str, ptr: int, size: int) -> int:
        """Bytes read into `ptr` (a registered buffer of `size`), 0 when absent; StoreError."""
        self._check()
        got = self._client.get_into(key, ptr, size)
        if got == NOT_FOUND:
            return 0
        if got < 0:
            raise self._failed("get_into", got)
        return got

    def exists(self, key: str) -> bool:
        """Whether `key` is in the store (Mooncake leases it for its lease time); StoreError."""
        self._check()
        rc = self._client.is_exist(key)
        if rc < 0:
            raise self._failed("is_exist", rc)
        return rc == 1

    def register(self, ptr: int, size: int) -> None:
        """Register a host buffer for `get_into` (zero-copy reads into it)."""
        rc = self._client.register_buffer(ptr, size)
        if rc != 0:
            raise StoreError(f"register_buffer failed with code {rc}")

    def unregister(self, ptr: int) -> None:
        self._client.unregister_buffer(ptr)

    def put(self, key: str, parts: list[Any], *, replace: bool = False) -> int:
        """Publish the concatenation of `parts` under `key`; its size; StoreError. Without
        `replace`, a key that exists keeps its value (the first writer's rows)."""
        self._check()
        size = sum(memoryview(p).nbytes for p in parts)
        if size > self.address.local_bytes:
            raise StoreError(
                f"{size} bytes exceed the client's buffer ({self.address.local_bytes})"
            )
        put = self._client.upsert_parts if replace else self._client.put_parts
        rc = put(key, *parts)
        if rc != 0:
            raise self._failed("upsert" if replace else "put", rc)
        return size

    def close(self) -> None:
        self._client.close()
