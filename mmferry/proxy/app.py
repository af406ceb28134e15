"""The proxy's HTTP surface (Starlette): `POST /v1/chat/completions` with its media encoded by the
encoders; every other route passed to the engine unchanged; `/health` and `/metrics` its own.

A chat request is read by the server's one request path (server/intake.py): API key (401),
drain (503 with Retry-After), a JSON content type (415), `--max-uploads` (503), the body under
its byte limit (413) and `--body-timeout` (408), parsed as JSON (400; large bodies off the event
loop), a client gone mid-upload counted as 499. Every other route and method gets the key, the
drain, the limit and the deadline, and passes its body on as it came, byte for byte. Only then
is a request admitted (past `--max-in-flight`, 503 with Retry-After). A request stays in flight
until its answer has been streamed out, so SIGTERM drains streams too. A client that leaves
before its answer starts cancels its request (server/disconnect.py, counted as 499): the
encoders' requests and the engine's are closed, also while a stream is held back before its
first token. Refusals take the engine's error shape (OpenAI's). With `--name-ahead` a request
whose images the proxy names itself (ahead.py) goes to the engine beside their encode, and the
engine's answer is settled by the encode's before it is streamed.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from mmferry.proxy.ahead import INLINE_CHARS, name_items, nameable, payload_chars, same_item
from mmferry.proxy.config import ProxyConfig
from mmferry.proxy.encoders import EncoderPool
from mmferry.proxy.forward import Answer, Upstream, relay, response_headers
from mmferry.proxy.media import Encoded, Media, as_pixels, by_reference, find_media, rewrite
from mmferry.proxy.metrics import ProxyMetrics
from mmferry.proxy.paths import CanonicalPaths, engine_path, refused_route
from mmferry.server.app import import_fastapi
from mmferry.server.bodies import ReadCut, check_caller, dump_json, linger, read_body
from mmferry.server.disconnect import unless_disconnected
from mmferry.server.hot import HotRoutes
from mmferry.server.intake import Intake
from mmferry.server.limits import RequestError
from mmferry.server.sources import source_policy
from mmferry.server.streamed import Streamed

log = logging.getLogger("mmferry.proxy")
CHAT = "/v1/chat/completions"
METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "HEAD"]


@dataclass(frozen=True)
class Retry:
    """A chat request's next form, for an engine that failed it before any output: its `items`
    sent by reference encoded again by their next encoders (`elsewhere`, with the form after
    it), or as pixels in `body()`."""

    items: int
    body: Callable[[], bytes]
    # None from it: no other encoder holds them all.
    elsewhere: Callable[[], Awaitable[tuple[bytes, Retry | None] | None]] | None = None


# With items named ahead of their encode: given the engine's answer on its way (its headers
# may wait for the engine to plan the request), None (it stands) or the body (and its second
# form) to send instead.
Settle = Callable[["asyncio.Future[Answer]"], Awaitable[tuple[bytes, Retry | None] | None]]


class ProxyState:
    """What the routes share: the encoders, the engine, admission counts, the drain state."""

    def __init__(self, config: ProxyConfig) -> None:
        self.config = config
        self.metrics = ProxyMetrics(config.encoder_urls)
        self.encoders = EncoderPool(config, self.metrics)
        self.upstream = Upstream(config)
        self.policy = source_policy(config.limits)
        self.in_flight = 0  # admitted requests, until their answer has been streamed out
        self.reading = 0  # requests whose body is still arriving
        self.serving = 0  # read, not yet admitted (server/intake.py counts them)
        self.draining = False
        self.cut_reads = ReadCut()  # set at the drain deadline (server/run.py)


class ProxyIntake(Intake):
    """server/intake.py for the proxy: answers counted by route, in the engine's error shape."""

    def __init__(self, state: Any, config: Any, metrics: Any) -> None:
        super().__init__(state, config, metrics)
        self._counters: dict[tuple[str, int], Any] = {}

    def count(self, request: Any, status: int) -> None:
        route = CHAT if request is not None and request.scope["path"] == CHAT else "other"
        counter = self._counters.get((route, status))
        if counter is None:  # NOTE: a labelled child looked up once: labels() costs a request
            counter = self._counters[route, status] = self.metrics.requests.labels(
                route, str(status)
            )
        counter.inc()

    def error_body(self, err: RequestError) -> dict:
        # The engine's error shape (OpenAI's), with the proxy's kind as its type.
        return {"error": {"message": err.message, "type": err.kind, "code": err.status}}


