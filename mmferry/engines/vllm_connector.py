"""`MmferryECConnector`: a vLLM encoder-cache consumer that loads rows from `mmferry serve`.

    vllm serve MODEL --ec-transfer-config '{"ec_connector": "MmferryECConnector",
        "ec_connector_module_path": "mmferry.engines.vllm_connector", "ec_role": "ec_consumer",
        "ec_connector_extra_config": {"url": "http://127.0.0.1:8000"}}'

A request names each item by its mmferry hash (the uuid; vLLM keeps it verbatim as the item's
identifier), or `<hash>@<routing key>` as `mmferry proxy` does, and may carry only its grid.
When vLLM's scheduler meets an item it asks the service (`/v1/cache/lookup`), which pins what
it holds for this connector (`X-Mmferry-Caller`, one random id per connector, sent by scheduler
and workers) and says for how long; the worker
then loads all of a step's items in one request (`/v1/cache/load`: shared-memory handles when
the service is on this host, safetensors otherwise, and safetensors again when a handle does not
open), checks each item's rows against what the model takes (`[planned tokens, hidden * (1 +
deepstack levels)]` in the model's dtype) and copies them once onto its device. A request whose
item a service is still encoding (`mmferry proxy --encode-ahead` forwards a request once its
items are preprocessed, and the tower runs meanwhile) is deferred to a later step, for at most
`timeout_s` from the first such answer; so is one the proxy named ahead of its encode
(`<hash>@<key>+<rank>`, `mmferry proxy --name-ahead`: the request reaches vLLM beside the encode)
while the encoder it went to (that rank among the key's choices, asked first) does not know it
yet. An item the
service lacks, and any lookup that fails (service down or restarting, late, or answering
something else than the protocol), is reported absent, and vLLM encodes that item itself, so
such a request must carry pixels too. A request that carries only an item's grid (no pixels
vLLM could encode) and whose item no service holds is failed on its own before it is scheduled
(vLLM's encoder would otherwise meet an item it has nothing to encode from, and stop the engine);
`mmferry proxy` then sends it again with pixels. A load the scheduler planned that cannot be had
from the service that answered present is asked of the item's other services, then fails the
step naming the items: vLLM (0.32) gives a consumer no way to have them encoded at that point.
Extra config: `url` (or `urls`, several services, as `mmferry proxy --encoder` lists them: each
item is asked for in the order rendezvous hashing of its routing key ranks them, `mmferry.proxy`'s
`Router`, the next one when one is down or lacks it), optional `api_key` (or MMFERRY_API_KEY),
`transport` ("auto" | "shm" | "http" | "mooncake"), `timeout_s` (a worker's load, and the
wait for an item a service is still encoding, 30),
`lookup_timeout_s` (a scheduler's lookup, 1), `rows_at_lookup` (below, false). With
"mooncake" (and `store`: the `mooncake://` address the encoders publish to), items are also
looked for in the store, where the existence check leases them, and read from it straight into
a registered buffer, whichever encoder made them; what the store lacks comes from the service as
with "auto" (`store_model`, `store_family`, `store_dtype`, `store_lease_s`: see `store_reader`).
The store is asked as a service is: each lookup answers within `lookup_timeout_s` or is "absent"
(and the store left alone a moment), and the store's client connects in the background, items
being absent from it until it is up.

An encoder dying between the scheduler's lookup and the worker's load fails the step: vLLM (0.32)
plans the load at the lookup, gives the worker no way to hand an item back to its own encoder
or to fail one request, and stops the engine on the step's error. With `rows_at_lookup: true`
the scheduler takes the rows at the lookup instead (ensure_cache_available, before vLLM plans
anything): an item whose rows it could not take is absent, so vLLM encodes it from its pixels,
or its request alone fails when it carries none, and the worker copies rows the process already
holds (a view of the service's shared memory stays readable after the service is gone). The
worker must then run in the scheduler's process (one worker, vLLM's "uni" executor, as with one
device), and the scheduler's pass waits for the rows (one round trip and a copy per request).

vLLM loads this module by path in its scheduler and worker processes; importing it without
vLLM installed fails with a message naming what to install.
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import torch

try:
    from vllm.distributed.ec_transfer.ec_connector.base import (
        ECConnectorBase,
        ECConnectorMetadata,
        ECConnectorRole,
    )
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        "mmferry.engines.vllm_connector is loaded by vLLM: pip install vllm (0.32 or later)"
    ) from e

from mmferry.engines.cache_client import CacheClient, RowSpec, fetch_rows  # noqa: E402
from mmferry.engines.presence import Presence  # noqa: E402
from mmferry.routing import Router, parse_item_name  # noqa: E402

log = logging.getLogger("mmferry.connector")
LOOPBACK = ("127.0.0.1", "::1", "localhost")
# How long a worker keeps asking a service that does not answer before it asks the item's next
# service: a service that restarted has lost its rows, so waiting longer only stalls the step.
UNREACHABLE_S = 2.0
# The longest a scheduler step with nothing to run waits for the rows its deferred requests
# wait for (build_connector_meta), rather than vLLM's engine loop stepping again at once.
WATCH_S = 0.01
EXTRA_KEYS = (
    "url",
    "urls",
    "api_key",
    "transport",
    "timeout_s",
    "lookup_timeout_s",
    "rows_at_lookup",
)
STORE_KEYS = ("store", "store_model", "store_family", "store_dtype", "store_lease_s")


class _Taken:
    """Rows the scheduler took at the lookup (`rows_at_lookup`) for the worker of its own process,
    by connector (caller id) and identifier, with when each was taken; the worker pops them."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.rows: dict[str, dict[str, tuple[torch.Tensor, float]]] = {}

    def put(self, caller: str, identifier: str, rows: torch.Tensor) -> None:
        with self.lock:
            self.rows.setdefault(caller, {})[identifier] = (rows, time.monotonic())

    def has(self, caller: str, identifier: str) -> bool:
        with self.lock:
            return identifier in self.rows.get(caller, {})

    def pop(self, caller: str, identifier: str) -> torch.Tensor | None:
        with self.lock:
            entry = self.rows.get(caller, {}).pop(identifier, None)
        return None if entry is None else entry[0]

    def expire(self, caller: str, older_than_s: float, keep: set[str]) -> None:
        """Drop what no plan took within `older_than_s` (a request aborted or never scheduled:
        the rows, and the service's lease on them, are not held for ever)."""
        cutoff = time.monotonic() - older_than_s
        with self.lock:
            mine = self.rows.get(caller, {})
            for identifier in [i for i, (_, t) in mine.items() if t < cutoff and i not in keep]:
                del mine[identifier]

    def drop(self, caller: str) -> None:
        with self.lock:
            self.rows.pop(caller, None)


