"""`CacheClient`: the cache routes of an `mmferry serve` endpoint (server/ec.py), as an
engine's connector calls them: which hashes it holds and for how long, and their
`[main | ds...]` rows.

Nothing the service answers is trusted: an answer that is late, not JSON, missing a key, of the
wrong length or type, or naming other hashes raises `BadAnswer` (a `ServiceUnavailable`), and
rows are checked against what the engine expects (`RowSpec`) before anyone sees them. Every call
has one deadline for the whole exchange, not per socket read, so a service that trickles its
answer cannot hold the caller. One client talks to one endpoint.
"""

from __future__ import annotations

import json
import math
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any

import torch

DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
CALLER_HEADER = "X-Mmferry-Caller"


class ServiceUnavailable(RuntimeError):
    """The service did not answer usefully (down, restarting, refused, late or malformed)."""


class BadAnswer(ServiceUnavailable):
    """The service answered 200 with something that is not the protocol's answer."""


class NotHeld(ServiceUnavailable):
    """The service no longer holds these hashes (a 404 from the load route)."""

    def __init__(self, message: str, hashes: list[str]) -> None:
        super().__init__(message)
        self.hashes = hashes


class BadRows(ValueError):
    """Rows that are not what the engine planned for their item (named in the message)."""


@dataclass(frozen=True)
class RowSpec:
    """What every item's rows must be for the engine: `[tokens, width]` in `dtype`."""

    width: int
    dtype: torch.dtype

    def check(self, identifier: str, rows: Any, tokens: int) -> torch.Tensor:
        """`rows` when they are a `[tokens, width]` tensor of `dtype`, else `BadRows`."""
        return check_rows(identifier, rows, tokens, self.dtype, self.width)


def check_rows(
    identifier: str, rows: Any, tokens: int, dtype: torch.dtype, width: int | None = None
) -> torch.Tensor:
    """`rows` when they are a `[tokens, width]` tensor of `dtype` (any width above 0 when
    `width` is None: a caller that does not know the model's), else `BadRows`."""
    want = f"[{tokens}, {'width' if width is None else width}] {dtype}"
    if not isinstance(rows, torch.Tensor):
        raise BadRows(f"{identifier}: got a {type(rows).__name__}, want {want}")
    # NOTE: vLLM slices an item's rows by token and concatenates them across items: a
    # wrong dimension count, width or dtype passes its encoder cache and fails the engine
    # later, in the middle of a batch.
    fits = rows.dim() == 2 and rows.shape[0] == tokens and rows.dtype == dtype
    if fits:
        fits = rows.shape[1] == width if width is not None else rows.shape[1] > 0
    if not fits:
        raise BadRows(f"{identifier}: rows {tuple(rows.shape)} {rows.dtype}, want {want}")
    return rows


def strict_json(raw: bytes) -> Any:
    """JSON with no duplicate keys and no NaN or infinities (a lying service sends both)."""

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        out = dict(items)
        if len(out) != len(items):
            raise ValueError("duplicate keys in one JSON object")
        return out

    def constant(name: str) -> Any:
        raise ValueError(f"{name} is not JSON")

    return json.loads(raw, object_pairs_hook=pairs, parse_constant=constant)


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


