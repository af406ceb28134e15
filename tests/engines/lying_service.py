"""A service that speaks HTTP on loopback like `mmferry serve`'s cache routes and answers what
a test tells it to: malformed, late, lying. Real sockets, a real server thread; it records
every request (route, headers, JSON body) so a test can see what the client sent.

    with LyingService() as s:
        s.answer("lookup", html())                  # one answer for every lookup
        s.answer("load", rows({"h": tensor}))       # safetensors of these tensors
"""

from __future__ import annotations

import base64
import dataclasses
import json
import select
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import torch


@dataclass
class Answer:
    """What one route answers: status, content type, body, and how it is sent."""

    status: int = 200
    body: bytes = b""
    content_type: str = "application/json"
    delay_s: float = 0.0  # before the status line
    trickle_s: float = 0.0  # between the body's bytes (a slow, never-quite-late sender)
    headers: dict[str, str] = field(default_factory=dict)  # beside content-type and -length


Responder = Callable[[dict[str, Any]], Answer]


def js(doc: Any, status: int = 200) -> Answer:
    return Answer(status, json.dumps(doc).encode())


def raw(text: str | bytes, content_type: str = "application/json") -> Answer:
    return Answer(200, text.encode() if isinstance(text, str) else text, content_type)


def html() -> Answer:
    return raw("<html><body>502 Bad Gateway</body></html>", "text/html")


def present(pinned_s: float = 60.0) -> Responder:
    """The protocol's answer: every asked hash present, pinned for `pinned_s`."""
    return lambda body: js(
        {"present": [True] * len(body["hashes"]), "pinned_s": [pinned_s] * len(body["hashes"])}
    )


def pending() -> Responder:
    """Every asked hash still being encoded (the encode answered ahead of the rows)."""
    return lambda body: js(
        {
            "present": [False] * len(body["hashes"]),
            "pinned_s": [0.0] * len(body["hashes"]),
            "pending": [True] * len(body["hashes"]),
        }
    )


def absent() -> Responder:
    """Every asked hash unknown to the service (not held, not being encoded)."""
    return lambda body: js(
        {
            "present": [False] * len(body["hashes"]),
            "pinned_s": [0.0] * len(body["hashes"]),
            "pending": [False] * len(body["hashes"]),
        }
    )


SLOW_S = 4.0  # how late the late answers are (the trickled one, byte by byte)
# Every form of a bad lookup answer for one hash; each must read as "absent".
BAD_LOOKUPS = {
    "html_200": html(),
    "not_json": raw("present: yes"),
    "empty_body": raw(""),
    "json_list": js([True]),
    "no_present": js({"pinned_s": [60.0]}),
    "no_pinned_s": js({"present": [True]}),
    "two_answers_for_one_hash": js({"present": [True, True], "pinned_s": [60.0, 60.0]}),
    "no_answer": js({"present": [], "pinned_s": []}),
    "present_is_a_string": js({"present": ["yes"], "pinned_s": [60.0]}),
    "present_is_an_int": js({"present": [1], "pinned_s": [60.0]}),
    "present_not_a_list": js({"present": True, "pinned_s": 60.0}),
    "pinned_s_is_a_string": js({"present": [True], "pinned_s": ["60"]}),
    "pinned_s_is_a_bool": js({"present": [True], "pinned_s": [True]}),
    "pinned_s_is_null": js({"present": [True], "pinned_s": [None]}),
    "pinned_s_negative": js({"present": [True], "pinned_s": [-5.0]}),
    "pinned_s_nan": raw('{"present": [true], "pinned_s": [NaN]}'),
    "pinned_s_infinite": raw('{"present": [true], "pinned_s": [Infinity]}'),
    "pending_is_a_string": js({"present": [False], "pinned_s": [0.0], "pending": ["yes"]}),
    "pending_not_a_list": js({"present": [False], "pinned_s": [0.0], "pending": True}),
    "two_pendings_for_one_hash": js(
        {"present": [False], "pinned_s": [0.0], "pending": [True, True]}
    ),
    "present_and_pending": js({"present": [True], "pinned_s": [60.0], "pending": [True]}),
    "duplicate_keys": raw('{"present": [false], "present": [true], "pinned_s": [60]}'),
    "status_500": js({"error": "boom"}, status=500),
    "status_503": js({"error": "draining"}, status=503),
    "status_404": js({"error": "no route"}, status=404),
    "late": Answer(200, b'{"present": [true], "pinned_s": [60.0]}', delay_s=SLOW_S),
    "trickled": Answer(200, b'{"present": [true], "pinned_s": [60.0]}', trickle_s=SLOW_S / 40),
}


