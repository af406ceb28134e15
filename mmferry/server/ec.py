"""Lookups by item hash for engines' encoder-cache connectors (the pins that make them safe are
server/pins.py's).

An engine's connector (`mmferry.engines.vllm_connector`) asks, when it schedules an item,
whether the service holds that item's encoder output (`POST /v1/cache/lookup`), and a step
later loads the rows (`POST /v1/cache/load`). Between the two the service's LRU could evict the
entry and fail a request the engine already planned; so a lookup that answers "present" pins
the entry for its caller: the service keeps a reference to its rows until that caller loads
them or the pin's lifetime passes, whatever the LRU does meanwhile. The lifetime starts at the
caller's first lookup of the item; a repeated lookup renews it while the cache still holds the
rows (such a pin costs nothing) and never extends it once the rows live only in pins; the
answer says how
long is left (`pinned_s`), and a connector trusts "present" no longer than that, measured from
when it sent the lookup. An absent entry is simply reported absent, and the engine encodes
that item itself. `POST /v1/cache/encode` encodes parts like `/v1/encode` but answers only each
item's facts (hash, grid, tokens, video timing) and pins the items for the engine that will ask;
`held` false means the service could not keep an item's rows (larger than the cache, and the
pins' budget full): send that item's pixels to the engine instead. With `"wait": false` it
answers as soon as every item is preprocessed (its hash, grid and token count known) and encodes
behind the answer, so that the engine reads the request while the tower runs: a lookup of an item
still being encoded answers `pending` (ask again), then present once its rows are held, or absent
if its encode failed. The items still count in `--max-queue` and the drain until encoded. A
service that serves its model through the generic family (the engine plans such items from their
pixels) waits anyway. With `"announced"` (one `{"hash", "grid_thw"}` per part: the names a router
gave the items itself, `mmferry proxy --name-ahead`, before this service read them, while the
engine may already be asking) those names are pending to lookups from the moment the body is
read; an item is held under its name only where the service's own facts are the name's (else
`held` false, its name goes absent, and `mmferry_errors_total{kind="announced_differs"}` counts
it). `GET /v1/cache/processor` answers the settings items are named by (`{"processor": {...}}`,
None for the generic family), behind the API key.

Every route reads its request through `intake.py`, as /v1/encode does (API key, content type,
body limit and deadline, the drain, the same errors); a malformed field is a 422. The caller is
the `X-Mmferry-Caller` header (an opaque id of up to 128 printable ASCII characters, the same
from a connector's scheduler and worker), else the client's address.

Bodies:
    lookup  {"hashes": [h, ...], "wait_ms": 0}  (with wait_ms, while none is held the answer
            waits up to that long for one to be held or any item's encode to begin or end)
            -> {"present": [bool, ...], "pinned_s": [seconds left, 0.0 when absent, ...],
                "pending": [bool: absent now, being encoded: ask again, ...]}
    load    {"hashes": [h, ...], "dtype": "float32", "response": "safetensors" | "shm"}
            -> safetensors with one tensor per hash (`[tokens, out * (1 + levels)]`, i.e.
               `[main | ds0 | ds1 ...]`), or {"items": {h: shm handle}}; 404 naming what is gone;
               the caller's pins on them are released
    encode  as /v1/encode, and "wait": bool (true), "announced": [{"hash", "grid_thw"}, ...]
            -> {"items": [facts, ...]}
            facts: modality, hash, grid_thw, num_tokens, timestamps, second_per_grid_t, held
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from typing import Any

import torch

from mmferry.embed.packed import packed_rows
from mmferry.encoder.model import VisionOutput
from mmferry.server.bodies import LOCAL_HOSTS, check_caller
from mmferry.server.intake import Intake
from mmferry.server.limits import RequestError
from mmferry.server.pins import Pins
from mmferry.server.service import DTYPES, RESPONSES

log = logging.getLogger("mmferry.server")
MAX_HASHES = 256  # per lookup or load request
HASH_CHARS = 128
CALLER_CHARS = 128


def packed(out: VisionOutput, dtype: torch.dtype) -> torch.Tensor:
    """`[main | ds0 | ds1 ...]` in `dtype`, the layout engines take."""
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


def caller_of(request: Any) -> str:
    """Whose pins a request sees: `X-Mmferry-Caller`, else the client's address."""
    given = request.headers.get("x-mmferry-caller", "").strip()
    if given:
        if len(given) > CALLER_CHARS or not given.isascii() or not given.isprintable():
            msg = f"X-Mmferry-Caller must be up to {CALLER_CHARS} printable ASCII characters"
            raise RequestError(422, "bad_request", msg)
        return "id:" + given
    client = request.client
    return "addr:" + (client.host if client is not None else "?")


