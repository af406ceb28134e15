"""The HTTP surface: `POST /v1/encode`, the cache routes (ec.py), SGLang's encoder routes
(sglang_routes.py), `GET /health`, `GET /metrics` (FastAPI).

Every POST route's request is read, checked and admitted by one path (intake.py): API key,
drain, content type, body limit and deadline, JSON, then the queue for routes that encode, so a
client that uploads slowly holds no queue slot.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from mmferry.server.bodies import LOCAL_HOSTS, RETRY_AFTER_S, ReadCut
from mmferry.server.ec import add_cache_routes
from mmferry.server.hot import hot_routes
from mmferry.server.intake import Intake
from mmferry.server.service import EncoderService
from mmferry.server.sglang_routes import add_sglang_routes

__all__ = ["RETRY_AFTER_S", "AppState", "create_app", "import_fastapi"]


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
        self.in_flight = 0  # admitted requests of routes that encode
        self.serving = 0  # requests of the other routes, being answered
        self.reading = 0  # requests whose body is still arriving (not admitted yet)
        self.draining = False
        # Set at the drain deadline (run.py): bodies still arriving are cut with a 503.
        self.cut_reads = ReadCut()

    @property
    def busy(self) -> bool:
        """Whether any request is still being read or answered (the drain waits for none)."""
        return bool(self.in_flight or self.serving or self.reading)


def create_app(service: EncoderService, state: AppState | None = None) -> Any:
    """The FastAPI app serving `service`; `state` lets the runner drain it."""
    fastapi = import_fastapi()
    from fastapi.responses import JSONResponse, Response

    state = state or AppState(service)
    metrics = service.metrics

    @asynccontextmanager
    async def lifespan(app: Any) -> AsyncIterator[None]:
        await service.start()
        yield
        await sglang.close()
        await intake.json.close()
        await service.close()

    app = fastapi.FastAPI(title="mmferry encoder", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.mmferry = state

    @app.get("/health")
    async def health() -> Any:
        body = {
            "status": "draining" if state.draining else "ok",
            "encoder": repr(service.encoder),
            "in_flight": state.in_flight,
            "serving": state.serving,
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

    async def encode(request: Any, body: Any) -> Any:
        local = request.client is not None and request.client.host in LOCAL_HOSTS
        result = await service.handle(body, local=local)
        if isinstance(result.body, bytes):
            return Response(result.body, media_type="application/vnd.mmferry.safetensors")
        return result.body

    intake = Intake(state)
    app.post("/v1/encode")(intake.route(encode, encodes=True))
    # Engines' encoder-cache connectors: lookup by hash, pinned until loaded (server/ec.py).
    add_cache_routes(app, service, intake)
    # SGLang's `--language-only --encoder-urls` servers: /encode, /scheduler_receive_url.
    sglang = add_sglang_routes(app, service, intake)
    return hot_routes(app)