_TAKEN = _Taken()


@dataclass
class MmferryECMetadata(ECConnectorMetadata):
    """The items a worker loads this step (identifier -> planned token count), and the caller
    id the scheduler's lookups pinned them for."""

    items: dict[str, int] = field(default_factory=dict)
    caller: str = ""
    # identifier -> the service (of `urls`) that answered present for it
    owners: dict[str, str] = field(default_factory=dict)


def deepstack_levels(model_config: Any) -> int:
    """The checkpoint's deepstack levels, from its vision config through the family's spec (the
    same table that reads the tower), so no family is named here; 0 for a model mmferry serves
    through the generic family (`get_image_features` rows carry no deepstack)."""
    from mmferry.models.registry import spec_for

    hf = model_config.hf_config
    try:
        spec = spec_for(str(hf.model_type))
    except ValueError:  # no native spec: the generic family's rows
        return 0
    vision = getattr(hf, "vision_config", None)
    vision = vision.to_dict() if hasattr(vision, "to_dict") else dict(vision or {})
    return len(spec.vision_from_hf(vision).deepstack_visual_indexes)


def row_spec(model_config: Any) -> RowSpec:
    """What the model takes per item: `[tokens, hidden * (1 + deepstack levels)]` in its dtype
    (the hidden size is vLLM's)."""
    levels = deepstack_levels(model_config)
    return RowSpec(int(model_config.get_inputs_embeds_size()) * (1 + levels), model_config.dtype)


