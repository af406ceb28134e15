"""SGLang's encoder routes, so `mmferry serve` stands in for `launch_server --encoder-only`
behind `launch_server --language-only --encoder-urls`: `POST /encode`, `POST
/scheduler_receive_url` (and `GET /health`, app.py's).

`/encode` is one part of a request: some of its images or videos, in prompt order. They go
through the service as any request does (queue, limits, allowed paths and hosts, preprocessing,
batching, the cache and the store), and the part's rows, `[main | deepstack...]` per item one
after another, are pushed to the language side (sglang_push.py) in SGLang's format
(sglang_wire.py). A part mmferry refuses answers the status and message SGLang passes on to its
client, and the receivers get the error form, so nothing waits for rows that will not come.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from mmferry.chat.parts import VIDEO_KEYS
from mmferry.embed.packed import packed_rows
from mmferry.server.intake import Intake
from mmferry.server.limits import RequestError, shown
from mmferry.server.sglang_push import Destinations, Link, Pusher, Unreachable, tcp
from mmferry.server.sglang_wire import DTYPES, MODALITIES, Part, error_message, rows_message

log = logging.getLogger("mmferry.server")

# Per-item keys SGLang adds that change nothing for Qwen-VL: the OpenAI `detail` (Qwen-VL
# sizes images by pixels) and the client's `content_hash` (mmferry hashes what it decodes).
_IGNORED = frozenset({"detail", "content_hash"})
_PART_TYPES = {"IMAGE": "image_url", "VIDEO": "video_url"}


def _bad(message: str) -> RequestError:
    return RequestError(400, "bad_request", message)


@dataclass(frozen=True)
class EncodeRequest:
    """The fields of SGLang's `/encode` body that mmferry uses."""

    part: Part
    items: list[Any]
    # Where the rows go (`prefill_host:embedding_port`, zmq_to_tokenizer); none: the
    # scheduler ranks register theirs (zmq_to_scheduler).
    addresses: list[str]


def _count(body: Mapping[str, Any], name: str, low: int) -> int:
    value = body.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise _bad(f"{name} must be an integer of at least {low}, got {shown(value)}")
    return value


def parse_encode(body: Any) -> EncodeRequest:
    """SGLang's `/encode` body, checked; 400 naming the field otherwise."""
    if not isinstance(body, dict):
        raise _bad("the body must be a JSON object (SGLang's /encode request)")
    req_id = body.get("req_id")
    if not isinstance(req_id, str) or not req_id:
        raise _bad(f"req_id must be a non-empty string, got {shown(req_id)}")
    modality = body.get("modality", "IMAGE")
    if modality not in MODALITIES:
        raise _bad(f"modality must be one of {', '.join(MODALITIES)}, got {shown(modality)}")
    num_parts = _count(body, "num_parts", 1)
    part_idx = _count(body, "part_idx", 0)
    if part_idx >= num_parts:
        raise _bad(f"part_idx {part_idx} is not below num_parts {num_parts}")
    items = body.get("mm_items")
    if not isinstance(items, list) or not items:
        raise _bad(f"mm_items must be a non-empty list, got {shown(items)}")
    ports = body.get("embedding_port")
    addresses: list[str] = []
    if ports is not None:
        host = body.get("prefill_host")
        if not isinstance(host, str) or not host:
            raise _bad(f"prefill_host must be a host name, got {shown(host)}")
        # One port, or one per scheduler rank.
        for port in ports if isinstance(ports, list) else [ports]:
            if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
                raise _bad(f"embedding_port must be a port number (or a list), got {shown(port)}")
            addresses.append(f"{host}:{port}")
        if not addresses:
            raise _bad("embedding_port is an empty list")
    return EncodeRequest(Part(req_id, num_parts, part_idx, modality), items, addresses)


def content_part(modality: str, item: Any, index: int) -> dict[str, Any]:
    """One of SGLang's `mm_items` (a URL string, or `{"url", options...}`) as mmferry's
    content part; its qwen-vl-utils keys (inline or in `preprocess_kwargs`) kept, SGLang's
    `detail` and `content_hash` dropped, anything else refused (it would change the rows)."""
    if modality not in _PART_TYPES:
        raise RequestError(422, "bad_request", f"mmferry encodes images and videos, not {modality}")
    kind = _PART_TYPES[modality]
    if isinstance(item, str):
        return {"type": kind, kind: {"url": item}}
    if not isinstance(item, dict) or not isinstance(item.get("url"), str):
        raise _bad(f"mm_items[{index}] must be a URL or an object with a 'url', got {shown(item)}")
    options = {k: v for k, v in item.items() if k not in _IGNORED and k != "url"}
    extra = options.pop("preprocess_kwargs", None) or {}
    if not isinstance(extra, dict):
        raise _bad(f"mm_items[{index}].preprocess_kwargs must be an object")
    options.update(extra)
    unknown = sorted(set(options) - VIDEO_KEYS)
    if unknown:
        raise RequestError(
            422,
            "bad_request",
            f"mm_items[{index}]: mmferry does not apply {', '.join(map(shown, unknown))}; "
            f"it takes qwen-vl-utils' keys ({', '.join(sorted(VIDEO_KEYS))})",
        )
    return {"type": kind, kind: {"url": item["url"]}, **options}


