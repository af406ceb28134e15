"""Reading a request before it is admitted: the client's API key, the body with its deadlines,
and the JSON in it.

Shared by the encode route (`app.py`) and the encoder-cache routes (`ec.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
from collections.abc import Callable, Iterator
from typing import Any

from mmferry.server.limits import RequestError, shown, too_large

RETRY_AFTER_S = "1"  # with every 503
# Clients on these hosts may ask for shared-memory answers.
LOCAL_HOSTS = ("127.0.0.1", "::1", "localhost")
# Values in one JSON body, bounded from its count of ',', '[' and '{' (those in strings too):
# 16 videos of 3,600 data-URL frames are 115,200.
MAX_JSON_VALUES = 1 << 17
_VECTOR_BYTES = 16 << 10  # json_values counts bodies from this size with numpy


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


async def _collect(request: Any, limit: int) -> bytearray:
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise too_large("the request body", len(body), "max_request_bytes", limit)
    return body


class ReadCut:
    """Set once, at a drain's deadline (run.py): every body still arriving then ends with a
    503. Its readers are the tasks reading a body now; setting it cancels them (no task a
    request waits on the cut: one would cost the read another task and a wait on both)."""

    def __init__(self) -> None:
        self._set = False
        self._readers: set[asyncio.Task] = set()
        self._cut: set[asyncio.Task] = set()

    def is_set(self) -> bool:
        return self._set

    def set(self) -> None:
        self._set = True
        for task in self._readers - self._cut:
            self._cut.add(task)
            task.cancel()

    @contextlib.contextmanager
    def reading(self) -> Iterator[Callable[[], bool]]:
        """The current task as a reader; yields whether the cut has cancelled it (then its
        cancel is undone: the caller answers the 503 instead)."""
        task = asyncio.current_task()
        assert task is not None
        self._readers.add(task)

        def cut() -> bool:
            if task not in self._cut:
                return False
            # NOTE: only the cut's own cancel is undone; another's (the client's disconnect,
            # the server's stop) still stands and is raised.
            return task.uncancel() == 0

        try:
            yield cut
        finally:
            self._readers.discard(task)
            self._cut.discard(task)


def _draining() -> RequestError:
    return RequestError(
        503, "draining", "the server is shutting down; the request body had not arrived"
    )


async def read_body(
    request: Any, limit: int, timeout_s: float, cut: ReadCut, *, copy: bool = True
) -> bytes | bytearray:
    """The whole body within `timeout_s` (408), under `limit` bytes (413), unless `cut` (503).
    `copy=False`: the bytearray it was read into, not copied into bytes (for a 32 MiB body,
    that copy alone holds the event loop for milliseconds)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large("the request body", int(declared), "max_request_bytes", limit)
    if cut.is_set():
        raise _draining()
    # NOTE: one deadline for the whole body, not per read: a body that drips a byte at a time
    # would pass any per-read timeout. Read in the request's own task.
    with cut.reading() as was_cut:
        try:
            async with asyncio.timeout(timeout_s):
                body = await _collect(request, limit)
        except asyncio.CancelledError:
            if was_cut():
                raise _draining() from None
            raise
        except TimeoutError:
            raise RequestError(
                408,
                "body_timeout",
                f"the request body did not arrive within body_timeout_s={timeout_s:g} "
                "(--body-timeout)",
            ) from None
    return bytes(body) if copy else body


def check_json_type(content_type: str) -> None:
    """415 unless the media type is JSON in UTF-8 (case-insensitive, as RFC 9110 has it)."""
    media, *params = (p.strip() for p in content_type.split(";"))
    charset = "utf-8"
    for param in params:
        name, _, value = param.partition("=")
        if name.strip().lower() == "charset":
            charset = value.strip().strip('"').lower()
    if media.lower() != "application/json" or charset not in ("utf-8", "utf8"):
        raise RequestError(
            415,
            "content_type",
            f"send application/json in UTF-8, not {shown(content_type or '(none)')}",
        )


class NotFinite(float):
    """NaN or an infinity as `json.loads` reads them (`NaN`, `Infinity`, `-Infinity`): orjson
    would write such a float as `null`, and refuses this subclass, so `dump_json` writes the
    body with `json` instead, the constant as it came."""


