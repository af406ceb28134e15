"""vLLM's own encoder disaggregation front (E + PD), the peer mmferry's proxy is measured against.

Does what vLLM 0.32's example front does (`examples/online_serving/disaggregated_encoder/
disagg_epd_proxy.py` in vLLM's repository, the 1E1PD set-up of `disagg_1e1pd_example.sh`: no
prefill instance), written for mmferry's benchmark rather than copied:
- a chat request's media parts (`image_url`, `audio_url`, `input_audio`) each go to an encoder
  instance as a request of their own (that one part as the only content, `max_tokens` 1, not
  streamed), the instances taken round-robin from the first for every request, all at once;
- any encoder call that raises is a 502, one that answers other than 200 passes its status on;
- then the original request goes to the PD instance unchanged, and its answer is streamed back
  (or returned whole when not streamed).

The encoders are vLLM servers with `--mm-encoder-only` and `ec_role` `ec_producer`; the PD one has
`ec_role` `ec_consumer`, the same connector (ECExampleConnector: one safetensors file per item
hash in a shared folder). The PD instance finds each item by the hash it computes itself from
the pixels, so the front passes nothing but the request. Every other route goes to the PD
instance. Like the example, it neither retries an encoder nor falls back to the pixels.

    python -m mmferry.bench._vllm_epd --encoder URL [--encoder URL ...] --pd URL [--port N]
"""

import argparse
import asyncio
import itertools
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from mmferry.server.bodies import ReadCut
from mmferry.server.run import serve_app

MEDIA = ("image_url", "audio_url", "input_audio")
CHAT = "/v1/chat/completions"


@dataclass
class FrontState:
    """What serve_app's drain reads, and the upstreams."""

    encoders: list[str]
    pd: str
    http: Any = None
    draining: bool = False
    in_flight: int = 0
    reading: int = 0
    cut_reads: ReadCut = field(default_factory=ReadCut)
    calls: int = 0  # encoder requests sent
    failures: int = 0  # requests answered 502 (an encoder raised)


def media_parts(body: dict) -> list[dict]:
    """Every media part of the request's messages, in order."""
    parts = []
    for message in body.get("messages") or []:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):
            parts += [p for p in content if isinstance(p, dict) and p.get("type") in MEDIA]
    return parts


def encoder_requests(body: dict, encoders: list[str]) -> list[tuple[str, dict]]:
    """(encoder URL, request) per media part: one part alone, one token, not streamed."""
    urls = itertools.cycle(encoders)
    return [
        (
            next(urls),
            {
                "model": body.get("model"),
                "messages": [{"role": "user", "content": [part]}],
                "max_tokens": 1,
                "stream": False,
            },
        )
        for part in media_parts(body)
    ]


def create_app(state: FrontState) -> Any:
    import httpx
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, Response, StreamingResponse

    @asynccontextmanager
    async def lifespan(app: Any) -> AsyncIterator[None]:
        timeout = httpx.Timeout(600.0, connect=10.0)
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        state.http = httpx.AsyncClient(timeout=timeout, limits=limits)
        yield
        await state.http.aclose()

    app = FastAPI(lifespan=lifespan, docs_url=None, redoc_url=None)

    def error(status: int, message: str) -> Response:
        body = {"error": {"message": message, "type": "encoder_failed", "code": status}}
        return JSONResponse(body, status_code=status)

    async def encode(body: dict) -> Response | None:
        """The encoder calls of one request; a response to give the client when one failed."""
        calls = encoder_requests(body, state.encoders)
        state.calls += len(calls)
        sent = [state.http.post(f"{url}{CHAT}", json=req) for url, req in calls]
        answers = await asyncio.gather(*sent, return_exceptions=True)
        for (url, _), answer in zip(calls, answers):
            if isinstance(answer, BaseException):
                state.failures += 1
                return error(502, f"encoder {url} failed: {type(answer).__name__}: {answer}")
            if answer.status_code != 200:
                return error(answer.status_code, f"encoder {url}: {answer.text[:500]}")
        return None

    async def to_pd(request: Request, raw: bytes) -> Response:
        headers = {"content-type": request.headers.get("content-type", "application/json")}
        req = state.http.build_request(request.method, state.pd + request.url.path, content=raw,
                                       headers=headers)  # fmt: skip
        upstream = await state.http.send(req, stream=True)
        kind = upstream.headers.get("content-type", "")
        if not kind.startswith("text/event-stream"):
            data = await upstream.aread()
            await upstream.aclose()
            return Response(data, status_code=upstream.status_code, media_type=kind or None)

        async def relay() -> Any:
            try:
                async for chunk in upstream.aiter_raw():
                    yield chunk
            finally:
                await upstream.aclose()

        return StreamingResponse(relay(), status_code=upstream.status_code, media_type=kind)

    @app.post(CHAT)
    async def chat(request: Request) -> Response:
        state.in_flight += 1
        try:
            raw = await request.body()
            try:
                body = json.loads(raw)
            except ValueError as e:
                return error(400, f"the body is not JSON: {e}")
            failed = await encode(body) if media_parts(body) else None
            return failed or await to_pd(request, raw)
        finally:
            state.in_flight -= 1

    @app.get("/health")
    async def health() -> Response:
        return JSONResponse({"encoders": state.encoders, "pd": state.pd})

    @app.get("/metrics")
    async def metrics() -> Response:
        # The two counts the benchmark reads, in Prometheus' text form.
        text = (
            f"epd_front_encoder_calls_total {state.calls}\n"
            f"epd_front_encoder_failures_total {state.failures}\n"
        )
        return Response(text, media_type="text/plain")

    @app.api_route("/{path:path}", methods=["GET", "POST"])
    async def other(request: Request) -> Response:
        return await to_pd(request, await request.body())

    return app


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--encoder", action="append", required=True, help="an encoder-only vLLM")
    p.add_argument("--pd", required=True, help="the ec_consumer vLLM")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    args = p.parse_args(argv)
    state = FrontState([u.rstrip("/") for u in args.encoder], args.pd.rstrip("/"))
    return serve_app(create_app(state), state, args.host, args.port, 10.0, name="vllm-epd-front")


if __name__ == "__main__":
    raise SystemExit(main())