def facts(item: Any) -> dict[str, Any]:
    """What a router sends the engine instead of the rows: hash, grid, and video timing;
    `pixels`: whether the engine must be given the item's pixels too (it plans the rows from
    them and loads them by uuid), as for the generic family, which vLLM takes no grid of."""
    grid = item.grid_thw
    return {
        "modality": item.modality,
        "hash": item.hash,
        "grid_thw": None if grid is None else list(grid),
        "pixels": getattr(item, "engine_needs_pixels", False),
        "num_tokens": item.num_tokens,
        # Qwen3-VL writes these into the prompt (`<t seconds>`); vLLM needs them with the grid.
        "timestamps": None if item.timestamps is None else list(item.timestamps),
        "second_per_grid_t": item.second_per_grid_t,
    }


async def prepare_items(service: Any, body: Any, local: bool) -> list[Any]:
    """The parts of a /v1/cache/encode body, preprocessed (not encoded yet)."""
    if isinstance(body, dict):
        # The rows stay here (the connector loads them), so the answer's form is not asked;
        # `wait` is this route's own.
        body = {k: v for k, v in body.items() if k not in ("response", "wait", "announced")}
    items, _, _ = await service.prepare(body, local=local)
    return items


def _announced(body: Any) -> list[tuple[str, list[int]]] | None:
    """The hash and grid the caller named each part by, ahead of this encode (`announced`),
    or None when it named none."""
    given = body.get("announced") if isinstance(body, dict) else None
    if given is None:
        return None
    content = body.get("content")
    msg = (
        "'announced' must list, for each part of 'content', the item's "
        '{"hash": str, "grid_thw": [t, h, w]}'
    )
    if not isinstance(given, list) or not isinstance(content, list) or len(given) != len(content):
        raise RequestError(422, "bad_request", msg)
    out = []
    for a in given:
        h = a.get("hash") if isinstance(a, dict) else None
        grid = a.get("grid_thw") if isinstance(a, dict) else None
        if not (isinstance(h, str) and 0 < len(h) <= HASH_CHARS) or not (
            isinstance(grid, list)
            and len(grid) == 3
            and all(isinstance(n, int) and not isinstance(n, bool) for n in grid)
        ):
            raise RequestError(422, "bad_request", msg)
        out.append((h, grid))
    return out


def _as_announced(item: Any, announced: tuple[str, list[int]]) -> bool:
    """Whether `item` is the one its caller named: the same hash and grid (so the rows fit
    the prompt the engine planned from the caller's facts)."""
    grid = None if item.grid_thw is None else list(item.grid_thw)
    pixels = getattr(item, "engine_needs_pixels", False)
    return not pixels and (item.hash, grid) == tuple(announced)


MAX_WAIT_MS = 1000  # a lookup's longest wait for a change


def _wait_ms(body: Any) -> int:
    wait = body.get("wait_ms", 0) if isinstance(body, dict) else 0
    if not isinstance(wait, int) or isinstance(wait, bool) or not 0 <= wait <= MAX_WAIT_MS:
        msg = f"'wait_ms' must be a whole number of milliseconds from 0 to {MAX_WAIT_MS}"
        raise RequestError(422, "bad_request", msg)
    return wait


def _wait(body: Any) -> bool:
    wait = body.get("wait", True) if isinstance(body, dict) else True
    if not isinstance(wait, bool):
        raise RequestError(422, "bad_request", "'wait' must be true or false")
    return wait


def _choice(body: dict[str, Any], name: str, default: str, allowed: Any) -> str:
    """The body's `name` field, or `default`; 422 unless it is one of `allowed`."""
    value = body.get(name, default)
    if not isinstance(value, str) or value not in allowed:
        raise RequestError(422, "bad_request", f"{name!r} must be one of {tuple(allowed)}")
    return value


