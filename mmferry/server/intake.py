"""The one path every POST route's request takes, so that no route can skip a step.

In order: the API key (401) and the drain (503), a JSON content type (415), a free upload slot
(`--max-uploads`, 503), the body read under its byte limit (413) and deadline (408) and parsed
as JSON (400; large bodies in a child process, json_child.py), all the while counted as
"reading" (a drain waits for it, and cuts an upload at its deadline with a 503). A refusal
before the whole body is in reads what the client is still sending, briefly, and closes the
connection; a client gone mid-upload is counted as 499, kind client_disconnect. Only then does
the route's handler run: a route that encodes is admitted first (503 when the queue is full)
and counts as in flight, the others as serving. A client that leaves before its answer cancels
the handler (disconnect.py; 499, client_disconnect). A handler's RequestError is answered with
its status; any other exception is a 500 that leaves the server serving.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from mmferry.server.bodies import (
    RETRY_AFTER_S,
    check_caller,
    check_json_type,
    linger,
    read_body,
)
from mmferry.server.disconnect import unless_disconnected
from mmferry.server.json_child import JsonChild
from mmferry.server.limits import RequestError
from mmferry.server.streamed import Streamed

log = logging.getLogger("mmferry.server")

Handler = Callable[[Any, Any], Awaitable[Any]]


class _Unread(Exception):
    """A refusal before the whole body was read: the connection must be closed."""

    def __init__(self, error: RequestError) -> None:
        super().__init__(error.message)
        self.error = error


class Intake:
    """Reads, checks and admits the requests of one app (`state`: its AppState, or another
    with its counts and drain fields). `config` has `api_key`, `max_uploads`, `limits`,
    `body_timeout_s` (and `max_queue` for routes that encode); `metrics` has `stage`,
    `errors` and `requests`. Both are the service's unless given (the proxy's own)."""

    def __init__(self, state: Any, config: Any = None, metrics: Any = None) -> None:
        self.state = state
        self.config = config if config is not None else state.service.config
        self.metrics = metrics if metrics is not None else state.service.metrics
        self.json = JsonChild()

    def count(self, request: Any, status: int) -> None:
        """Counts one answer; the proxy's subclass labels it by route as well."""
        self.metrics.requests.labels(str(status)).inc()

    def error_body(self, err: RequestError) -> dict:
        """The JSON body of a refusal; the proxy's subclass answers in the engine's shape."""
        return {"error": {"kind": err.kind, "message": err.message}}

    def refuse(self, err: RequestError, *, close: bool = False, request: Any = None) -> Any:
        """The JSON error answer for `err`, counted; `close` when the body was not read."""
        from fastapi.responses import JSONResponse

        self.metrics.errors.labels(err.kind).inc()
        self.count(request, err.status)
        headers = {"Retry-After": RETRY_AFTER_S} if err.status == 503 else {}
        if close:  # the body was not read: the connection cannot carry another request
            headers["Connection"] = "close"
        return JSONResponse(self.error_body(err), status_code=err.status, headers=headers)

    async def body(self, request: Any) -> Any:
        """The parsed JSON body; RequestError, _Unread or ClientDisconnect otherwise."""
        cfg, state = self.config, self.state
        with self.metrics.stage("read"):
            try:
                check_caller(request.headers, cfg.api_key, state.draining)
                check_json_type(request.headers.get("content-type", ""))
                if state.reading >= cfg.max_uploads:
                    msg = f"{cfg.max_uploads} request bodies are arriving (--max-uploads); retry"
                    raise RequestError(503, "uploads_full", msg)
                state.reading += 1
                try:
                    raw = await read_body(
                        request,
                        cfg.limits.max_request_bytes,
                        cfg.body_timeout_s,
                        state.cut_reads,
                        copy=False,
                    )
                except BaseException:
                    state.reading -= 1
                    raise
            except RequestError as e:
                raise _Unread(e) from None
            try:
                return await self.json.parse(raw)
            finally:
                # NOTE: no await from here to the handler's count (in flight or serving), so
                # the drain never sees a request that is neither reading nor counted. A body
                # that began arriving before the drain is answered, as the drain lets counted
                # requests finish.
                state.reading -= 1

    def count_in_flight(self, delta: int) -> None:
        """Admitted encoding work (`--max-queue`, and what a drain waits for): a request of an
        encoding route, or an encode that outlives its answer (server/ec.py)."""
        self.state.in_flight += delta
        self.metrics.in_flight.set(self.state.in_flight)

    def route(self, handler: Handler, *, encodes: bool = False) -> Callable[[Any], Awaitable[Any]]:
        """A FastAPI endpoint running `handler(request, body)` after the checks above; the
        handler returns a Response or a JSON-able value, or raises RequestError."""
        import fastapi
        from fastapi.responses import JSONResponse, Response
        from starlette.requests import ClientDisconnect

        cfg, state, metrics = self.config, self.state, self.metrics

        async def endpoint(request: Any) -> Any:
            try:
                body = await self.body(request)
                if encodes and state.in_flight >= cfg.max_queue:
                    msg = f"the queue is full ({cfg.max_queue} requests, --max-queue); retry later"
                    raise RequestError(503, "queue_full", msg)
            except _Unread as e:
                # A refusal before the whole body is in leaves bytes on the connection: close
                # it, after reading what the client is still sending, briefly.
                await linger(request)
                return self.refuse(e.error, close=True, request=request)
            except RequestError as e:
                return self.refuse(e, request=request)
            except ClientDisconnect:
                # The client hung up mid-upload: its own doing, not a server fault (nginx's 499).
                metrics.errors.labels("client_disconnect").inc()
                self.count(request, 499)
                log.info("client disconnected before its request body arrived")
                return Response(status_code=499)
            if encodes:
                self.count_in_flight(1)
            else:
                state.serving += 1
            try:
                # A client that leaves cancels its request's work (disconnect.py).
                result = await unless_disconnected(request.receive, handler(request, body))
            except RequestError as e:
                return self.refuse(e, request=request)
            except ClientDisconnect:
                metrics.errors.labels("client_disconnect").inc()
                self.count(request, 499)
                log.info("client disconnected before its answer; its work was cancelled")
                return Response(status_code=499)
            except Exception as e:  # noqa: BLE001 - one failing request must not stop the server
                log.exception("%s failed", request.url.path)
                err = RequestError(500, "internal", f"{type(e).__name__}: {e}")
                return self.refuse(err, request=request)
            finally:
                if encodes:
                    self.count_in_flight(-1)
                else:
                    state.serving -= 1
            if not isinstance(result, (Response, Streamed)):
                result = JSONResponse(result)
            self.count(request, result.status_code)  # the proxy relays the engine's status
            return result

        # NOTE: annotations are strings here (future import); FastAPI needs the real class to
        # hand the raw request over, so it is set before the route is registered.
        endpoint.__annotations__["request"] = fastapi.Request
        endpoint.__name__ = getattr(handler, "__name__", "endpoint")
        endpoint.answers_all = True  # type: ignore[attr-defined]  # what hot_routes takes
        return endpoint
