"""The HTTP surface: `POST /v1/encode`, `GET /health`, `GET /metrics` (FastAPI).

Before the body is read: a wrong API key is 401, a draining server 503 with Retry-After, a
content type other than JSON 415. The body then has `--body-timeout` to arrive in full (408)
and is 413 as soon as it passes the byte limit. Only then is the request admitted (a full queue
is 503): a client that uploads slowly holds no queue slot. A client gone mid-upload is counted
as status 499, kind client_disconnect.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from mmferry.server.bodies import LOCAL_HOSTS, check_caller, linger, parse_json, read_body
from mmferry.server.ec import add_cache_routes
from mmferry.server.limits import RequestError, shown
from mmferry.server.service import EncoderService

log = logging.getLogger("mmferry.server")
RETRY_AFTER_S = "1"


def import_fastapi() -> Any:
    """FastAPI, or an ImportError naming the extra."""
    try:
        import fastapi
    except ImportError:
        raise ImportError(
            "the encoder service needs FastAPI: pip install 'mmferry[server]'"
        ) from None
    return fastapi


class AppState:
    """What the routes share beyond the service: admission and read counts, the drain state."""

    def __init__(self, service: EncoderService) -> None:
        self.service = service
        self.in_flight = 0  # admitted requests
        self.reading = 0  # requests whose body is still arriving (not admitted yet)
        self.draining = False
        # Set at the drain deadline (run.py): bodies still arriving are cut with a 503.
        self.cut_reads = asyncio.Event()


def _check_json_type(content_type: str) -> None:
    """415 unless the media type is JSON in UTF-8 (case-insensitive, as RFC 9110 has it)."""
    media, *params = (p.strip() for p in content_type.split(";"))
    charset = "utf-8"
    for param in params:
        name, _, value = param.partition("=")
        if name.strip().lower() == "charset":
            charset = value.strip().strip('"').lower()
    if media.lower() != "application/json" or charset not in ("utf-8", "utf8"):
        raise RequestError(
            415,
            "content_type",
            f"send application/json in UTF-8, not {shown(content_type or '(none)')}",
        )


def create_app(service: EncoderService, state: AppState | None = None) -> Any:
    """The FastAPI app serving `service`; `state` lets the runner drain it."""
    fastapi = import_fastapi()
    from fastapi.responses import JSONResponse, Response
    from starlette.requests import ClientDisconnect

    state = state or AppState(service)
    metrics = service.metrics
    cfg = service.config

    @asynccontextmanager
    async def lifespan(app: Any) -> AsyncIterator[None]:
        await service.start()
        yield
        await service.close()

    app = fastapi.FastAPI(title="mmferry encoder", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.mmferry = state

    def refuse(err: RequestError, *, close: bool = False) -> Any:
        metrics.errors.labels(err.kind).inc()
        metrics.requests.labels(str(err.status)).inc()
        headers = {"Retry-After": RETRY_AFTER_S} if err.status == 503 else {}
        if close:  # the body was not read: the connection cannot carry another request
            headers["Connection"] = "close"
        body = {"error": {"kind": err.kind, "message": err.message}}
        return JSONResponse(body, status_code=err.status, headers=headers)

    @app.get("/health")
    async def health() -> Any:
        body = {
            "status": "draining" if state.draining else "ok",
            "encoder": repr(service.encoder),
            "in_flight": state.in_flight,
            "reading": state.reading,
            "queue_depth": service.batcher.depth,
            "cache_items": len(service.cache),
            "shm_segment": service.shm_segment,
        }
        # NOTE: 503 while draining, so a load balancer's health check stops sending traffic.
        return JSONResponse(body, status_code=503 if state.draining else 200)

    @app.get("/metrics")
    async def prometheus() -> Any:
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    async def admit(request: Any) -> Any:
        """The parsed JSON body of a request that may run now; RequestError otherwise."""
        check_caller(request.headers, cfg.api_key, state.draining)
        with metrics.stage("read"):
            _check_json_type(request.headers.get("content-type", ""))
            state.reading += 1
            try:
                raw = await read_body(
                    request, cfg.limits.max_request_bytes, cfg.body_timeout_s, state.cut_reads
                )
            finally:
                state.reading -= 1
        # NOTE: no await from here to the in_flight increment, so the drain never sees a
        # request that is neither reading nor in flight. A body that began arriving before
        # the drain is admitted, as the drain lets admitted requests finish.
        body = parse_json(raw)
        if state.in_flight >= cfg.max_queue:
            msg = f"the queue is full ({cfg.max_queue} requests, --max-queue); retry later"
            raise RequestError(503, "queue_full", msg)
        return body

    async def encode(request: Any) -> Any:
        try:
            body = await admit(request)
        except RequestError as e:
            # A refusal before the whole body is in leaves bytes on the connection: close it,
            # after reading what the client is still sending, briefly.
            close = e.kind not in ("bad_json", "queue_full")
            if close:
                await linger(request)
            return refuse(e, close=close)
        except ClientDisconnect:
            # The client hung up mid-upload: its own doing, not a server fault (nginx's 499).
            metrics.errors.labels("client_disconnect").inc()
            metrics.requests.labels("499").inc()
            log.info("client disconnected before its request body arrived")
            return Response(status_code=499)
        state.in_flight += 1
        metrics.in_flight.set(state.in_flight)
        try:
            local = request.client is not None and request.client.host in LOCAL_HOSTS
            result = await service.handle(body, local=local)
        except RequestError as e:
            return refuse(e)
        except Exception as e:  # noqa: BLE001 - one failing request must not stop the server
            log.exception("encode failed")
            return refuse(RequestError(500, "internal", f"{type(e).__name__}: {e}"))
        finally:
            state.in_flight -= 1
            metrics.in_flight.set(state.in_flight)
        metrics.requests.labels("200").inc()
        if isinstance(result.body, bytes):
            return Response(result.body, media_type="application/vnd.mmferry.safetensors")
        return JSONResponse(result.body)

    # NOTE: annotations are strings here (future import); FastAPI needs the real class to
    # hand the raw request over, so it is set before the route is registered.
    encode.__annotations__["request"] = fastapi.Request
    app.post("/v1/encode")(encode)
    # Engines' encoder-cache connectors: lookup by hash, pinned until loaded (server/ec.py).
    add_cache_routes(app, service, state)
    return app
