"""The path a request reaches on the engine, so that the proxy judges the route the engine runs.

The engine (vLLM: FastAPI on uvicorn) routes a request by its percent-decoded path, and httpx,
which forwards it, drops leading slashes and resolves `.` and `..` segments on the way: the
spelling a client sends (`///v1/chat/completions`, `/v1/chat%2Fcompletions`,
`/v1/x/../chat/completions`) is not the route it reaches. So the proxy decodes the path once,
as uvicorn does, collapses repeated slashes, resolves dot segments and drops a trailing slash,
routes by that canonical path, and forwards it percent-encoded again: the engine decodes the
very path the proxy judged, and httpx has nothing left to change in it.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any
from urllib.parse import quote

from mmferry.server.limits import RequestError, shown

_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def canonical(path: str) -> str:
    """`path` (already percent-decoded, as uvicorn hands it over) in the one spelling the proxy
    routes and forwards; 400 for a path no route can be judged by."""
    if not path.startswith("/"):
        raise RequestError(400, "bad_path", f"the request path {shown(path)} must start with '/'")
    control = _CONTROL.search(path)
    if control:
        raise RequestError(
            400,
            "bad_path",
            f"the request path has a control character {control.group()!r} "
            f"(position {control.start()} once percent-decoded)",
        )
    segments: list[str] = []
    for segment in path.split("/"):
        if segment in ("", "."):
            continue
        if segment == "..":
            if segments:
                segments.pop()
            continue
        segments.append(segment)
    return "/" + "/".join(segments)


# vLLM 0.32's routes whose body it reads media from (chat content parts, Responses and
# Anthropic inputs, score and rerank content, Cohere images, pre-rendered multimodal features,
# uploaded audio), other than the chat completions the proxy checks itself. Refused unless the
# operator passes them (--pass-route).
MEDIA_ROUTES = frozenset(
    {
        "/v1/chat/completions/batch",
        "/v1/chat/completions/render",
        "/v1/responses",
        "/v1/responses/render",
        "/v1/messages",
        "/v1/messages/count_tokens",
        "/v1/messages/render",
        "/cohere/v2/chat",
        "/cohere/v2/chat/render",
        "/tokenize",
        "/v1/embeddings",
        "/v2/embed",
        "/pooling",
        "/classify",
        "/score",
        "/v1/score",
        "/rerank",
        "/v1/rerank",
        "/v2/rerank",
        "/inference/v1/generate",
        "/v1/systemone",
        "/invocations",
        "/v1/audio/transcriptions",
        "/v1/audio/translations",
        "/v1/realtime",
    }
)


def refused_route(path: str, passed: tuple[str, ...]) -> RequestError | None:
    """403 for a canonical `path` the engine reads media from that the proxy does not check
    and the operator did not pass; None otherwise."""
    if path not in MEDIA_ROUTES or path in passed:
        return None
    return RequestError(
        403,
        "route_refused",
        f"{path} is not served through this proxy: the engine reads media from its body, which "
        "the proxy does not check; send images and videos to /v1/chat/completions (an operator "
        f"may pass the route on unchecked with --pass-route {path})",
    )


def engine_path(scope: dict[str, Any]) -> str:
    """The path to send the engine for a request whose path is canonical: percent-encoded, so
    that the engine's decoding gives it back exactly."""
    return quote(scope["path"], safe="/")


class CanonicalPaths:
    """ASGI middleware: every HTTP request routed, and later forwarded, by its canonical path;
    `refuse(err)` answers (as an ASGI app) a path that has none."""

    def __init__(self, app: Any, refuse: Callable[[RequestError], Any]) -> None:
        self.app = app
        self.refuse = refuse

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        try:
            path = canonical(scope["path"])
        except RequestError as e:
            if scope["type"] == "websocket":
                await send({"type": "websocket.close", "code": 1008})
                return
            await self.refuse(e)(scope, receive, send)
            return
        scope = {**scope, "path": path, "raw_path": quote(path, safe="/").encode()}
        await self.app(scope, receive, send)
