"""`Upstream`: a request forwarded to the engine, its answer streamed back as it arrives.

The answer is never buffered whole: each chunk the engine writes (an SSE event, or a piece of
a JSON body) goes to the client as it comes. When the client goes away mid-answer, the
upstream response is closed, which closes its connection, and the engine aborts the request.
An engine that cannot be reached is a 502 naming why.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from mmferry.proxy.config import ProxyConfig
from mmferry.server.limits import RequestError

# Headers that belong to one connection (RFC 9110 7.6.1) or that the proxy sets itself.
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
        "content-encoding",
        "accept-encoding",
    }
)


class Upstream:
    """The engine behind the proxy (one OpenAI-compatible server)."""

    def __init__(self, config: ProxyConfig) -> None:
        import httpx

        self.config = config
        # NOTE: the read timeout is per chunk: a long generation that keeps streaming is fine,
        # an engine that stops answering is not.
        self.http = httpx.AsyncClient(
            base_url=config.llm_url,
            timeout=httpx.Timeout(config.llm_timeout_s, connect=config.connect_timeout_s),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
        )
        self._errors = (httpx.TransportError, OSError)

    def headers(self, client_headers: Any) -> dict[str, str]:
        """The client's headers for the engine, less hop-by-hop ones and the proxy's key."""
        out = {k: v for k, v in client_headers.items() if k.lower() not in HOP_BY_HOP}
        if self.config.api_key is not None or self.config.llm_api_key is not None:
            out.pop("authorization", None)
            out.pop("x-api-key", None)
        if self.config.llm_api_key is not None:
            out["authorization"] = f"Bearer {self.config.llm_api_key}"
        out["accept-encoding"] = "identity"  # chunks pass through as the engine wrote them
        return out

    async def send(self, method: str, path: str, query: str, headers: Any, body: bytes) -> Any:
        """The engine's response, its body still to be read; 502 when it cannot be reached."""
        url = path + (f"?{query}" if query else "")
        request = self.http.build_request(method, url, headers=self.headers(headers), content=body)
        try:
            return await self.http.send(request, stream=True)
        except self._errors as e:
            raise RequestError(
                502,
                "llm_unreachable",
                f"the engine at {self.config.llm_url} did not answer: {type(e).__name__}: {e}",
            ) from None

    async def aclose(self) -> None:
        await self.http.aclose()


def response_headers(upstream: Any) -> dict[str, str]:
    """The engine's response headers the client gets (not the hop-by-hop ones)."""
    return {k: v for k, v in upstream.headers.items() if k.lower() not in HOP_BY_HOP}


async def relay(
    upstream: Any, t0: float, on_first: Callable[[float], None], done: Callable[[], Any]
) -> AsyncIterator[bytes]:
    """The engine's body chunk by chunk; `on_first(seconds since t0)` at the first chunk;
    `done()` once, however the stream ends (finished, failed, or the client gone)."""
    first = True
    try:
        async for chunk in upstream.aiter_raw():
            if first and chunk:
                on_first(time.perf_counter() - t0)
                first = False
            yield chunk
    finally:
        await done()
