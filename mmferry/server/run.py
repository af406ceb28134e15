"""Run the service under uvicorn; SIGTERM or SIGINT drains it before exiting with status 0.

Draining: new requests get 503 with Retry-After while the listening socket stays open, the
admitted ones finish, then uvicorn stops and the lifespan releases the shared-memory arena.
A second signal exits at once.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

from mmferry.server.app import AppState, create_app
from mmferry.server.service import EncoderService


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
    uvicorn = import_uvicorn()
    state = AppState(service)
    app = create_app(service, state)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    bound = sock.getsockname()[1]
    timeout = service.config.drain_timeout_s

    class DrainingServer(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            # NOTE: uvicorn's own handler re-raises the signal after shutdown, which would end
            # the process with a signal status; a drained service exits 0 instead.
            if state.draining:
                self.force_exit = True
                self.should_exit = True
                return
            state.draining = True
            threading.Thread(target=self._drain, daemon=True).start()

        def _drain(self) -> None:
            deadline = time.monotonic() + timeout
            while state.in_flight and time.monotonic() < deadline:
                time.sleep(0.02)
            self.should_exit = True

    config = uvicorn.Config(
        app, log_level=log_level, lifespan="on", timeout_graceful_shutdown=timeout
    )
    server = DrainingServer(config)
    url_host = f"[{host}]" if ":" in host else host
    print(f"mmferry serve: listening on http://{url_host}:{bound}", flush=True)
    server.run(sockets=[sock])
    print("mmferry serve: drained, exiting", flush=True)
    return 0