def store_reader(
    extra: dict[str, Any], model_config: Any, *, lookup_timeout_s: float, connect_wait_s: float
) -> Any:
    """The `transport: mooncake` reader (mmferry/store/engine.py): the store's address, the
    model's identity (`store_model`: NAME@WEIGHTS as `mmferry serve --store` prints it, else
    computed from vLLM's checkpoint folder through `store_family`, the encoders' --family:
    "auto" by default, "generic" for encoders that read a native checkpoint through
    transformers), the rows' dtype in the store (`store_dtype`, the encoders' --dtype; default:
    the model's) and the store's lease (`store_lease_s`); a lookup's deadline, and how long a
    worker's load waits for the client's connect."""
    from mmferry.models.generic import checked_family, uses_generic
    from mmferry.store.engine import LEASE_S, StoreReader, identity_for

    url = extra.get("store")
    if not url or not isinstance(url, str):
        raise ValueError("transport mooncake needs ec_connector_extra_config.store (mooncake://)")
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    dtype = extra.get("store_dtype")
    if dtype is not None and dtype not in dtypes:
        raise ValueError(f"store_dtype must be one of {tuple(dtypes)}, got {dtype!r}")
    family = checked_family(extra.get("store_family", "auto"), "store_family")
    levels = deepstack_levels(model_config)
    folder = str(model_config.model)
    if levels and uses_generic(folder, family):
        # NOTE: `get_image_features` rows carry no deepstack levels; this model takes them.
        raise ValueError(
            f"store_family generic: {model_config.hf_config.model_type} takes {levels} deepstack "
            "levels, which the generic family's rows do not carry"
        )
    return StoreReader(
        url,
        identity_for(str(extra.get("store_model") or folder), family),
        dtype=dtypes[dtype] if dtype else model_config.dtype,
        hidden=int(model_config.get_inputs_embeds_size()),
        deepstack=levels,
        lease_s=_seconds(extra, "store_lease_s", LEASE_S),
        lookup_timeout_s=lookup_timeout_s,
        connect_wait_s=connect_wait_s,
    )


def _seconds(extra: dict[str, Any], key: str, default: float) -> float:
    value = extra.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"ec_connector_extra_config.{key} must be seconds > 0, got {value!r}")
    return float(value)