def rows(tensors: dict[str, torch.Tensor]) -> Answer:
    from safetensors.torch import save

    return Answer(200, save(tensors), "application/vnd.mmferry.safetensors")


def handle_json(handle: Any) -> dict[str, Any]:
    """An `ShmHandle` as the service's JSON answer spells it."""
    d = dataclasses.asdict(handle)
    inline = d.pop("inline")
    d["inline_b64"] = None if inline is None else base64.b64encode(inline).decode()
    d["shape"] = list(d["shape"])
    return d


@dataclass
class LyingService:
    answers: dict[str, Answer | Responder] = field(default_factory=dict)
    seen: list[tuple[str, dict[str, str], Any]] = field(default_factory=list)
    # (route, monotonic time) of each request whose client closed its connection while the
    # answer was being held back (`delay_s`).
    gone: list[tuple[str, float]] = field(default_factory=list)
    _server: ThreadingHTTPServer | None = None

    @property
    def url(self) -> str:
        assert self._server is not None
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def answer(self, route: str, what: Answer | Responder) -> None:
        """Answer `what` to every later request on /v1/cache/`route`."""
        self.answers[route] = what

    def calls(self, route: str) -> list[tuple[dict[str, str], Any]]:
        return [(h, b) for r, h, b in list(self.seen) if r == route]

    def __enter__(self) -> LyingService:
        service = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            wbufsize = 1 << 16  # status, headers and body in one send (no delayed-ACK stalls)

            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
                # /health answers 200, as `mmferry serve`'s does, unless a test says otherwise.
                up = js({"status": "ok"}) if self.path == "/health" else Answer(404, b"{}")
                what = service.answers.get(self.path.rsplit("/", 1)[-1], up)
                self._send(what(None) if callable(what) else what, "health")

            def do_POST(self) -> None:  # noqa: N802 - the stdlib's name
                raw_body = self.rfile.read(int(self.headers.get("content-length", 0)))
                route = self.path.rsplit("/", 1)[-1]
                try:
                    body = json.loads(raw_body)
                except ValueError:
                    body = None
                service.seen.append((route, {k.lower(): v for k, v in self.headers.items()}, body))
                what = service.answers.get(route, Answer(404, b'{"error": "no such route"}'))
                self._send(what(body) if callable(what) else what, route)

            def _send(self, ans: Answer, route: str) -> None:
                if not self._wait(ans.delay_s):
                    service.gone.append((route, time.monotonic()))
                    return
                try:
                    self.send_response(ans.status)
                    self.send_header("content-type", ans.content_type)
                    self.send_header("content-length", str(len(ans.body)))
                    for name, value in ans.headers.items():
                        self.send_header(name, value)
                    self.end_headers()
                    if ans.trickle_s:
                        for i in range(len(ans.body)):
                            self.wfile.write(ans.body[i : i + 1])
                            self.wfile.flush()
                            time.sleep(ans.trickle_s)
                    else:
                        self.wfile.write(ans.body)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up waiting, as it should

            def _wait(self, delay_s: float) -> bool:
                """Whether `delay_s` passed with the client still there (False: it closed
                the connection meanwhile)."""
                until = time.monotonic() + delay_s
                while (left := until - time.monotonic()) > 0:
                    if select.select([self.connection], [], [], left)[0]:
                        try:
                            if not self.connection.recv(1, socket.MSG_PEEK):
                                return False
                        except OSError:
                            return False
                        time.sleep(max(0.0, until - time.monotonic()))  # bytes, not a close
                return True

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.shutdown()
        self._server.server_close()
