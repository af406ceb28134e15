"""The encoder's side of `bench/store.py`, in its own process: the rows published to the store,
served as safetensors over HTTP, and put into a shared-memory arena on request.

Protocol: argv is the store address and the item count; it prints "ready PORT" (its HTTP port),
then answers each stdin line "shm" with one JSON line of the arena handles, until end of input.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch

SHAPE = (4096, 2048)


def rows(count: int) -> list[torch.Tensor]:
    """The seeded rows both sides build (the consumer checks what it received against them)."""
    g = torch.Generator().manual_seed(0)
    return [torch.randn(SHAPE, generator=g) for _ in range(count)]


def keys(count: int) -> list[str]:
    from mmferry.store.entry import ModelIdentity, entry_key

    model = ModelIdentity("bench", "0" * 32)
    return [entry_key(f"{i:032x}", model, torch.float32) for i in range(count)]


def main() -> int:
    from safetensors.torch import save

    from mmferry.store.entry import ModelIdentity, entry_parts
    from mmferry.store.mooncake import MooncakeStore, StoreAddress
    from mmferry.transport.shm import ShmArena

    url, count = sys.argv[1], int(sys.argv[2])
    items = rows(count)
    store = MooncakeStore(StoreAddress.parse(url))
    model = ModelIdentity("bench", "0" * 32)
    for key, t in zip(keys(count), items):
        store.put(key, entry_parts(key, model, t, ()))

    class Rows(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            # Serialised per request, as the service answers each request.
            body = save({f"{i}.embeds": t for i, t in enumerate(items)})
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Rows)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    arena = ShmArena(count * items[0].numel() * 4 * 2, on_full="wait")
    print(f"ready {server.server_address[1]}", flush=True)
    for line in sys.stdin:
        if line.strip() == "shm":
            handles = [dataclasses.asdict(arena.put(t)) for t in items]
            for h in handles:
                h["shape"] = list(h["shape"])
                h.pop("inline")
            print(json.dumps(handles), flush=True)
    server.shutdown()
    arena.close()
    store.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
