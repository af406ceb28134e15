"""The proxy's HTTP surface (FastAPI): `POST /v1/chat/completions` with its media encoded by the
encoders; every other route passed to the engine unchanged; `/health` and `/metrics` its own.

Before the body is read: a wrong API key is 401, a draining proxy 503 with Retry-After. The
body then has `--body-timeout` to arrive (408) and is 413 past the byte limit; only then is the
request admitted (past `--max-in-flight`, 503 with Retry-After). A request stays in flight until
its answer has been streamed out, so SIGTERM drains streams too.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from mmferry.proxy.config import ProxyConfig
from mmferry.proxy.encoders import EncoderPool
from mmferry.proxy.forward import Upstream, relay, response_headers
from mmferry.proxy.media import find_media, rewrite
from mmferry.proxy.metrics import ProxyMetrics
from mmferry.server.app import RETRY_AFTER_S, import_fastapi
from mmferry.server.bodies import check_caller, linger, parse_json, read_body
from mmferry.server.limits import RequestError
from mmferry.server.sources import source_policy

log = logging.getLogger("mmferry.proxy")
CHAT = "/v1/chat/completions"
METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "HEAD"]


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
        self.draining = False
        self.cut_reads = asyncio.Event()  # set at the drain deadline (server/run.py)


async def encode_all(state: ProxyState, media: list) -> list:
    """Every item encoded in parallel (across encoders); the first refusal cancels the rest."""
    tasks = [asyncio.ensure_future(state.encoders.encode(m)) for m in media]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


def create_app(config: ProxyConfig, state: ProxyState | None = None) -> Any:
    """The proxy's ASGI app (FastAPI); `state` lets the runner drain it."""
    fastapi = import_fastapi()
    from fastapi.responses import JSONResponse, Response, StreamingResponse
    from starlette.background import BackgroundTask
    from starlette.requests import ClientDisconnect

    state = state or ProxyState(config)
    metrics = state.metrics

    @asynccontextmanager
    async def lifespan(app: Any) -> AsyncIterator[None]:
        await state.encoders.start()
        yield
        await state.encoders.close()
        await state.upstream.aclose()

    app = fastapi.FastAPI(title="mmferry proxy", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.mmferry = state

    def refuse(route: str, err: RequestError, *, close: bool = False) -> Any:
        metrics.requests.labels(route, str(err.status)).inc()
        headers = {"Retry-After": RETRY_AFTER_S} if err.status == 503 else {}
        if close:
            headers["Connection"] = "close"
        # The engine's error shape (OpenAI's), with the proxy's kind as its type.
        body = {"error": {"message": err.message, "type": err.kind, "code": err.status}}
        return JSONResponse(body, status_code=err.status, headers=headers)

    @app.get("/health")
    async def health() -> Any:
        body = {
            "status": "draining" if state.draining else "ok",
            "mode": config.mode,
            "llm": config.llm_url,
            "encoders": state.encoders.health(),
            "in_flight": state.in_flight,
        }
        return JSONResponse(body, status_code=503 if state.draining else 200)

    @app.get("/metrics")
    async def prometheus() -> Any:
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    async def admit(request: Any) -> bytes:
        check_caller(request.headers, config.api_key, state.draining)
        state.reading += 1
        try:
            limits = config.limits
            raw = await read_body(
                request, limits.max_request_bytes, config.body_timeout_s, state.cut_reads
            )
        finally:
            state.reading -= 1
        # NOTE: no await from here to the in_flight increment (the drain's invariant).
        if state.in_flight >= config.max_in_flight:
            msg = f"{config.max_in_flight} requests are in flight (--max-in-flight); retry later"
            raise RequestError(503, "queue_full", msg)
        return raw

    async def handle(request: Any) -> Any:
        t0 = time.perf_counter()
        path = request.url.path
        route = CHAT if path == CHAT else "other"
        try:
            raw = await admit(request)
        except RequestError as e:
            close = e.kind not in ("queue_full",)
            if close:
                await linger(request)
            return refuse(route, e, close=close)
        except ClientDisconnect:
            metrics.requests.labels(route, "499").inc()
            return Response(status_code=499)
        state.in_flight += 1
        metrics.in_flight.set(state.in_flight)
        finished = False

        async def finish() -> None:
            nonlocal finished
            if not finished:
                finished = True
                state.in_flight -= 1
                metrics.in_flight.set(state.in_flight)

        try:
            if route == CHAT and request.method == "POST":
                raw = await _encoded_body(raw)
            upstream = await state.upstream.send(
                request.method, path, request.url.query, request.headers, raw
            )
        except RequestError as e:
            await finish()
            return refuse(route, e)
        except Exception as e:  # noqa: BLE001 - one failing request must not stop the proxy
            await finish()
            log.exception("proxy request failed")
            return refuse(route, RequestError(500, "internal", f"{type(e).__name__}: {e}"))
        metrics.requests.labels(route, str(upstream.status_code)).inc()

        async def done() -> None:
            with contextlib.suppress(Exception):
                await upstream.aclose()  # closes the connection: the engine aborts
            await finish()

        body = relay(upstream, t0, metrics.ttft_seconds.observe, done)
        return StreamingResponse(
            body,
            status_code=upstream.status_code,
            headers=response_headers(upstream),
            # NOTE: also when the stream never started (the client left first).
            background=BackgroundTask(done),
        )

    async def _encoded_body(raw: bytes) -> bytes:
        """The chat body with its media encoded and rewritten; as it came when it has none."""
        body = parse_json(raw)
        media = find_media(body, state.policy)
        if not media:
            return raw
        answers = await encode_all(state, media)
        return json.dumps(rewrite(body, media, answers, config.mode)).encode()

    # NOTE: as in server/app.py, FastAPI needs the real class to hand the raw request over.
    handle.__annotations__["request"] = fastapi.Request
    app.api_route("/{path:path}", methods=METHODS)(handle)
    return app