class SglangRoutes:
    """What the routes share: the service, the pusher (created on the first request, so a
    service without pyzmq serves everything else) and the registered addresses."""

    def __init__(self, service: Any) -> None:
        self.service = service
        self.destinations = Destinations()
        self._pusher: Pusher | None = None
        self._tasks: set[asyncio.Task] = set()
        from prometheus_client import Counter

        self.parts = Counter(
            "mmferry_sglang_parts",
            "parts of SGLang requests, by transfer backend and outcome (sent, refused, failed: "
            "the error form sent; undelivered: no receiver took it)",
            ["backend", "outcome"],
            registry=service.metrics.registry,
        )

    @property
    def pusher(self) -> Pusher:
        if self._pusher is None:
            try:
                self._pusher = Pusher(connect_s=self.service.config.sglang_connect_s)
            except ImportError as e:
                raise RequestError(501, "missing_extra", str(e)) from None
        return self._pusher

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._pusher is not None:
            await asyncio.to_thread(self._pusher.close)

    def _background(self, coro: Any) -> asyncio.Future:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # -- the part's rows -------------------------------------------------------------------

    async def rows(self, req: EncodeRequest) -> tuple[list[bytes | memoryview], int]:
        """The part's two frames and the rows' byte size, through the service's own path."""
        service = self.service
        if service.generic:
            raise RequestError(
                422,
                "unsupported",
                "SGLang's encoder routes carry native families only; this service reads its "
                f"checkpoint ({service.processor.facts.model_type}) through the generic family",
            )
        parts = [content_part(req.part.modality, it, k) for k, it in enumerate(req.items)]
        items, dtype, _ = await service.prepare({"content": parts}, local=False)
        outs = await service.batcher.encode(items)
        with service.metrics.stage("respond"):
            if dtype not in DTYPES:
                dtype = torch.float32
            rows = torch.cat([packed_rows(o.embeds, o.deepstack, dtype) for o in outs])
            timestamps = [it.timestamps for it in items]
            seconds = [it.second_per_grid_t for it in items]
            head, body = rows_message(
                req.part,
                rows,
                [it.grid_thw for it in items],
                video_timestamps=timestamps if all(t is not None for t in timestamps) else None,
                second_per_grid_ts=seconds if all(s is not None for s in seconds) else None,
            )
        return [head, body], rows.numel() * rows.element_size()

    async def _deliver(
        self,
        backend: str,
        addresses: list[str],
        frames: list[Any],
        outcome: str,
        links: list[Link] | None = None,
    ) -> bool:
        """Push `frames` to every address (on `links`, their connections already up, when
        given) and count the part as `outcome`; False (logged, counted as undelivered) if one
        took nothing."""
        pusher = self.pusher
        sends = (
            (pusher.send(k, frames) for k in links)
            if links
            else (pusher.push(a, frames) for a in addresses)
        )
        results = await asyncio.gather(*sends, return_exceptions=True)
        failed = [(a, r) for a, r in zip(addresses, results) if isinstance(r, BaseException)]
        for address, error in failed:
            log.warning("SGLang receiver %s took no message: %s", address, error)
        self.parts.labels(backend, "undelivered" if failed else outcome).inc()
        return not failed

    async def _reach(self, addresses: list[str]) -> list[Link]:
        """Links to every address, their connections up; the first `Unreachable` otherwise
        (the links that did come up closed)."""
        results = await asyncio.gather(
            *(self.pusher.reach(a) for a in addresses), return_exceptions=True
        )
        links = [r for r in results if isinstance(r, Link)]
        errors = [r for r in results if not isinstance(r, Link)]
        if errors:
            for link in links:
                link.close()
            raise errors[0]
        return links

    async def _to_scheduler(self, req: EncodeRequest, frames: list[Any], outcome: str) -> None:
        """In the background: wait for the scheduler ranks' addresses, then push to each. Ranks
        that registered while others never did get the error form, not SGLang's 180 s wait."""
        addresses, complete = await self.destinations.take(req.part.req_id)
        if not complete:
            log.warning("not every SGLang scheduler rank registered for %s", req.part.req_id)
            self.parts.labels("zmq_to_scheduler", "undelivered").inc()
            missing = "not every scheduler rank registered its address in time"
            frames = [error_message(req.part, missing, 504)]
            outcome = "failed"
        if addresses:
            await self._deliver("zmq_to_scheduler", addresses, frames, outcome)

    def _failed(self, req: EncodeRequest, e: Exception) -> tuple[RequestError, list[Any], str]:
        """The answer to a part whose rows failed, the error form for its receivers, and how
        it is counted."""
        if isinstance(e, RequestError):
            return e, [error_message(req.part, e.message, e.status)], "refused"
        log.error("SGLang part %s failed", req.part.req_id, exc_info=e)
        message = f"{type(e).__name__}: {e}"
        return (
            RequestError(500, "internal", message),
            [error_message(req.part, message, 500)],
            "failed",
        )

    async def encode(self, request: Any, body: Any) -> Any:
        req = parse_encode(body)
        self.pusher  # noqa: B018 - 501 before any work when pyzmq is missing
        if req.addresses:
            nbytes = await self._encode_to_tokenizer(req)
        else:
            try:
                frames, nbytes = await self.rows(req)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                error, failure, outcome = self._failed(req, e)
                # The error form too, so a rank already waiting fails now, not at its timeout.
                self._background(self._to_scheduler(req, failure, outcome))
                raise error from None
            self._background(self._to_scheduler(req, frames, "sent"))
        return {"req_id": req.part.req_id, "part_idx": req.part.part_idx, "embedding_size": nbytes}

    async def _encode_to_tokenizer(self, req: EncodeRequest) -> int:
        """`zmq_to_tokenizer`: the part's rows pushed to the addresses `/encode` names; the
        rows' byte size."""
        # NOTE: the connections start now, beside the encode: a receive address this encoder
        # cannot reach (a firewall on the language side, a one-way cut) fails the part within
        # the pusher's `connect_s`, not after the encode and the send's 30 s.
        reach = asyncio.ensure_future(self._reach(req.addresses))
        work = asyncio.ensure_future(self.rows(req))
        links: list[Link] = []
        try:
            await asyncio.wait({reach, work}, return_when=asyncio.FIRST_COMPLETED)
            if not work.done() and reach.exception() is not None:
                work.cancel()  # its rows would go nowhere
            await asyncio.wait({reach, work})
            if reach.exception() is not None:
                self.parts.labels("zmq_to_tokenizer", "undelivered").inc()
                if work.cancelled() or work.exception() is None:
                    raise self._unreachable(reach.exception()) from None
                # The rows failed too: that is the answer (no receiver can hear of it).
                raise self._failed(req, work.exception())[0] from None
            links = reach.result()
            if work.exception() is not None:
                error, failure, outcome = self._failed(req, work.exception())
                # The error form too, so a receiver already waiting fails now, not at its
                # timeout.
                sending, links = links, []
                self._background(
                    self._deliver("zmq_to_tokenizer", req.addresses, failure, outcome, sending)
                )
                raise error from None
            frames, nbytes = work.result()
            sending, links = links, []
            # NOTE: shielded: SGLang's tokenizer cancels its /encode call as soon as the rows
            # reach it, often before the push has returned here; the push and its count go on.
            delivery = self._deliver("zmq_to_tokenizer", req.addresses, frames, "sent", sending)
            if not await asyncio.shield(self._background(delivery)):
                gone = ", ".join(req.addresses)
                raise RequestError(502, "receiver_gone", f"SGLang's receiver ({gone}) took no rows")
            return nbytes
        finally:
            # Cancelled (the caller hung up) or failed before the rows were handed on: nothing
            # runs on, no socket stays open.
            for task in (reach, work):
                task.cancel()
            for link in links:
                link.close()
            if not reach.done():
                reach.add_done_callback(_close_links)

    def _unreachable(self, e: BaseException) -> RequestError:
        if isinstance(e, Unreachable):
            return RequestError(
                502,
                "receiver_unreachable",
                f"this encoder cannot reach SGLang's receive address {e} "
                "(mmferry serve --sglang-connect-timeout)",
            )
        return RequestError(502, "receiver_unreachable", f"{type(e).__name__}: {e}")

    async def scheduler_receive_url(self, request: Any, body: Any) -> Any:
        if not isinstance(body, dict):
            raise _bad("the body must be a JSON object (SGLang's /scheduler_receive_url)")
        req_id, address = body.get("req_id"), body.get("receive_url")
        if not isinstance(req_id, str) or not req_id:
            raise _bad(f"req_id must be a non-empty string, got {shown(req_id)}")
        count = _count(body, "receive_count", 1)
        if not isinstance(address, str):
            raise _bad(f"receive_url must be a host:port string, got {shown(address)}")
        try:
            tcp(address)
        except ValueError as e:
            raise _bad(str(e)) from None
        self.destinations.register(req_id, count, address)
        return None


def _close_links(task: asyncio.Future) -> None:
    if not task.cancelled() and task.exception() is None:
        for link in task.result():
            link.close()


class SglangIntake(Intake):
    """The service's intake, answering refusals in the shape SGLang reads (`message`)."""

    def error_body(self, err: RequestError) -> dict:
        return {"status": "error", "kind": err.kind, "message": err.message}


def add_sglang_routes(app: Any, service: Any, intake: Intake) -> SglangRoutes:
    """SGLang's encoder routes on `app`, read and admitted by `intake`'s path."""
    routes = SglangRoutes(service)
    sglang = SglangIntake(intake.state)
    sglang.json = intake.json  # one JSON child for the app
    app.post("/encode")(sglang.route(routes.encode, encodes=True))
    app.post("/scheduler_receive_url")(sglang.route(routes.scheduler_receive_url))
    return routes