class MmferryECConnector(ECConnectorBase):
    """Encoder-cache consumer backed by an `mmferry serve` endpoint (see the module doc)."""

    def __init__(self, vllm_config: Any, role: ECConnectorRole) -> None:
        super().__init__(vllm_config=vllm_config, role=role)
        if self.is_producer:
            raise ValueError("MmferryECConnector is a consumer: use ec_role 'ec_consumer'")
        extra = dict(vllm_config.ec_transfer_config.ec_connector_extra_config or {})
        if "pin_ttl_s" in extra:
            raise ValueError(
                "ec_connector_extra_config.pin_ttl_s is gone: the service says how long it "
                "pins each item (pinned_s) and the connector trusts that alone"
            )
        unknown = sorted(set(extra) - set(EXTRA_KEYS) - set(STORE_KEYS))
        if unknown:
            known = ", ".join(EXTRA_KEYS)
            raise ValueError(f"unknown ec_connector_extra_config keys {unknown} (known: {known})")
        urls = _urls(extra)
        transport = extra.get("transport", "auto")
        if transport not in ("auto", "shm", "http", "mooncake"):
            raise ValueError(f"transport must be auto, shm, http or mooncake, got {transport!r}")
        if transport != "mooncake" and set(extra) & set(STORE_KEYS):
            raise ValueError(f"{sorted(set(extra) & set(STORE_KEYS))} need transport mooncake")
        api_key = extra.get("api_key") or os.environ.get("MMFERRY_API_KEY")
        self._timeout_s = _seconds(extra, "timeout_s", 30.0)
        self._at_lookup = extra.get("rows_at_lookup", False)
        if not isinstance(self._at_lookup, bool):
            raise ValueError(f"rows_at_lookup must be true or false, got {self._at_lookup!r}")
        if self._at_lookup:
            _check_one_process(vllm_config.parallel_config)
        # NOTE: one id per connector (the scheduler's); workers get it with each step's plan,
        # so the loads release the very pins the lookups took.
        self._caller = secrets.token_hex(16)
        lookup_timeout_s = _seconds(extra, "lookup_timeout_s", 1.0)
        # Several services (`urls`): each item is looked for in the order `mmferry proxy`'s
        # rendezvous routing ranks them for its hash, the next one when one is down or lacks it.
        self._router = Router(urls)
        self._clients: dict[str, CacheClient] = {}
        self._presences: dict[str, Presence] = {}
        for url in self._router.urls:
            local = urlsplit(url).hostname in LOOPBACK
            # NOTE: with the store, items it lacks still come from the service, as with auto.
            shm = transport == "shm" or (transport in ("auto", "mooncake") and local)
            client = CacheClient(
                url,
                api_key,
                self._timeout_s,
                shm,
                caller=self._caller,
                lookup_timeout_s=lookup_timeout_s,
            )
            self._clients[url] = client
            self._presences[url] = Presence(client, wait_s=self._timeout_s)
        self._asking = ThreadPoolExecutor(len(self._router.urls), "mmferry-lookup")
        self._owners: dict[str, str] = {}  # identifier -> the service that answered present
        self._planned: dict[str, str] = {}  # identifier -> the service its load goes to
        self._rows = row_spec(vllm_config.model_config)
        # transport mooncake: items are also looked for in the store (leased there while
        # trusted) and read from it, whichever encoder published them.
        self._store = None
        self._store_presence = None
        if transport == "mooncake":
            self._store = store_reader(
                extra,
                vllm_config.model_config,
                lookup_timeout_s=lookup_timeout_s,
                connect_wait_s=self._timeout_s,
            )
            self._store_presence = Presence(self._store)
        self._to_load: dict[str, int] = {}
        self._unavailable: set[str] = set()  # requests to fail: an item nobody can supply
        self._deferred: list[str] = []  # items whose requests this pass deferred
        self._taken_planned: set[str] = set()  # taken rows a plan has named (rows_at_lookup)

    # -- scheduler side -------------------------------------------------------------------

    def ensure_cache_available(self, request: Any, num_computed_tokens: int) -> bool:
        """Called before vLLM schedules `request`: False when an item it still needs carries
        no pixels and is not held yet: deferred to a later step while its service is still
        encoding it, else failed at the end of the step (no service holds it)."""
        if self._at_lookup:
            self._take_rows(request, num_computed_tokens)
        needed = [
            f.identifier
            for f in request.mm_features
            if f.mm_position.offset + f.mm_position.length > num_computed_tokens
            and not encodable(f)
        ]
        self._ask(needed)
        deferred = False
        for identifier in needed:
            if self.has_cache_item(identifier):
                continue
            if self._waiting(identifier):
                deferred = True
                self._deferred.append(identifier)
                continue
            if request.request_id not in self._unavailable:
                log.warning(
                    "request %s: item %s carries no pixels and no mmferry service holds it; "
                    "the request fails (send it again with pixels)",
                    request.request_id,
                    identifier,
                )
            self._unavailable.add(request.request_id)
            return False
        return not deferred

    def _take_rows(self, request: Any, num_computed_tokens: int) -> None:
        """(rows_at_lookup) The rows of the request's items that a service holds, taken now,
        before vLLM plans their load; an item whose rows cannot be had stays absent."""
        _TAKEN.expire(self._caller, self._timeout_s, self._taken_planned)
        wanted: dict[str, int] = {}
        for index, f in enumerate(request.mm_features):
            if f.mm_position.offset + f.mm_position.length <= num_computed_tokens:
                continue
            if not _TAKEN.has(self._caller, f.identifier):
                wanted[f.identifier] = request.get_num_encoder_embeds(index)
        if not wanted:
            return
        self._ask(list(wanted))
        by_url: dict[str, dict[str, int]] = {}
        named: dict[str, list[str]] = {}
        for identifier, n in wanted.items():
            item, key, ahead = parse_item_name(identifier)
            if self._store_presence is not None and self._store_presence.has(item):
                continue  # the store outlives the encoder that wrote it: loaded by the worker
            for url in self._choices(key, ahead):
                presence = self._presences[url]
                if presence.has(item):
                    by_url.setdefault(url, {})[item] = n
                    named.setdefault(item, []).append(identifier)
                    break
                if presence.waiting(item):
                    break
        within = min(self._timeout_s, UNREACHABLE_S)
        for url, items in by_url.items():
            try:
                rows = self._fetch_from(url, items, self._caller, within)
            except RuntimeError as e:
                # Absent: vLLM encodes these items itself, or fails their request alone.
                log.warning("mmferry service %s could not give %s: %s", url, list(items), e)
                continue
            for item, got in rows.items():
                for identifier in named[item]:
                    _TAKEN.put(self._caller, identifier, got)

    def _waiting(self, identifier: str) -> bool:
        """Whether a service of the item said in this pass that it is still encoding it."""
        item, key, ahead = parse_item_name(identifier)
        return any(self._presences[url].waiting(item) for url in self._choices(key, ahead))

    def _choices(self, key: str, ahead: int | None) -> list[str]:
        """The services to ask for an item, in order: the router's for its key, the one an
        item named ahead of its encode was sent to first."""
        order = self._router.choices(key)
        if ahead is not None and ahead < len(order):
            order.insert(0, order.pop(ahead))
        return order

    def _ask(self, identifiers: list[str], wait_s: float = 0.0) -> None:
        """A request's items asked of their first-choice services (and the store) together,
        the services side by side: one round trip in the scheduler's step rather than one per
        item. An item its first choice lacks is asked of the next ones by `has_cache_item`.
        `wait_s`: items waited for, asked of their services only, each answering once one is
        held or an encode of one begins or ends (Presence.ask)."""
        if not identifiers:
            return
        items = [parse_item_name(i) for i in identifiers]
        if self._store_presence is not None and not wait_s:
            # As `has_cache_item`: an item the store holds is not asked of (nor pinned by) a
            # service.
            self._store_presence.ask([item for item, _, _ in items])
            items = [i for i in items if not self._store_presence.has(i[0])]
        by_url: dict[str, list[str]] = {}
        ahead: set[str] = set()
        for item, key, rank in items:
            by_url.setdefault(self._choices(key, rank)[0], []).append(item)
            if rank is not None:
                ahead.add(item)
        asks = [(self._presences[url], hashes) for url, hashes in by_url.items()]
        if len(asks) == 1:
            asks[0][0].ask(asks[0][1], ahead, wait_s)
            return
        # Presence.ask never raises; each service has its own client.
        list(self._asking.map(lambda a: a[0].ask(a[1], ahead, wait_s), asks))

    def take_unavailable_requests(self) -> set[str]:
        failed, self._unavailable = self._unavailable, set()
        return failed

    def has_cache_item(self, identifier: str) -> bool:
        item, key, ahead = parse_item_name(identifier)
        if self._store_presence is not None and self._store_presence.has(item):
            return True
        if self._at_lookup:
            return _TAKEN.has(self._caller, identifier)  # nothing left to fail at the load
        for url in self._choices(key, ahead):
            presence = self._presences[url]
            if presence.has(item):
                self._owners[identifier] = url
                return True
            if presence.waiting(item):
                return False  # its encoder has it in hand: the others are not asked
        return False

    def update_state_after_alloc(self, request: Any, index: int) -> None:
        identifier = request.mm_features[index].identifier
        item = parse_item_name(identifier)[0]
        stored = self._store_presence is not None and self._store_presence.claim(item)
        if not stored and self._at_lookup and _TAKEN.has(self._caller, identifier):
            self._taken_planned.add(identifier)
            stored = True
        url = self._owners.pop(identifier, None)
        if url is not None and self._presences[url].claim(item):
            self._planned[identifier] = url
            stored = True
        if stored:
            self._to_load[identifier] = request.get_num_encoder_embeds(index)

    def build_connector_meta(self, scheduler_output: Any) -> MmferryECMetadata:
        meta = MmferryECMetadata(dict(self._to_load), self._caller, dict(self._planned))
        # NOTE: the worker of this process pops each planned taken item within the step; one
        # it has not yet popped is kept from expiry until then.
        self._taken_planned = {i for i in self._taken_planned if _TAKEN.has(self._caller, i)}
        self._to_load.clear()
        self._planned.clear()
        self._owners.clear()
        self._end_pass()
        deferred, self._deferred = self._deferred, []
        if deferred and not getattr(scheduler_output, "total_num_scheduled_tokens", 1):
            # NOTE: a step with nothing to run while requests wait for their rows: vLLM's
            # engine loop would step again at once, a core spinning beside the encoders it
            # waits for; instead the step waits (up to WATCH_S) for their services to hold
            # one or to begin or end an encode. A request that arrives meanwhile waits as long.
            self._ask(deferred, wait_s=WATCH_S)
            self._end_pass()
        return meta

    def _end_pass(self) -> None:
        for presence in self._presences.values():
            presence.end_pass()
        if self._store_presence is not None:
            self._store_presence.end_pass()

    # -- worker side ----------------------------------------------------------------------

    def _device(self) -> torch.device:
        from vllm.platforms import current_platform

        if current_platform.is_cuda_alike():
            return torch.device(current_platform.device_type, current_platform.current_device())
        return torch.device(current_platform.device_type)

    def start_load_caches(self, encoder_cache: dict[str, torch.Tensor], **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, MmferryECMetadata)
        # The services and the store know items by hash; two identifiers of one item (sent
        # through two routes) are loaded once.
        named: dict[str, list[str]] = {}
        need: dict[str, int] = {}
        owners: dict[str, str] = {}
        keys: dict[str, str] = {}
        for identifier, n in meta.items.items():
            if identifier in encoder_cache:
                _TAKEN.pop(meta.caller, identifier)  # rows_at_lookup: not needed after all
                continue
            item, key, _ = parse_item_name(identifier)
            named.setdefault(item, []).append(identifier)
            need[item], keys[item] = n, key
            if identifier in meta.owners:
                owners[item] = meta.owners[identifier]
        if not need:
            return
        device = self._device()
        for item in list(need):
            # rows_at_lookup: rows this process's scheduler took; the one copy, onto the device.
            taken = [_TAKEN.pop(meta.caller, i) for i in named[item]]
            src = next((t for t in taken if t is not None), None)
            if src is not None:
                dst = torch.empty(src.shape, dtype=src.dtype, device=device)
                dst.copy_(src, non_blocking=device.type == "cuda")
                encoder_cache.update(dict.fromkeys(named[item], dst))
                del need[item]
        if not need:
            return
        # NOTE: only what the scheduler found in the store is read from it; an item a service
        # answered for was not there at the lookup, or the store did not answer in time. A
        # worker of its own process (vLLM's CPU default, tensor parallel) would otherwise wait
        # out `timeout_s` on a store it cannot reach, its scheduler having given up in 1 s.
        stored = {h: n for h, n in need.items() if h not in owners}
        if self._store is not None and stored:
            # Straight from the store onto the device; what it lacks comes from the service.
            found = self._store.load(stored, device, self._rows.dtype)
            for item, rows in found.items():
                encoder_cache.update(dict.fromkeys(named[item], rows))
            need = {h: n for h, n in need.items() if h not in found}
            if not need:
                return
        by_url: dict[str, dict[str, int]] = {}
        for h, n in need.items():
            by_url.setdefault(owners.get(h, self._router.urls[0]), {})[h] = n
        failed: dict[str, str] = {}
        for url, items in by_url.items():
            rows = self._fetch(url, items, keys, meta.caller, failed)
            for h, src in rows.items():
                # The one copy: out of the shared-memory view (or parsed bytes) onto the
                # device; the view, and with it the lease, dies here.
                dst = torch.empty(src.shape, dtype=src.dtype, device=device)
                dst.copy_(src, non_blocking=device.type == "cuda")
                encoder_cache.update(dict.fromkeys(named[h], dst))
        if failed:
            # NOTE: vLLM has planned these items as loaded and will not encode them: rows that
            # cannot be had (or do not fit) fail the step, naming them, never enter the cache.
            why = "; ".join(f"{h}: {e}" for h, e in failed.items())
            raise RuntimeError(f"mmferry could not load the planned items {list(failed)}: {why}")

    def _fetch(
        self,
        url: str,
        items: dict[str, int],
        keys: dict[str, str],
        caller: str,
        failed: dict[str, str],
    ) -> dict[str, torch.Tensor]:
        """`items`' checked rows from `url`, the service that answered present; what it cannot
        give is asked of each item's other services in routing order (an item encoded again
        elsewhere after its first encoder died); what none gives goes into `failed`."""
        several = len(self._clients) > 1
        within = min(self._timeout_s, UNREACHABLE_S) if several else self._timeout_s
        got: dict[str, torch.Tensor] = {}
        try:
            got.update(self._fetch_from(url, items, caller, within))
        except RuntimeError as e:
            log.warning("mmferry service %s could not give %s: %s", url, list(items), e)
            if not several:
                raise
            for h, n in items.items():
                why = [f"{url}: {e}"]
                for other in self._router.choices(keys[h]):
                    if other == url:
                        continue
                    try:
                        got.update(self._fetch_from(other, {h: n}, caller, within))
                        break
                    except RuntimeError as again:
                        why.append(f"{other}: {again}")
                else:
                    failed[h] = "; ".join(why)
        return got

    def _fetch_from(
        self, url: str, items: dict[str, int], caller: str, within_s: float
    ) -> dict[str, torch.Tensor]:
        client = self._clients[url]
        client.set_caller(caller)
        return fetch_rows(client, items, self._rows, within_s)

    def save_caches(self, encoder_cache: dict[str, torch.Tensor], mm_hash: str, **kw) -> None:
        return None  # a consumer: the service is the producer

    def shutdown(self) -> None:
        _TAKEN.drop(self._caller)
        self._asking.shutdown(wait=False)
        for client in self._clients.values():
            client.close()
        if self._store is not None:
            self._store.close()