async def _settled(
    sending: Awaitable[Answer], settle: Settle
) -> tuple[Answer | None, tuple[bytes, Retry | None] | None]:
    """The engine's answer and None where `settle` lets it stand; else None (that answer
    closed) and what to send instead."""
    task = asyncio.ensure_future(sending)
    try:
        instead = await settle(task)
    except BaseException:
        await _drop(task)
        raise
    if instead is None:
        return await task, None
    await _drop(task)
    return None, instead


async def _drop(sending: asyncio.Future) -> None:
    """The engine's answer on its way, closed (the engine aborts the request) or never sent."""
    if not sending.done():
        sending.cancel()
        await asyncio.wait([sending])
    if not sending.cancelled() and sending.exception() is None:
        with contextlib.suppress(Exception):
            await sending.result().aclose()


def _answered(verdict: asyncio.Future) -> bool:
    """Whether `Answer.failed_before_output` found output."""
    if not verdict.done() or verdict.cancelled() or verdict.exception() is not None:
        return False
    return not verdict.result()


def create_app(config: ProxyConfig, state: ProxyState | None = None) -> Any:
    """The proxy's ASGI app (Starlette); `state` lets the runner drain it."""
    import_fastapi()  # NOTE: the server extra's check; the routes are Starlette's own
    from starlette.applications import Starlette
    from starlette.middleware import Middleware
    from starlette.requests import ClientDisconnect
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    state = state or ProxyState(config)
    metrics = state.metrics
    intake = ProxyIntake(state, config, metrics)

    @asynccontextmanager
    async def lifespan(app: Any) -> AsyncIterator[None]:
        await state.encoders.start()
        yield
        await state.encoders.close()
        await state.upstream.aclose()
        await intake.json.close()

    async def health(request: Any) -> Any:
        # NOTE: open to probes without the key, so it names no address: the encoders are
        # counted (/metrics names each, --private-metrics puts it behind the key).
        up = sum(v == "up" for v in state.encoders.health().values())
        body = {
            "status": "draining" if state.draining else "ok",
            "mode": config.mode,
            "encoders": {"up": up, "down": len(config.encoder_urls) - up},
            "in_flight": state.in_flight,
            # --name-ahead in force: every encoder has said how it names items, all alike.
            "names_ahead": state.encoders.naming() is not None,
        }
        return JSONResponse(body, status_code=503 if state.draining else 200)

    async def prometheus(request: Any) -> Any:
        if config.private_metrics:
            try:
                check_caller(request.headers, config.api_key, False)
            except RequestError as e:
                return intake.refuse(e, request=request)
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    def admit() -> None:
        """Counts a read request in flight, or refuses it (503) past --max-in-flight."""
        if state.in_flight >= config.max_in_flight:
            msg = f"{config.max_in_flight} requests are in flight (--max-in-flight); retry later"
            raise RequestError(503, "queue_full", msg)
        state.in_flight += 1
        metrics.in_flight.set(state.in_flight)

    async def forward(
        request: Any,
        raw: bytes,
        t0: float,
        again: Retry | None = None,
        settle: Settle | None = None,
    ) -> Any:
        """The engine's answer to `raw`, streamed; the request is in flight (admit) until the
        stream ends. Raises what the engine's connection raises, the request released. With
        `again`, an answer that failed before any output is dropped and `again`'s body sent
        instead (its items as pixels). With `settle` (items named ahead of their encode), the
        engine's answer is dropped where settle says what to send instead."""
        finished = False

        async def finish() -> None:
            nonlocal finished
            if not finished:
                finished = True
                state.in_flight -= 1
                metrics.in_flight.set(state.in_flight)

        async def send(body: bytes) -> Answer:
            return Answer(
                await state.upstream.send(
                    request.method,
                    engine_path(request.scope),
                    request.scope.get("query_string", b"").decode("latin-1"),
                    request.headers,
                    body,
                )
            )

        upstream: Answer | None = None
        try:
            if settle is None:
                upstream = await send(raw)
            else:
                upstream, instead = await _settled(send(raw), settle)
                if instead is not None:
                    raw, again = instead
                    upstream = await send(raw)
            while again is not None and await upstream.failed_before_output():
                # NOTE: an item sent by reference that the engine's connector could not find
                # (its encoder died or dropped it): encoded again by its next encoder, else
                # by the engine from its pixels.
                await upstream.aclose()
                upstream = None
                raw, again = await next_form(again)
                upstream = await send(raw)
        except BaseException:
            if upstream is not None:
                with contextlib.suppress(Exception):
                    await upstream.aclose()
            await finish()
            raise
        assert upstream is not None

        async def done() -> None:
            with contextlib.suppress(Exception):
                await upstream.aclose()  # closes the connection: the engine aborts
            await finish()

        # NOTE: `done` also when the answer never started (the client left first).
        return Streamed(
            upstream.response.status_code,
            response_headers(upstream.response),
            relay(upstream, t0, metrics.ttft_seconds.observe, done),
            upstream.whole,
            done,
            upstream.arrived,
        )

    async def chat(request: Any, body: Any) -> Any:
        """A chat request, read and parsed by intake.py: media encoded, then to the engine."""
        t0 = time.perf_counter()
        # NOTE: no await from intake's count (serving) to admit's (the drain's invariant).
        admit()
        settle = None
        try:
            media = find_media(body, state.policy, config.allow_client_embeds)
            named = await _named_body(body, media)
            if named is None:
                raw, again = await _encoded_body(body, media)
            else:
                raw, again, settle = named
        except BaseException:
            state.in_flight -= 1
            metrics.in_flight.set(state.in_flight)
            raise
        return await forward(request, raw, t0, again, settle)

    async def other(request: Any) -> Any:
        """Any other route or method: its body (if any) passed on byte for byte, whatever its
        content type (an engine's multipart routes included)."""
        t0 = time.perf_counter()
        try:
            check_caller(request.headers, config.api_key, state.draining)
            refusal = refused_route(request.scope["path"], config.pass_routes)
            if refusal is not None:
                raise refusal
            state.reading += 1
            try:
                raw = await read_body(
                    request,
                    config.limits.max_request_bytes,
                    config.body_timeout_s,
                    state.cut_reads,
                )
            finally:
                state.reading -= 1
        except RequestError as e:
            await linger(request)
            return intake.refuse(e, close=True, request=request)
        except ClientDisconnect:
            intake.count(request, 499)
            return Response(status_code=499)
        try:
            # NOTE: no await from the read to the in-flight count (the drain's invariant).
            admit()
            # A client that leaves before the engine's answer closes the engine's request.
            answer = await unless_disconnected(request.receive, forward(request, raw, t0))
        except RequestError as e:
            return intake.refuse(e, request=request)
        except ClientDisconnect:
            metrics.errors.labels("client_disconnect").inc()
            intake.count(request, 499)
            return Response(status_code=499)
        except Exception as e:  # noqa: BLE001 - one failing request must not stop the proxy
            log.exception("proxy request failed")
            err = RequestError(500, "internal", f"{type(e).__name__}: {e}")
            return intake.refuse(err, request=request)
        intake.count(request, answer.status_code)
        return answer

    async def next_form(again: Retry) -> tuple[bytes, Retry | None]:
        """The body to send after the engine failed the one `again` came with."""
        if again.elsewhere is not None:
            log.warning(
                "the engine failed a request whose items went by reference; "
                "encoding them again on their next encoders"
            )
            try:
                moved = await again.elsewhere()
                if moved is not None:
                    return moved
            except RequestError as e:  # an encoder refused an item the first one took
                log.warning("encoding them again failed: %s", e.message)
        log.warning(
            "the engine failed a request whose items went by reference; sending it again with "
            "pixels"
        )
        metrics.items_fallback.labels("engine_lacked").inc(again.items)
        return again.body(), None

    async def _encoded_body(body: Any, media: list[Media]) -> tuple[bytes, Retry | None]:
        """The chat body with its `media` encoded and rewritten (as it came when it has none),
        and, when some items go by reference, how to send it otherwise (`Retry`)."""
        if not media:
            return dump_json(body), None
        answers = await state.encoders.encode(media)
        return dump_json(rewrite(body, media, answers, config.mode)), _retry(body, media, answers)

    def _retry(
        body: Any, media: list[Media], answers: list[Encoded | None], moved: bool = False
    ) -> Retry | None:
        """How to send `body` again when the engine lacks the items `answers` send by
        reference: encoded again by the next encoders (once: not after a move), then as
        pixels. None: no item goes by reference, or not every item can go as pixels."""
        referenced = by_reference(media, answers, config.mode)
        if not referenced or not as_pixels(media):
            # NOTE: an item vLLM cannot read as the encoder did is not sent again as pixels:
            # the engine's own failure is the answer.
            return None

        def pixels() -> bytes:
            return dump_json(rewrite(body, media, answers, config.mode, pixels_only=True))

        async def elsewhere() -> tuple[bytes, Retry | None] | None:
            # NOTE: the encoders that held the items are left out (the engine's connector did
            # not find one of the items, at one of them), so an encoder dead or cut off since
            # its answer costs an encode on the next one, not the engine's own tower. None
            # where one is held by no other: the request goes as pixels, every uuid dropped (a
            # uuid vLLM saw as a grid alone would bring the grid back).
            held = {answers[i].url for i in referenced}  # each referenced item has an answer
            again = await state.encoders.encode([media[i] for i in referenced], held)
            if any(a is None for a in again):
                return None
            metrics.items_moved.inc(len(referenced))
            new = list(answers)
            for i, a in zip(referenced, again):
                new[i] = a
            return dump_json(rewrite(body, media, new, config.mode)), _retry(body, media, new, True)

        return Retry(len(referenced), pixels, None if moved else elsewhere)

    async def _named_body(body: Any, media: list[Media]) -> tuple[bytes, Retry, Settle] | None:
        """With --name-ahead: the chat body with its images named by the proxy, their encode
        started beside it, and how to settle the engine's answer once that encode has
        answered; None when the request goes the usual way (ahead.py says which do)."""
        cfg = state.encoders.naming()
        if cfg is None or not media or not nameable(media):
            return None
        if payload_chars(media) > INLINE_CHARS:
            named = await asyncio.to_thread(name_items, media, cfg)
        else:
            named = name_items(media, cfg)
        if named is None:
            return None
        urls = state.encoders.place(media)
        if urls is None:
            return None
        named = [
            dataclasses.replace(n, ahead=state.encoders.rank(m, u))
            for n, m, u in zip(named, media, urls)
        ]
        encoding = asyncio.ensure_future(state.encoders.encode_named(media, urls, named))
        behind.add(encoding)  # held until it ends, whoever waits for it
        encoding.add_done_callback(behind.discard)
        raw = dump_json(rewrite(body, media, named, config.mode))

        def pixels() -> bytes:
            return dump_json(rewrite(body, media, named, config.mode, pixels_only=True))

        async def settle(sending: asyncio.Future[Answer]) -> tuple[bytes, Retry | None] | None:
            """None: the engine's answer stands (it answered, or the encoder holds every item
            under the proxy's names; an answer that fails before its output is then sent again
            as pixels); else the usual way's body for an encode that did not hold them. The
            encoder's refusal of an item is the client's answer."""

            async def verdict() -> bool:
                # NOTE: shielded: dropping this wait must not cancel the engine's answer.
                answer = await asyncio.shield(sending)
                return await asyncio.shield(answer.failed_before_output())

            first = asyncio.ensure_future(verdict())
            try:
                await asyncio.wait([encoding, first], return_when=asyncio.FIRST_COMPLETED)
                if _answered(first):
                    # The engine answers: it had the rows; the encode ends behind it.
                    encoding.add_done_callback(_ended_behind)
                    return None
                answers = await encoding
            except BaseException:
                encoding.cancel()
                first.cancel()
                raise
            finally:
                if not first.done():
                    first.cancel()  # `sending` itself is the caller's
                    await asyncio.wait([first])
            held = sum(map(same_item, named, answers))
            if held == len(named):
                return None
            metrics.named_ahead.labels("redone").inc(len(named))
            log.warning(
                "%d of %d items named ahead were not held under those names; the request "
                "goes again the usual way",
                len(named) - held,
                len(named),
            )
            return await _encoded_body(body, media)

        return raw, Retry(len(media), pixels), settle

    behind: set[asyncio.Future] = set()  # encodes of items named ahead

    def _ended_behind(task: asyncio.Future) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.warning("an encode ended after the engine's answer failed: %s", task.exception())

    # NOTE: plain Starlette routes, not FastAPI's (its request and response layers, a
    # dependency solver and three middlewares, cost a request more than the proxy's own work).
    chat_route = intake.route(chat)
    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/metrics", prometheus, methods=["GET"]),
        Route(CHAT, chat_route, methods=["POST"]),
        Route("/{path:path}", other, methods=METHODS),
    ]
    # NOTE: routes are matched, and requests forwarded, by the path the engine will route.
    middleware = [Middleware(CanonicalPaths, refuse=intake.refuse)]
    app = Starlette(routes=routes, middleware=middleware, lifespan=lifespan)
    app.state.mmferry = state
    # A chat request whose path is already canonical skips the middleware and the router
    # (the same endpoint either way); any other spelling of it takes them.
    return HotRoutes(app, {("POST", CHAT): chat_route})