class CacheClient:
    """The three cache routes of one `mmferry serve` endpoint (blocking httpx).

    `caller` is sent as `X-Mmferry-Caller` (the service keeps pins per caller); `timeout_s`
    bounds each call as a whole, `lookup_timeout_s` each lookup (a scheduler waits on it)."""

    def __init__(
        self,
        url: str,
        api_key: str | None,
        timeout_s: float,
        shm: bool,
        caller: str | None = None,
        lookup_timeout_s: float | None = None,
    ) -> None:
        import httpx

        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        if caller:
            headers[CALLER_HEADER] = caller
        self.url = url
        self.shm = shm
        self.timeout_s = timeout_s
        self.lookup_timeout_s = timeout_s if lookup_timeout_s is None else lookup_timeout_s
        self._http = httpx.Client(base_url=url, timeout=timeout_s, headers=headers)
        # NOTE: one thread makes the HTTP calls so that the caller can stop waiting at its
        # deadline; a call still running past it makes the next one fail at once instead of
        # queueing behind it.
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mmferry-cache")
        self._running: Future | None = None
        self._lock = threading.Lock()

    def set_caller(self, caller: str) -> None:
        """Send `caller` as `X-Mmferry-Caller` from now on (a worker learns it from its plan)."""
        self._http.headers[CALLER_HEADER] = caller

    def _within(self, timeout_s: float, fn: Any, *args: Any) -> Any:
        with self._lock:
            if self._running is not None and not self._running.done():
                raise ServiceUnavailable("the previous call to the service has not ended yet")
            future = self._pool.submit(fn, *args)
            self._running = future
        try:
            return future.result(timeout=timeout_s)
        except FutureTimeout:
            raise ServiceUnavailable(f"no answer within {timeout_s:g} s") from None

    def _post(self, route: str, body: dict[str, Any]) -> Any:
        import httpx

        try:
            r = self._http.post(route, json=body)
        except (httpx.HTTPError, OSError, ValueError) as e:
            raise ServiceUnavailable(f"{route}: {type(e).__name__}: {e}") from None
        if r.status_code == 404 and route.endswith("/load"):
            raise NotHeld(f"{route}: 404 {r.text[:200]}", list(body["hashes"]))
        if r.status_code != 200:
            raise ServiceUnavailable(f"{route}: {r.status_code} {r.text[:200]}")
        return r

    def lookup_pins(self, hashes: list[str], wait_s: float = 0.0) -> list[float | None]:
        """Seconds from when the lookup was sent that the service keeps each hash pinned for
        this caller; 0.0 for a hash it does not hold; None for one it is still encoding (it
        answered the encode before the rows: ask again). With `wait_s`, while none is held the
        service answers once one is, or an encode of one begins or ends, or `wait_s` passed."""
        wait_ms = round(wait_s * 1000)
        return self._within(self.lookup_timeout_s + wait_s, self._lookup, list(hashes), wait_ms)

    def lookup(self, hashes: list[str]) -> list[bool]:
        """Which hashes the service holds (and has now pinned for this caller)."""
        return [bool(s) for s in self.lookup_pins(hashes)]

    def _lookup(self, hashes: list[str], wait_ms: int = 0) -> list[float | None]:
        body: dict[str, Any] = {"hashes": hashes}
        if wait_ms:
            body["wait_ms"] = wait_ms
        r = self._post("/v1/cache/lookup", body)
        try:
            doc = strict_json(r.content)
        except ValueError as e:
            raise BadAnswer(f"lookup: the answer is not JSON ({e}): {r.text[:80]!r}") from None
        present = doc.get("present") if isinstance(doc, dict) else None
        pinned = doc.get("pinned_s") if isinstance(doc, dict) else None
        n = len(hashes)
        if not (isinstance(present, list) and len(present) == n):
            raise BadAnswer(f"lookup: 'present' must be a list of {n} booleans: {r.text[:120]!r}")
        if not (isinstance(pinned, list) and len(pinned) == n):
            raise BadAnswer(f"lookup: 'pinned_s' must be a list of {n} numbers: {r.text[:120]!r}")
        # A service before answers ahead of the rows sends no "pending".
        pending = doc.get("pending", [False] * n)
        if not (isinstance(pending, list) and len(pending) == n):
            raise BadAnswer(f"lookup: 'pending' must be a list of {n} booleans: {r.text[:120]!r}")
        out: list[float | None] = []
        for p, s, w in zip(present, pinned, pending):
            if not isinstance(p, bool) or not _number(s) or s < 0:
                raise BadAnswer(f"lookup: bad entry present={p!r} pinned_s={s!r}")
            if not isinstance(w, bool) or (w and p):
                raise BadAnswer(f"lookup: bad entry present={p!r} pending={w!r}")
            out.append(None if w else float(s) if p else 0.0)
        return out

    def load(
        self,
        hashes: list[str],
        dtype: torch.dtype,
        *,
        shm: bool | None = None,
        timeout_s: float | None = None,
    ) -> dict[str, torch.Tensor]:
        """Rows per hash: read-only shared-memory views, or tensors parsed from safetensors.
        Exactly the asked hashes come back (`BadAnswer` otherwise); a 404 is `NotHeld`."""
        if len(set(hashes)) != len(hashes):
            raise ValueError(f"load asks for each hash once, got {hashes}")
        shm = self.shm if shm is None else shm
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        return self._within(timeout_s, self._load, list(hashes), DTYPE_NAMES[dtype], shm)

    def _load(self, hashes: list[str], dtype: str, shm: bool) -> dict[str, torch.Tensor]:
        body: dict[str, Any] = {"hashes": hashes, "dtype": dtype}
        if shm:
            body["response"] = "shm"
        r = self._post("/v1/cache/load", body)
        if not shm:
            return read_rows(r.content, hashes)
        try:
            docs = strict_json(r.content)["items"]
            if not isinstance(docs, dict):
                raise TypeError(f"'items' is a {type(docs).__name__}")
        except Exception as e:  # noqa: BLE001 - whatever the parser raises, the answer is bad
            raise BadAnswer(f"load: unreadable answer ({type(e).__name__}: {e})") from None
        _exactly(docs, hashes)
        from mmferry.server.client import open_handle

        rows = {}
        for h in hashes:
            try:
                rows[h] = open_handle(docs[h])
            except Exception as e:  # noqa: BLE001 - a gone segment, a forged or odd handle
                raise BadAnswer(
                    f"load: the shared-memory handle of {h} does not open ({type(e).__name__}: {e})"
                ) from None
        return rows

    def close(self) -> None:
        self._http.close()
        self._pool.shutdown(wait=False, cancel_futures=True)