def _check_one_process(parallel: Any) -> None:
    """rows_at_lookup hands rows from the scheduler to the worker within one process."""
    backend = getattr(parallel, "distributed_executor_backend", None)
    if parallel.world_size != 1 or backend not in (None, "uni"):
        raise ValueError(
            "rows_at_lookup needs vLLM's worker in the scheduler's process (one worker, "
            f"distributed_executor_backend 'uni'); this engine has {parallel.world_size} "
            f"worker(s) on {backend!r}"
        )


def encodable(feature: Any) -> bool:
    """Whether vLLM could encode the item itself: it carries pixels or rows, not only a grid
    (`data` is None only for an item vLLM's processor cache holds, pixels included)."""
    data = feature.data
    if data is None:
        return True
    return any(k.startswith("pixel_values") or k.endswith("_embeds") for k in data)


def _urls(extra: dict[str, Any]) -> list[str]:
    """The services: `url`, or the list `urls` (one of the two)."""
    url, urls = extra.get("url"), extra.get("urls")
    if (url is None) == (urls is None):
        raise ValueError("MmferryECConnector needs ec_connector_extra_config.url (or urls)")
    urls = [url] if urls is None else urls
    if not isinstance(urls, list) or not urls or not all(isinstance(u, str) and u for u in urls):
        raise ValueError("ec_connector_extra_config.url must be a URL, urls a list of URLs")
    return urls
