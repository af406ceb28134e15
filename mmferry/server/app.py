"""The HTTP surface: `POST /v1/encode`, `GET /health`, `GET /metrics` (FastAPI).

Admission comes before the body is read: a wrong API key is 401, a draining server or a full
queue is 503 with Retry-After, a body over the byte limit is 413 as soon as it passes it.
"""

from __future__ import annotations

import hmac
import json
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from mmferry.server.limits import RequestError, too_large
from mmferry.server.service import EncoderService

log = logging.getLogger("mmferry.server")
LOCAL_HOSTS = ("127.0.0.1", "::1", "localhost")
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
    """What the routes share beyond the service: admission count and the draining flag."""

    def __init__(self, service: EncoderService) -> None:
        self.service = service
        self.in_flight = 0
        self.draining = False


def _api_key(headers: Any) -> str:
    auth = headers.get("authorization", "")
    if auth.lower().startswith("bearer "):
        return auth[7:].strip()
    return headers.get("x-api-key", "")


async def _read_body(request: Any, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large("the request body", int(declared), "max_request_bytes", limit)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise too_large("the request body", len(body), "max_request_bytes", limit)
    return bytes(body)


def create_app(service: EncoderService, state: AppState | None = None) -> Any:
    """The FastAPI app serving `service`; `state` lets the runner drain it."""
    fastapi = import_fastapi()
    from fastapi.responses import JSONResponse, Response

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

    def refuse(err: RequestError) -> Any:
        metrics.errors.labels(err.kind).inc()
        metrics.requests.labels(str(err.status)).inc()
        headers = {"Retry-After": RETRY_AFTER_S} if err.status == 503 else None
        body = {"error": {"kind": err.kind, "message": err.message}}
        return JSONResponse(body, status_code=err.status, headers=headers)

    @app.get("/health")
    async def health() -> Any:
        return {
            "status": "draining" if state.draining else "ok",
            "encoder": repr(service.encoder),
            "in_flight": state.in_flight,
            "queue_depth": service.batcher.depth,
            "cache_items": len(service.cache),
            "shm_segment": service.shm_segment,
        }

    @app.get("/metrics")
    async def prometheus() -> Any:
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    async def encode(request: Any) -> Any:
        if cfg.api_key is not None and not hmac.compare_digest(
            _api_key(request.headers).encode(), cfg.api_key.encode()
        ):
            return refuse(RequestError(401, "unauthorized", "missing or wrong API key"))
        if state.draining:
            return refuse(RequestError(503, "draining", "the server is shutting down"))
        if state.in_flight >= cfg.max_queue:
            msg = f"the queue is full ({cfg.max_queue} requests, --max-queue); retry later"
            return refuse(RequestError(503, "queue_full", msg))
        state.in_flight += 1
        metrics.in_flight.set(state.in_flight)
        try:
            with metrics.stage("read"):
                ctype = request.headers.get("content-type", "").split(";")[0].strip()
                if ctype != "application/json":
                    raise RequestError(
                        415, "content_type", f"send application/json, not {ctype or '(none)'!r}"
                    )
                raw = await _read_body(request, cfg.limits.max_request_bytes)
                try:
                    body = json.loads(raw)
                except (json.JSONDecodeError, UnicodeDecodeError) as e:
                    raise RequestError(
                        400, "bad_json", f"the body is not valid JSON ({e})"
                    ) from None
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
    from mmferry.server.ec import add_cache_routes

    add_cache_routes(app, service, state)
    return app
