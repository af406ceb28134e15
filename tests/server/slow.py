"""Slow peers of the service, over real sockets: an origin and an uploading client.

`SlowOrigin` is an HTTP origin in a thread for the remote fetches. Routes: `/img.png` answers at
once; `/gate.png` answers once `gate` is set; `/stall` sends nothing for a minute; `/drip` sends
one byte every `DRIP_S` seconds for a minute. It counts the requests it holds at once (`peak`),
so a test can check the fetch concurrency: a request whose client has closed its connection is
not counted, even before the thread serving it has noticed. `RawUpload` sends a body slowly,
or never.
"""

from __future__ import annotations

import http.server
import select
import socket
import threading
import time
from urllib.parse import urlsplit

DRIP_S = 0.25
HOLD_S = 60.0


def _hung_up(conn: socket.socket) -> bool:
    """Whether the peer has closed `conn` (its end read, nothing consumed)."""
    try:
        readable, _, _ = select.select([conn], [], [], 0)
        return bool(readable) and not conn.recv(1, socket.MSG_PEEK)
    except (OSError, ValueError):
        return True  # closed here meanwhile


class SlowOrigin:
    """`with SlowOrigin(png) as o:` serves on 127.0.0.1 at `o.host` until the block ends."""

    def __init__(self, image: bytes) -> None:
        self.image = image
        self.gate = threading.Event()
        self.closing = threading.Event()
        self.held = 0
        self.peak = 0
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        origin = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                with origin._lock:
                    # NOTE: a fetcher that gave up closes its connection before it opens the
                    # next one; the thread serving the old one may not have woken to see it yet.
                    origin._open = {c for c in origin._open if not _hung_up(c)}
                    origin._open.add(self.connection)
                    origin.held = len(origin._open)
                    origin.peak = max(origin.peak, origin.held)
                try:
                    origin._route(self)
                except OSError:
                    pass  # the fetcher gave up and closed the connection
                finally:
                    with origin._lock:
                        origin._open.discard(self.connection)
                        origin.held = len(origin._open)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.host = f"127.0.0.1:{self.server.server_address[1]}"

    def _route(self, h: http.server.BaseHTTPRequestHandler) -> None:
        if h.path == "/gate.png":
            self.gate.wait(HOLD_S)
        elif h.path == "/stall":
            self._hold(h, HOLD_S)
            return
        if h.path in ("/img.png", "/gate.png"):
            h.send_response(200)
            h.send_header("Content-Length", str(len(self.image)))
            h.end_headers()
            h.wfile.write(self.image)
            return
        if h.path == "/drip":
            n = int(HOLD_S / DRIP_S)
            h.send_response(200)
            h.send_header("Content-Length", str(n))
            h.end_headers()
            for _ in range(n):
                h.wfile.write(b"x")
                h.wfile.flush()
                if self._hold(h, DRIP_S):
                    return
            return
        h.send_error(404)

    def _hold(self, h: http.server.BaseHTTPRequestHandler, seconds: float) -> bool:
        """Wait `seconds`, or until the client hangs up or the origin closes (then True)."""
        end = time.monotonic() + seconds
        while time.monotonic() < end and not self.closing.is_set():
            readable, _, _ = select.select([h.connection], [], [], 0.05)
            if readable and not h.connection.recv(1, 0):
                return True
        return self.closing.is_set()

    def __enter__(self) -> SlowOrigin:
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.closing.set()
        self.gate.set()
        self.server.shutdown()
        self.server.server_close()


class RawUpload:
    """A POST over a plain socket: headers and `first` body bytes now, the rest never or slowly."""

    def __init__(
        self,
        url: str,
        declared: int = 1000,
        first: bytes = b"[0123456789",
        *,
        path: str = "/v1/encode",
        headers: dict[str, str] | None = None,
    ) -> None:
        split = urlsplit(url)
        self.sock = socket.create_connection((split.hostname, split.port), timeout=60)
        extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {split.netloc}\r\n{extra}"
            f"Content-Type: application/json\r\nContent-Length: {declared}\r\n\r\n"
        )
        self.sock.sendall(head.encode() + first)

    def status(self) -> int | None:
        """The answer's status code; None if the server closed without one (or never answered)."""
        data = b""
        try:
            while b"\r\n" not in data:
                more = self.sock.recv(4096)
                if not more:
                    break
                data += more
        except OSError:
            return None
        finally:
            self.sock.close()
        line = data.split(b"\r\n", 1)[0].split()
        return int(line[1]) if len(line) > 1 else None
