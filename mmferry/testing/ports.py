"""Free loopback ports for the processes a benchmark or test starts."""

from __future__ import annotations

import socket
import threading

# The kernel hands back a port once its probe socket is closed, so two asks in a row can get the
# same one (a Mooncake master given it for two servers fails to start). Ports already given out by
# this process are skipped; the set only grows, and a process asks for a few hundred at most.
_given: set[int] = set()
_lock = threading.Lock()


def free_port() -> int:
    """A loopback port nothing listens on now and this process has not handed out before."""
    with _lock:
        while True:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            if port not in _given:
                _given.add(port)
                return port