def add_cache_routes(app: Any, service: Any, intake: Intake) -> None:
    """Register /v1/cache/lookup, /v1/cache/load and /v1/cache/encode on the service's app,
    each read and admitted by `intake` as /v1/encode is."""
    import fastapi
    from fastapi.responses import Response

    pins = Pins(service.cache, max_bytes=service.config.cache_bytes)
    service.pins = pins

    async def lookup(request: Any, body: Any) -> Any:
        hashes = _hashes(body)
        wait_s = _wait_ms(body) / 1000
        caller = caller_of(request)

        def answers() -> tuple[list[float], list[bool]]:
            left = pins.lookup(hashes, caller)
            return left, [s <= 0 and pins.pending(h) for h, s in zip(hashes, left)]

        left, pending = answers()
        if wait_s > 0 and not any(s > 0 for s in left):
            # Nothing held yet: the answer waits for one to be held or for any item's encode
            # to begin or end (a connector whose engine has nothing else to do asks so,
            # rather than asking again every scheduler pass).
            deadline = time.monotonic() + wait_s
            before = pending
            while (remaining := deadline - time.monotonic()) > 0:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(pins.changed(), remaining)
                left, pending = answers()
                if any(s > 0 for s in left) or pending != before:
                    break
        present = sum(s > 0 for s in left)
        service.metrics.lookups.labels("present").inc(present)
        service.metrics.lookups.labels("pending").inc(sum(pending))
        service.metrics.lookups.labels("absent").inc(len(left) - present - sum(pending))
        return {
            "present": [s > 0 for s in left],
            "pinned_s": [round(s, 3) for s in left],
            "pending": pending,
        }

    async def load(request: Any, body: Any) -> Any:
        hashes = _hashes(body)
        default = str(service.encoder.dtype).removeprefix("torch.")
        dtype = DTYPES[_choice(body, "dtype", default, DTYPES)]
        shm = _choice(body, "response", "safetensors", RESPONSES) == "shm"
        local = request.client is not None and request.client.host in LOCAL_HOSTS
        if shm and not service.can_share(local):
            raise RequestError(422, "bad_request", "shm responses need a same-host client")
        try:
            outs = pins.take_all(hashes, caller_of(request))
        except KeyError as e:
            msg = f"not held (evicted or never seen): {e.args[0]}"
            raise RequestError(404, "not_found", msg) from None
        rows = {h: packed(out, dtype) for h, out in outs.items()}
        if shm:
            # NOTE: the service's arena, with its TTL for handles nobody opens.
            return {"items": {h: service.share(t) for h, t in rows.items()}}
        from safetensors.torch import save

        return Response(save(rows), media_type="application/vnd.mmferry.safetensors")

    behind: set[asyncio.Task] = set()  # encodes answered before their rows

    async def encode(request: Any, body: Any) -> Any:
        local = request.client is not None and request.client.host in LOCAL_HOSTS
        wait = _wait(body)
        announced = _announced(body)
        if announced is not None:
            return await encode_announced(body, announced, local)
        items = await prepare_items(service, body, local)
        if not wait and not any(getattr(it, "engine_needs_pixels", False) for it in items):
            encode_behind(items)
            with service.metrics.stage("respond"):
                return {"items": [{**facts(it), "held": True} for it in items]}
        held = await encoded_and_held(items)
        with service.metrics.stage("respond"):
            return {"items": [{**facts(it), "held": held[it.hash]} for it in items]}

    async def encoded_and_held(items: list[Any]) -> dict[str, bool]:
        """`items` encoded and their rows pinned for the engine that will ask: whether the
        service holds each (by hash)."""
        outs = await service.batcher.encode(items) if items else []
        return {it.hash: pins.hold(it.hash, out) for it, out in zip(items, outs)}

    async def encode_announced(
        body: Any, announced: list[tuple[str, list[int]]], local: bool
    ) -> dict[str, Any]:
        """An encode whose items the caller named ahead (and whose engine may already be asking
        for them): pending to lookups from the moment the body is read, held only where the
        service's own facts are the caller's; an item that differs is not held (the caller
        sends its pixels) and its announced hash goes absent."""
        keys = [h for h, _ in announced]
        pins.begin_encoding(keys)
        try:
            items = await prepare_items(service, body, local)
            same = [_as_announced(it, a) for it, a in zip(items, announced)]
            for it, a, ok in zip(items, announced, same):
                if not ok:
                    service.metrics.errors.labels("announced_differs").inc()
                    log.warning(
                        "an item named ahead as %s %s is %s %s here: not held under that name",
                        *a,
                        it.hash,
                        None if it.grid_thw is None else list(it.grid_thw),
                    )
            held = await encoded_and_held([it for it, ok in zip(items, same) if ok])
            with service.metrics.stage("respond"):
                return {
                    "items": [
                        {**facts(it), "held": ok and held[it.hash]} for it, ok in zip(items, same)
                    ]
                }
        finally:
            # NOTE: no await between the holds and this: a lookup sees pending or held.
            pins.end_encoding(keys)

    def encode_behind(items: list[Any]) -> None:
        """Encode `items` after their answer: pending to lookups until their rows are held (or
        the encode failed), counted in the queue and the drain until then."""
        keys = [it.hash for it in items]
        pins.begin_encoding(keys)
        intake.count_in_flight(1)

        async def run() -> None:
            try:
                await encoded_and_held(items)
            except Exception as e:  # noqa: BLE001 - no client waits: lookups say absent
                log.warning("encoding %d items behind their answer failed: %s", len(items), e)
            finally:
                # NOTE: no await between the hold and this: a lookup sees pending or held.
                pins.end_encoding(keys)
                intake.count_in_flight(-1)

        task = asyncio.ensure_future(run())
        behind.add(task)
        task.add_done_callback(behind.discard)

    async def processor(request: Any) -> Any:
        """The settings items are named by (their hash and grid), for a router that names them
        itself ahead of the encode (`mmferry proxy --name-ahead`); None for a generic-family
        service, whose items the engine plans from their pixels."""
        try:
            check_caller(request.headers, service.config.api_key, False)
        except RequestError as e:
            return intake.refuse(e, request=request)
        cfg = None if service.generic else dataclasses.asdict(service.processor.config)
        return {"processor": cfg}

    # NOTE: FastAPI needs the real class to hand the raw request over (as server/app.py).
    processor.__annotations__["request"] = fastapi.Request
    app.get("/v1/cache/processor")(processor)
    app.post("/v1/cache/lookup")(intake.route(lookup))
    app.post("/v1/cache/load")(intake.route(load))
    # It encodes too, so it shares /v1/encode's queue.
    app.post("/v1/cache/encode")(intake.route(encode, encodes=True))
