"""`HotRoutes`: the requests of a few routes handed straight to their endpoint, past the
framework's middleware stack and router.

Each layer a request passes (Starlette's error and exception middleware, its router and route
wrapper; FastAPI's own besides) is a coroutine and a wrapped `send` per request: at the proxy,
about a tenth of a four-image chat request's CPU. The endpoints given here answer every
exception themselves (server/intake.py), so those layers do nothing for them. Every other
request, and the lifespan, goes to the app as before.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

Endpoint = Callable[[Any], Awaitable[Any]]


class HotRoutes:
    """An ASGI app: `routes[(method, path)]` run as `await endpoint(request)` then the answer it
    returns, for a request whose decoded path is exactly `path`; anything else to `app`."""

    def __init__(self, app: Any, routes: dict[tuple[str, str], Endpoint]) -> None:
        from starlette.requests import Request

        self.app = app
        self.routes = routes
        self._request = Request

    @property
    def state(self) -> Any:
        """The app's state (the runner drains by it)."""
        return self.app.state

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            endpoint = self.routes.get((scope["method"], scope["path"]))
            if endpoint is not None:
                scope["app"] = self.app  # as the app would set it, for the request's readers
                response = await endpoint(self._request(scope, receive, send))
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def hot_routes(app: Any) -> HotRoutes:
    """`app` (FastAPI's) with its POST routes read by server/intake.py taken past its stack:
    those endpoints answer every exception themselves."""
    routes = {
        ("POST", route.path): route.endpoint
        for route in app.routes
        if "POST" in getattr(route, "methods", ())
        and getattr(getattr(route, "endpoint", None), "answers_all", False)
    }
    return HotRoutes(app, routes)