def _exactly(docs: dict[str, Any], hashes: list[str]) -> None:
    if set(docs) != set(hashes):
        missing = sorted(set(hashes) - set(docs))
        extra = sorted(set(docs) - set(hashes))
        raise BadAnswer(f"load: the answer lacks {missing} and adds {extra}")


def read_rows(content: bytes, hashes: list[str]) -> dict[str, torch.Tensor]:
    """A load answer's safetensors body as rows per hash: exactly `hashes`, else `BadAnswer`
    (the rows themselves are checked by `check_rows`)."""
    try:
        from safetensors.torch import load

        docs = load(content)
    except Exception as e:  # noqa: BLE001 - whatever the parser raises, the answer is bad
        raise BadAnswer(f"load: unreadable answer ({type(e).__name__}: {e})") from None
    _exactly(docs, hashes)
    return docs


def fetch_rows(
    client: CacheClient, items: dict[str, int], spec: RowSpec, within_s: float
) -> dict[str, torch.Tensor]:
    """Every item's checked rows (`items`: identifier -> planned tokens), trying for up to
    `within_s` while the service is unreachable; shared memory that fails falls back to
    safetensors over HTTP. A `RuntimeError` naming the items that cannot be had otherwise."""
    deadline = time.monotonic() + within_s
    hashes = list(items)
    shm = client.shm
    while True:
        left = deadline - time.monotonic()
        try:
            rows = client.load(hashes, spec.dtype, shm=shm, timeout_s=max(left, 0.1))
            return {h: spec.check(h, rows[h], items[h]) for h in hashes}
        except NotHeld as e:
            why = f"the service no longer holds them ({e})"
        except BadAnswer as e:
            if shm:
                shm = False  # the same rows as bytes: a segment gone or a bad handle
                continue
            why = str(e)
        except BadRows as e:
            why = f"the service sent rows that do not fit: {e}"
        except ServiceUnavailable as e:
            if time.monotonic() < deadline:
                time.sleep(0.2)
                continue
            why = f"the service did not answer within {within_s:g} s ({e})"
        raise RuntimeError(f"mmferry could not load the planned items {hashes}: {why}")