def dump_json(value: Any) -> bytes:
    """`value` (as `parse_json` read it, edited) as JSON in UTF-8: orjson (a few times faster
    than `json.dumps` on a body of base64 media), or `json` for what orjson refuses (integers
    past 64 bits, lone surrogates, `NotFinite`), so the values are the body's own."""
    try:
        import orjson
    except ImportError as e:  # pragma: no cover - depends on the environment
        msg = "mmferry's HTTP surfaces need orjson: pip install 'mmferry[server]'"
        raise ImportError(msg) from e
    try:
        return orjson.dumps(value)
    except TypeError:  # orjson.JSONEncodeError is a TypeError
        return json.dumps(value).encode()


def json_error(kind: int, detail: str = "") -> RequestError:
    """The 400 for a body that is not JSON, by kind: 1 too many values (`detail`: how many),
    2 nested too deeply, 3 invalid (`detail`: why)."""
    if kind == 1:
        return RequestError(
            400,
            "bad_json",
            f"the JSON body has {detail} values, arrays and objects (counting ',', '[' and '{{'), "
            f"more than {MAX_JSON_VALUES}: too many, or nested too deeply",
        )
    if kind == 2:
        return RequestError(400, "bad_json", "the JSON body is nested too deeply")
    return RequestError(400, "bad_json", f"the body is not valid JSON ({detail})")


def json_values(raw: bytes | bytearray) -> int:
    """At least the number of values in `raw` less one (every value after the first follows a
    `,` or opens with `[` or `{`), counted without parsing: a bound on what parsing costs."""
    if len(raw) < _VECTOR_BYTES:
        return raw.count(b",") + raw.count(b"[") + raw.count(b"{")
    import numpy as np

    # NOTE: numpy compares a body's bytes in vector registers; bytes.count walks them one at a
    # time (a 160 KB body of four base64 images: 45-65 against 240-250 us for the three counts).
    b = np.frombuffer(raw, np.uint8)
    return sum(int(np.count_nonzero(b == c)) for c in b",[{")


# Bodies of at most this many values (a chat request with its media: a few dozen) are parsed
# by orjson (about a fifth of json's time on a body of data: URLs), checked in a walk that costs
# about as much as the values.
FAST_VALUES = 2_000
_SLOW = object()
_WIDE = float(1 << 63)


def _fast_loads(raw: bytes | bytearray) -> Any:
    """`raw` parsed by orjson, or `_SLOW` where json's reading could differ: orjson refuses
    NaN, the infinities, lone surrogates, a byte-order mark and deep nesting (json then decides),
    and reads an integer past 64 bits as a float (any float that wide sends the body to json)."""
    try:
        import orjson
    except ImportError:  # pragma: no cover - depends on the environment
        return _SLOW
    try:
        value = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return _SLOW
    return _SLOW if _has_wide_float(value) else value


def _has_wide_float(value: Any) -> bool:
    stack = [value]
    while stack:
        v = stack.pop()
        if type(v) is dict:
            stack.extend(v.values())
        elif type(v) is list:
            stack.extend(v)
        elif type(v) is float and not -_WIDE < v < _WIDE:
            return True
    return False


def parse_json(raw: bytes | bytearray, values: int | None = None) -> Any:
    """The JSON body; 400 for anything json cannot turn into Python values, and for more than
    `MAX_JSON_VALUES` values (each costs the parse time and memory: 32 MiB of `{},` is ten
    million dicts). `values`: `json_values(raw)` where the caller has counted it already."""
    count = json_values(raw) if values is None else values
    if count > MAX_JSON_VALUES:
        raise json_error(1, str(count))
    if count <= FAST_VALUES:
        value = _fast_loads(raw)
        if value is not _SLOW:
            return value
    try:
        return json.loads(raw, parse_constant=NotFinite)
    except RecursionError:
        raise json_error(2) from None
    # ValueError covers bad syntax, bad UTF-8 and integers past Python's digit limit.
    except ValueError as e:
        raise json_error(3, str(e)[:200]) from None


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
