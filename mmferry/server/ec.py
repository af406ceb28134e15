"""Lookups by item hash for engines' encoder-cache connectors, and the pins that make them safe.

An engine's connector (`mmferry.engines.vllm_connector`) asks, when it schedules an item,
whether the service holds that item's encoder output (`POST /v1/cache/lookup`), and a step
later loads the rows (`POST /v1/cache/load`). Between the two the service's LRU could evict the
entry and fail a request the engine already planned; so a lookup that answers "present" pins
the entry: the service keeps a reference to its rows until they are loaded or a TTL passes,
whatever the LRU does meanwhile. An absent entry is simply reported absent, and the engine
encodes that item itself. `POST /v1/cache/encode` encodes parts like `/v1/encode` but answers
only each item's facts (hash, grid, tokens, video timing) and pins the items for the engine
that will ask.

Bodies:
    lookup  {"hashes": [h, ...]}                        -> {"present": [bool, ...]}
    load    {"hashes": [h, ...], "dtype": "float32", "response": "safetensors" | "shm"}
            -> safetensors with one tensor per hash (`[tokens, out * (1 + levels)]`, i.e.
               `[main | ds0 | ds1 ...]`), or {"items": {h: shm handle}}; 404 naming what is gone
    encode  as /v1/encode                               -> {"items": [facts, ...]}
            facts: modality, hash, grid_thw, num_tokens, timestamps, second_per_grid_t
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from typing import Any

import torch

from mmferry.embed.cache import EncoderCache
from mmferry.encoder.model import VisionOutput
from mmferry.server.bodies import LOCAL_HOSTS, check_caller, parse_json, read_body
from mmferry.server.limits import RequestError

log = logging.getLogger("mmferry.server")
PIN_TTL_S = 60.0
MAX_HASHES = 256  # per lookup or load request
HASH_CHARS = 128


class Pins:
    """Entries a connector was told are present, held until loaded or `ttl_s` has passed.

    Bounded by `max_bytes` of pinned rows beyond what the cache holds; past it a lookup answers
    "absent" (the engine then encodes itself) rather than pinning more."""

    def __init__(self, cache: EncoderCache, *, ttl_s: float = PIN_TTL_S, max_bytes: int) -> None:
        self.cache = cache
        self.ttl_s = ttl_s
        self.max_bytes = max_bytes
        self.used_bytes = 0
        self._pins: OrderedDict[str, tuple[float, VisionOutput, int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._pins)

    def _expire(self, now: float) -> None:
        while self._pins:
            key, (deadline, _, nbytes) = next(iter(self._pins.items()))
            if deadline > now:
                break
            del self._pins[key]
            self.used_bytes -= nbytes

    def pin(self, key: str, out: VisionOutput, now: float | None = None) -> bool:
        """Hold `out` for `key` until taken or expired (a repeated pin extends the deadline)."""
        now = time.monotonic() if now is None else now
        self._expire(now)
        old = self._pins.pop(key, None)
        if old is not None:
            self.used_bytes -= old[2]
        nbytes = sum(t.numel() * t.element_size() for t in (out.embeds, *out.deepstack))
        if self.used_bytes + nbytes > self.max_bytes:
            return False
        self._pins[key] = (now + self.ttl_s, out, nbytes)
        self.used_bytes += nbytes
        return True

    def lookup(self, keys: list[str], now: float | None = None) -> list[bool]:
        """Whether each key is held; every held one is pinned."""
        now = time.monotonic() if now is None else now
        self._expire(now)
        present = []
        for key in keys:
            held = self._pins.get(key)
            out = held[1] if held is not None else self.cache.peek(key)
            present.append(out is not None and self.pin(key, out, now))
        return present

    def take_all(self, keys: list[str], now: float | None = None) -> dict[str, VisionOutput]:
        """Every key's rows, releasing their pins; KeyError naming the missing ones, and then
        nothing is released (the engine will encode those items, or retry)."""
        now = time.monotonic() if now is None else now
        self._expire(now)
        gone = [k for k in keys if k not in self._pins and self.cache.peek(k) is None]
        if gone:
            raise KeyError(gone)
        return {k: self.take(k, now) for k in dict.fromkeys(keys)}

    def take(self, key: str, now: float | None = None) -> VisionOutput | None:
        """The rows for `key` (pinned, else cached), releasing its pin."""
        self._expire(time.monotonic() if now is None else now)
        held = self._pins.pop(key, None)
        if held is not None:
            self.used_bytes -= held[2]
            return held[1]
        return self.cache.peek(key)


def packed(out: VisionOutput, dtype: torch.dtype) -> torch.Tensor:
    """`[main | ds0 | ds1 ...]` in `dtype`, the layout engines take."""
    from mmferry.engines.rows import packed_rows

    return packed_rows(out.embeds, out.deepstack, dtype).contiguous()


def _hashes(body: Any) -> list[str]:
    hashes = body.get("hashes") if isinstance(body, dict) else None
    if not isinstance(hashes, list) or not all(
        isinstance(h, str) and 0 < len(h) <= HASH_CHARS for h in hashes
    ):
        raise RequestError(422, "bad_request", "'hashes' must be a list of item hash strings")
    if len(hashes) > MAX_HASHES:
        raise RequestError(
            413, "too_large", f"{len(hashes)} hashes in one request; at most {MAX_HASHES}"
        )
    return hashes


def facts(item: Any) -> dict[str, Any]:
    """What a router sends the engine instead of the rows: hash, grid, and video timing."""
    return {
        "modality": item.modality,
        "hash": item.hash,
        "grid_thw": list(item.grid_thw),
        "num_tokens": item.num_tokens,
        # Qwen3-VL writes these into the prompt (`<t seconds>`); vLLM needs them with the grid.
        "timestamps": None if item.timestamps is None else list(item.timestamps),
        "second_per_grid_t": item.second_per_grid_t,
    }


async def encode_items(service: Any, body: Any, local: bool) -> tuple[list[Any], list[Any]]:
    """The parts of a /v1/encode body, preprocessed and encoded through the service's batcher
    and cache: (items, outputs), with no response built (the rows stay in the service)."""
    if isinstance(body, dict):
        # The rows stay here (the connector loads them), so the answer's form is not asked.
        body = {k: v for k, v in body.items() if k != "response"}
    items, _, _ = await service.prepare(body, local=local)
    return items, await service.batcher.encode(items)


def add_cache_routes(app: Any, service: Any, state: Any) -> None:
    """Register /v1/cache/lookup, /v1/cache/load and /v1/cache/encode on the service's app."""
    import fastapi
    from fastapi.responses import JSONResponse, Response

    from mmferry.server.service import DTYPES

    cfg = service.config
    pins = Pins(service.cache, max_bytes=cfg.cache_bytes)
    service.pins = pins

    def refused(err: RequestError) -> Any:
        service.metrics.errors.labels(err.kind).inc()
        body = {"error": {"kind": err.kind, "message": err.message}}
        return JSONResponse(body, status_code=err.status)

    async def admitted(request: Any) -> Any:
        """The JSON body, after the same API-key and size checks as /v1/encode."""
        check_caller(request.headers, cfg.api_key, state.draining)
        raw = await read_body(
            request, cfg.limits.max_request_bytes, cfg.body_timeout_s, state.cut_reads
        )
        return parse_json(raw)

    async def lookup(request: Any) -> Any:
        try:
            hashes = _hashes(await admitted(request))
        except RequestError as e:
            return refused(e)
        return {"present": pins.lookup(hashes)}

    async def load(request: Any) -> Any:
        try:
            body = await admitted(request)
            hashes = _hashes(body)
            dtype_name = body.get("dtype", str(service.encoder.dtype).removeprefix("torch."))
            if dtype_name not in DTYPES:
                raise RequestError(422, "bad_request", f"dtype must be one of {tuple(DTYPES)}")
            shm = body.get("response", "safetensors") == "shm"
            local = request.client is not None and request.client.host in LOCAL_HOSTS
            if shm and not service.can_share(local):
                raise RequestError(422, "bad_request", "shm responses need a same-host client")
            try:
                outs = pins.take_all(hashes)
            except KeyError as e:
                msg = f"not held (evicted or never seen): {e.args[0]}"
                raise RequestError(404, "not_found", msg) from None
        except RequestError as e:
            return refused(e)
        rows = {h: packed(out, DTYPES[dtype_name]) for h, out in outs.items()}
        if shm:
            # NOTE: the service's arena, with its TTL for handles nobody opens.
            return {"items": {h: service.share(t) for h, t in rows.items()}}
        from safetensors.torch import save

        return Response(save(rows), media_type="application/vnd.mmferry.safetensors")

    async def encode(request: Any) -> Any:
        try:
            body = await admitted(request)
        except RequestError as e:
            return refused(e)
        # The same admission as /v1/encode, after the body is in (a slow upload holds no
        # slot): this route encodes too, so it shares the queue.
        if state.in_flight >= cfg.max_queue:
            msg = f"the queue is full ({cfg.max_queue} requests, --max-queue); retry later"
            return refused(RequestError(503, "queue_full", msg))
        state.in_flight += 1
        try:
            local = request.client is not None and request.client.host in LOCAL_HOSTS
            items, outs = await encode_items(service, body, local)
        except RequestError as e:
            return refused(e)
        except Exception as e:  # noqa: BLE001 - one failing request must not stop the server
            log.exception("cache encode failed")
            return refused(RequestError(500, "internal", f"{type(e).__name__}: {e}"))
        finally:
            state.in_flight -= 1
        for it, out in zip(items, outs):
            pins.pin(it.hash, out)
        return {"items": [facts(it) for it in items]}

    for route in (lookup, load, encode):
        # NOTE: as in app.py, FastAPI needs the real class to hand the raw request over.
        route.__annotations__["request"] = fastapi.Request
    app.post("/v1/cache/lookup")(lookup)
    app.post("/v1/cache/load")(load)
    app.post("/v1/cache/encode")(encode)
