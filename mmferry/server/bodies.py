"""Reading a request before it is admitted: the client's API key, the body with its deadlines,
and the JSON in it.

Shared by the encode route (`app.py`) and the encoder-cache routes (`ec.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
from typing import Any

from mmferry.server.limits import RequestError, too_large

# Clients on these hosts may ask for shared-memory answers.
LOCAL_HOSTS = ("127.0.0.1", "::1", "localhost")


def api_key(headers: Any) -> str:
    """The key a client sent: `Authorization: Bearer ...` or `X-API-Key`."""
    auth = headers.get("authorization", "")
    if auth.lower().startswith("bearer "):
        return auth[7:].strip()
    return headers.get("x-api-key", "")


def check_caller(headers: Any, expected_key: str | None, draining: bool) -> None:
    """401 for a wrong or missing API key (compared in constant time), 503 while draining."""
    if expected_key is not None and not hmac.compare_digest(
        api_key(headers).encode(), expected_key.encode()
    ):
        raise RequestError(401, "unauthorized", "missing or wrong API key")
    if draining:
        raise RequestError(503, "draining", "the server is shutting down")


async def _collect(request: Any, limit: int) -> bytes:
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise too_large("the request body", len(body), "max_request_bytes", limit)
    return bytes(body)


async def read_body(request: Any, limit: int, timeout_s: float, cut: asyncio.Event) -> bytes:
    """The whole body within `timeout_s` (408), under `limit` bytes (413), unless `cut` (503)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large("the request body", int(declared), "max_request_bytes", limit)
    # NOTE: one deadline for the whole body, not per read: a body that drips a byte at a time
    # would pass any per-read timeout.
    reading = asyncio.ensure_future(_collect(request, limit))
    cutting = asyncio.ensure_future(cut.wait())
    try:
        done, _ = await asyncio.wait(
            {reading, cutting}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED
        )
    finally:
        cutting.cancel()
        reading.cancel()
    if reading in done:
        return reading.result()
    if cutting in done:
        raise RequestError(
            503, "draining", "the server is shutting down; the request body had not arrived"
        )
    raise RequestError(
        408,
        "body_timeout",
        f"the request body did not arrive within body_timeout_s={timeout_s:g} (--body-timeout)",
    )


def parse_json(raw: bytes) -> Any:
    """The JSON body; 400 for anything json cannot turn into Python values."""
    try:
        return json.loads(raw)
    except RecursionError:
        raise RequestError(400, "bad_json", "the JSON body is nested too deeply") from None
    # ValueError covers bad syntax, bad UTF-8 and integers past Python's digit limit.
    except ValueError as e:
        raise RequestError(
            400, "bad_json", f"the body is not valid JSON ({str(e)[:200]})"
        ) from None


async def linger(request: Any, limit: int = 1 << 20, timeout_s: float = 1.0) -> None:
    """Read and drop what the client is still sending (at most `limit` bytes, `timeout_s`)
    before a refusal closes the connection."""
    # NOTE: closing a socket with unread bytes makes the kernel reset the connection, and the
    # reset can destroy the refusal before the client reads it (as nginx's lingering close).

    async def drain() -> None:
        seen = 0
        while seen <= limit:
            message = await request.receive()
            if message.get("type") != "http.request":
                return
            seen += len(message.get("body", b""))
            if not message.get("more_body"):
                return

    # Best effort: the refusal goes out either way.
    with contextlib.suppress(Exception):
        await asyncio.wait_for(drain(), timeout_s)
