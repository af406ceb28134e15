"""Free loopback ports for the processes a benchmark or test starts, and ports where nothing will
ever answer."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator

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


@contextlib.contextmanager
def unreachable_port(kind: str) -> Iterator[int]:
    """A port on 127.0.0.1 where no peer will ever answer: nothing listens (`refused`), a
    listener whose full accept queue makes the kernel drop every SYN (`silent`, as a firewall
    does), or one that completes TCP's handshake and never speaks (`mute`)."""
    held: list[socket.socket] = []
    try:
        lsock = socket.socket()
        held.append(lsock)
        lsock.bind(("127.0.0.1", 0))
        port = lsock.getsockname()[1]
        if kind == "refused":
            lsock.close()
        elif kind == "silent":
            lsock.listen(0)
            # The accept queue (one connection) full: the kernel drops the next SYNs.
            for _ in range(2):
                c = socket.socket()
                held.append(c)
                c.setblocking(False)
                c.connect_ex(("127.0.0.1", port))
            time.sleep(0.2)
        else:
            lsock.listen(8)
        yield port
    finally:
        for s in held:
            s.close()
