"""Run the service under uvicorn; SIGTERM or SIGINT drains it before exiting with status 0.

Draining: new requests get 503 with Retry-After (and /health 503) while the listening socket
stays open; admitted requests, and bodies already arriving, may finish until the drain timeout.
Bodies still arriving then get 503, anything still open is cancelled, uvicorn stops and the
lifespan releases the shared-memory arena. A second signal exits at once.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable
from typing import Any

from mmferry.server.app import AppState, create_app
from mmferry.server.heap import fix_malloc_thresholds
from mmferry.server.protocol import header_deadline_protocol
from mmferry.server.service import EncoderService

# Time left after the drain deadline for the answers already written (the 503s of cut uploads).
FLUSH_S = 1.0


def import_uvicorn() -> Any:
    """uvicorn, or an ImportError naming the extra."""
    try:
        import uvicorn
    except ImportError:
        raise ImportError(
            "the encoder service needs uvicorn: pip install 'mmferry[server]'"
        ) from None
    return uvicorn


def serve(service: EncoderService, host: str, port: int, *, log_level: str = "warning") -> int:
    """Serve until a signal, then drain; returns the exit status."""
    fix_malloc_thresholds()  # a long frame list must not grow what the process keeps
    state = AppState(service)
    app = create_app(service, state)
    cfg = service.config

    def header_timeout() -> None:
        service.metrics.errors.labels("header_timeout").inc()
        service.metrics.requests.labels("408").inc()

    return serve_app(
        app,
        state,
        host,
        port,
        cfg.drain_timeout_s,
        name="serve",
        log_level=log_level,
        header_timeout_s=cfg.header_timeout_s,
        on_header_timeout=header_timeout,
    )


def listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (`host`, `port`), 0 for a free port.

    NOTE: created with its protocol named (IPPROTO_TCP): asyncio turns Nagle off
    (TCP_NODELAY) only on connections whose socket says TCP, and an accepted connection takes
    the listening socket's. With Nagle on, a response written in two parts (headers, then the
    body; an SSE event after another) waits for the peer's delayed ACK: about 40 ms a call."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    return sock


def serve_app(
    app: Any,
    state: Any,
    host: str,
    port: int,
    timeout: float,
    *,
    name: str,
    log_level: str = "warning",
    header_timeout_s: float | None = None,
    on_header_timeout: Callable[[], None] = lambda: None,
) -> int:
    """Serve `app` until a signal, then drain it within `timeout` seconds; `state` has the
    drain fields of `AppState` (`draining`, `in_flight`, `reading`, `cut_reads`, and
    `serving` if it has other requests to wait for); `name` is the command printed
    (`mmferry serve`, `mmferry proxy`). With `header_timeout_s`, a request's headers must
    arrive within it (protocol.py; `on_header_timeout` counts each cut)."""
    uvicorn = import_uvicorn()
    sock = listening_socket(host, port)
    bound = sock.getsockname()[1]
    url_host = f"[{host}]" if ":" in host else host

    class DrainingServer(uvicorn.Server):
        loop: asyncio.AbstractEventLoop | None = None
        drain: asyncio.Task | None = None  # held: the loop keeps only a weak reference

        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            self.loop = asyncio.get_running_loop()
            await super().startup(sockets)
            # NOTE: printed only now that the socket listens: clients (and tests) connect
            # as soon as they read it.
            if self.started:
                print(f"mmferry {name}: listening on http://{url_host}:{bound}", flush=True)

        def handle_exit(self, sig: int, frame: Any) -> None:
            # NOTE: uvicorn's own handler re-raises the signal after shutdown, which would end
            # the process with a signal status; a drained service exits 0 instead.
            if state.draining or self.loop is None:
                self.force_exit = state.draining
                self.should_exit = True
                return
            state.draining = True
            # A signal handler may interrupt the loop anywhere: hand the drain to the loop.
            self.loop.call_soon_threadsafe(self._start_drain)

        def _start_drain(self) -> None:
            self.drain = asyncio.ensure_future(self._drain())

        async def _drain(self) -> None:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + timeout
            while busy() and loop.time() < deadline:
                await asyncio.sleep(0.02)
            state.cut_reads.set()
            # NOTE: uvicorn then waits for open connections up to its own graceful timeout
            # before cancelling them: only what is left of the drain timeout, so requests
            # still open (a stalled upload, a long encode) never stretch SIGTERM past it.
            self.config.timeout_graceful_shutdown = max(deadline - loop.time(), FLUSH_S)
            self.should_exit = True

    def busy() -> bool:
        return bool(state.in_flight or state.reading or getattr(state, "serving", 0))

    http: Any = "auto"
    if header_timeout_s is not None:
        http = header_deadline_protocol(header_timeout_s, on_header_timeout)
    config = uvicorn.Config(
        app, http=http, log_level=log_level, lifespan="on", timeout_graceful_shutdown=timeout
    )
    DrainingServer(config).run(sockets=[sock])
    print(f"mmferry {name}: drained, exiting", flush=True)
    return 0
