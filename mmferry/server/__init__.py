"""The encoder service: `mmferry serve` (HTTP, batching, limits, metrics) and its client.

Importing this package needs no server dependency; `app.py` and `run.py` import FastAPI and
uvicorn when called, `client.py` imports httpx (the `server` extra).
"""

from __future__ import annotations
