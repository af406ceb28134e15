"""`Upstream`: a request forwarded to the engine, its answer streamed back as it arrives.

The answer is never buffered whole: each chunk the engine writes (an SSE event, or a piece of
a JSON body) goes to the client as it comes. When the client goes away mid-answer, the
upstream response is closed, which closes its connection, and the engine aborts the request.
An engine that cannot be reached is a 502 naming why.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from mmferry.proxy.config import ProxyConfig
from mmferry.proxy.http import Client, transport_errors
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
        self.config = config
        # NOTE: the read timeout is per chunk: a long generation that keeps streaming is fine,
        # an engine that stops answering is not.
        self.http = Client(
            connect_timeout_s=config.connect_timeout_s, read_timeout_s=config.llm_timeout_s
        )
        self._base = config.llm_url.rstrip("/")
        self._errors = transport_errors()

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
        url = self._base + path + (f"?{query}" if query else "")
        try:
            return await self.http.send(method, url, self.headers(headers), body)
        except self._errors as e:
            raise RequestError(
                502,
                "llm_unreachable",
                f"the engine at {self.config.llm_url} did not answer: {type(e).__name__}: {e}",
            ) from None

    async def aclose(self) -> None:
        await self.http.aclose()


def response_headers(upstream: Any) -> dict[str, str]:
    """The engine's response headers the client gets (not the hop-by-hop ones); a repeated
    header's values joined by commas, in order."""
    out: dict[str, str] = {}
    for k, v in upstream.headers.items():
        name = k.lower()
        if name not in HOP_BY_HOP:
            out[name] = f"{out[name]}, {v}" if name in out else v
    return out


# How much of a stream is read, at most, while looking for its first output.
PEEK_BYTES = 1 << 16


class Answer:
    """The engine's response and its body's chunks, some of them perhaps read already."""

    def __init__(self, response: Any) -> None:
        self.response = response
        self.chunks = response.aiter_raw()
        self.head: list[bytes] = []
        self._verdict: asyncio.Task | None = None

    def failed_before_output(self) -> asyncio.Future:
        """Whether the engine failed the request before generating anything: a 5xx, or a
        stream whose first event with content is an error (vLLM fails a request whose items
        its connector cannot supply that way). What was read is kept for `relay`. One reading
        of the stream, however often it is asked."""
        if self._verdict is None:
            self._verdict = asyncio.ensure_future(self._read_verdict())
        return self._verdict

    async def _read_verdict(self) -> bool:
        status = self.response.status_code
        if status >= 500:
            return True
        kind = self.response.headers.get("content-type", "")
        if status != 200 or not kind.startswith("text/event-stream"):
            return False
        buf = b""
        async for chunk in self.chunks:
            self.head.append(chunk)
            buf += chunk
            *events, buf = buf.replace(b"\r\n", b"\n").split(b"\n\n")
            for event in events:
                verdict = event_verdict(event)
                if verdict is not None:
                    return verdict
            if sum(map(len, self.head)) > PEEK_BYTES:
                return False
        return False

    def whole(self) -> bool:
        """Whether the chunks read so far are the whole body."""
        return self.response.at_eof()

    def arrived(self) -> bool:
        """Whether the whole body is in, so that relaying it waits on nothing."""
        return self.response.arrived()

    async def aclose(self) -> None:
        if self._verdict is not None and not self._verdict.done():
            self._verdict.cancel()
            await asyncio.wait([self._verdict])
        await self.response.aclose()


def event_verdict(event: bytes) -> bool | None:
    """True: an error; False: output (or the stream's end, or not JSON); None: a preamble
    (such as the assistant's role alone), look further."""
    for line in event.split(b"\n"):
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            return False
        try:
            doc = json.loads(data)
        except ValueError:
            return False
        if not isinstance(doc, dict):
            return False
        if "error" in doc:
            return True
        for choice in doc.get("choices") or []:
            delta = choice.get("delta") if isinstance(choice, dict) else None
            # NOTE: only the assistant's role (with empty content) opens a stream; any other
            # delta is a generated token, even one that decodes to "" (part of a character).
            if not isinstance(delta, dict) or "role" not in delta:
                return False
            if choice.get("finish_reason") or choice.get("logprobs"):
                return False
            if any(k not in ("role", "content") and v for k, v in delta.items()):
                return False
            if delta.get("content"):
                return False
    return None


async def _chunks(answer: Answer) -> AsyncIterator[bytes]:
    # NOTE: what the verdict read comes out as one chunk, so that "the chunks read so far"
    # (`Answer.whole`) never leaves some of it behind.
    if answer.head:
        yield b"".join(answer.head)
    async for chunk in answer.chunks:
        yield chunk


async def relay(
    answer: Answer, t0: float, on_first: Callable[[float], None], done: Callable[[], Any]
) -> AsyncIterator[bytes]:
    """The engine's body chunk by chunk; `on_first(seconds since t0)` at the first chunk;
    `done()` once, however the stream ends (finished, failed, or the client gone)."""
    first = True
    try:
        async for chunk in _chunks(answer):
            if first and chunk:
                on_first(time.perf_counter() - t0)
                first = False
            yield chunk
    finally:
        await done()
