"""A recording engine for the proxy's fault tests: `python engine.py ADDR PORT FILE` listens on
ADDR only, answers every chat request 200 and appends one JSON line per request to FILE: the
sha256 of its messages (the rows the proxy put in them included), so a test can tell that the
same image brought the same rows whichever encoder made them."""

import hashlib
import json
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

ANSWER = json.dumps({"id": "recorded", "choices": [{"message": {"content": "ok"}}]}).encode()


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # kept alive, as vLLM's server does

    def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
        self.answer(b"{}")

    def do_POST(self) -> None:  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)))
        digest = hashlib.sha256(json.dumps(body["messages"]).encode()).hexdigest()
        with open(sys.argv[3], "a") as f:
            f.write(json.dumps({"user": body.get("user"), "messages": digest}) + "\n")
        self.answer(ANSWER)

    def answer(self, data: bytes) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        pass


server = ThreadingHTTPServer((sys.argv[1], int(sys.argv[2])), Handler)
server.daemon_threads = True
print(f"engine: listening on http://{sys.argv[1]}:{sys.argv[2]}", flush=True)
server.serve_forever()
