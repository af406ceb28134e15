"""`Pins`: the rows an engine's connector was told are present, held for it until it loads them.

The cache routes (server/ec.py) answer a lookup "present" only with the rows pinned for the
caller, so the LRU cannot evict them between the engine's plan and its load; the items still
being encoded behind an answer (or named ahead by a router) are counted here too, and a lookup
waiting for a change is woken here (`changed`).
"""

from __future__ import annotations

import asyncio
import heapq
import time
from collections import Counter
from dataclasses import dataclass, field

from mmferry.embed.cache import EncoderCache
from mmferry.encoder.model import VisionOutput

PIN_TTL_S = 60.0
MAX_PINS = 16_384  # pins held at once, all callers together
# The caller of the pins /v1/cache/encode takes for the engine that will ask (a header's caller
# is "id:...", an address's "addr:...": neither can be this).
HANDOVER = "encode"


@dataclass
class _Held:
    """One item's pinned rows and the deadline of each caller's pin."""

    out: VisionOutput
    nbytes: int
    callers: dict[str, float] = field(default_factory=dict)
    outside: int = 0  # nbytes while the cache does not hold `out` under its key, else 0


def _nbytes(out: VisionOutput) -> int:
    return sum(t.numel() * t.element_size() for t in (out.embeds, *out.deepstack))


class Pins:
    """Rows callers were told are present, held per caller until loaded or `ttl_s` has passed.

    A pin's deadline is set when its caller first looks the item up. A repeated lookup renews it
    while the cache holds the rows (pinning them costs nothing then, and an engine that looked
    an item up and loaded nothing, its own cache having the item, must not be told a lapsing
    pin later); once the rows live only in pins it answers the time left and never extends it,
    so no caller keeps evicted rows for ever by asking again. A load releases only the loader's
    pins. Rows the cache still holds cost nothing; `max_bytes` bounds the pinned rows it no
    longer holds (`used_bytes`). A pin on rows outside the cache never outlives the pins
    already holding them, so callers cannot hand such rows on to one another; the encode
    route's pin on them (the item encoded again) gets a full lifetime only within `max_bytes`.
    When the cache holds rows under a key again (evicted while pinned, then encoded again), the
    key's pins move onto those, the same item's rows: a new caller pins the cached rows and the
    older ones are freed, never kept alive by a chain of new callers. Rows the cache evicts
    while pinned count from then on: past `max_bytes` plus one cache's worth of them, a lookup
    pins only rows already pinned and answers "absent" for others (the engine then encodes
    itself) until some lapse; the pinned rows outside the cache stay under `max_bytes` plus
    twice the cache's capacity."""

    def __init__(
        self,
        cache: EncoderCache,
        *,
        ttl_s: float = PIN_TTL_S,
        max_bytes: int,
        max_pins: int = MAX_PINS,
    ) -> None:
        self.cache = cache
        self.ttl_s = ttl_s
        self.max_bytes = max_bytes
        self.max_pins = max_pins
        self._held: dict[str, _Held] = {}
        self._count = 0
        # Items answered before their rows (`"wait": false`): encode calls still running per key.
        self._encoding: Counter[str] = Counter()
        self._watchers: list[asyncio.Future] = []  # lookups waiting for a change (changed())
        # (deadline, key, caller), oldest first; entries of released pins are skipped.
        self._deadlines: list[tuple[float, str, str]] = []
        # The sum of every held item's `outside`: kept as pins and the cache change, since a
        # sum over every pin at each new pin grew with the pins held (thousands when an
        # engine stops loading).
        self._outside = 0
        cache.watch(self._recount)

    def __len__(self) -> int:
        """Pins held (one per caller and item)."""
        return self._count

    @property
    def used_bytes(self) -> int:
        """Bytes of pinned rows the cache no longer holds: what `max_bytes` bounds."""
        return self._outside

    def _recount(self, key: str) -> None:
        """`key`'s share of `used_bytes` after its pins or the cache's entry changed."""
        held = self._held.get(key)
        if held is not None:
            outside = 0 if self.cache.peek(key) is held.out else held.nbytes
            self._outside += outside - held.outside
            held.outside = outside

    def _release(self, key: str, caller: str) -> None:
        held = self._held.get(key)
        if held is not None and held.callers.pop(caller, None) is not None:
            self._count -= 1
            if not held.callers:
                del self._held[key]
                self._outside -= held.outside

    def _expire(self, now: float) -> None:
        while self._deadlines and self._deadlines[0][0] <= now:
            deadline, key, caller = heapq.heappop(self._deadlines)
            held = self._held.get(key)
            if held is not None and held.callers.get(caller) == deadline:
                self._release(key, caller)
        if len(self._deadlines) > 2 * self._count + 1024:  # released pins' entries pile up
            self._deadlines = [
                (d, k, c) for k, h in self._held.items() for c, d in h.callers.items()
            ]
            heapq.heapify(self._deadlines)

    def _current(self, key: str) -> tuple[_Held | None, VisionOutput | None]:
        """The key's pins and the rows the cache holds under it. Pins on rows the cache has
        since replaced (evicted while pinned, then encoded again) move onto the cached rows,
        the same item's by its hash: the older ones are freed, and no pin keeps them alive."""
        held = self._held.get(key)
        cached = self.cache.peek(key)
        if held is not None and cached is not None and cached is not held.out:
            held.out, held.nbytes = cached, _nbytes(cached)
            self._recount(key)
        return held, cached

    def _pin(
        self,
        key: str,
        caller: str,
        now: float,
        used: int | None,
        fresh: VisionOutput | None = None,
    ) -> tuple[float, int | None]:
        """Pin `key` for `caller`: (seconds it stays pinned, 0.0 when not; `used` after it,
        counted here only when needed: None for not counted yet).
        `fresh` is rows just encoded (the encode route's pin), which may be larger than the
        cache."""
        held, cached = self._current(key)
        if held is not None and caller in held.callers:
            if cached is None:
                return held.callers[caller] - now, used  # evicted: fixed, never extended
            deadline = now + self.ttl_s  # cached: renewed (the old heap entry is skipped)
            held.callers[caller] = deadline
            heapq.heappush(self._deadlines, (deadline, key, caller))
            return self.ttl_s, used
        if self._count >= self.max_pins:
            return 0.0, used
        if cached is not None:
            # The cache's rows cost nothing now, but the cache may evict them while pinned:
            # past one cache's worth of such rows, none newly pinned until some lapse.
            out = cached
            if held is None:
                used = self.used_bytes if used is None else used
                if used > self.max_bytes + self.cache.capacity_bytes:
                    return 0.0, used
            deadline = now + self.ttl_s
        elif held is not None:
            # Rows only pins hold: a new pin ends with the last of them, so handing them from
            # caller to caller never keeps them past the cache.
            out = held.out
            deadline = max(held.callers.values())
            if fresh is not None:
                # Encoded again: a full pin within the budget, as new rows of the same bytes
                # in their place would get (the held ones are counted already).
                used = self.used_bytes if used is None else used
                if used <= self.max_bytes:
                    deadline = now + self.ttl_s
        elif fresh is not None:
            out = fresh
            used = self.used_bytes if used is None else used
            cost = _nbytes(fresh)
            if used + cost > self.max_bytes:
                return 0.0, used
            used += cost
            deadline = now + self.ttl_s
        else:
            return 0.0, used
        if held is None:
            held = self._held[key] = _Held(out, _nbytes(out))
            self._recount(key)
        held.callers[caller] = deadline
        self._count += 1
        heapq.heappush(self._deadlines, (deadline, key, caller))
        return deadline - now, used

    def lookup(self, keys: list[str], caller: str, now: float | None = None) -> list[float]:
        """Seconds each key stays pinned for `caller` from now (0.0: absent, not pinned).
        Rows pinned by the encode route pass to the first caller that looks them up."""
        now = time.monotonic() if now is None else now
        self._expire(now)
        used = None  # counted once, and only if a new pin needs it
        answer = []
        for key in keys:
            left, used = self._pin(key, caller, now, used)
            answer.append(left)
            held = self._held.get(key)
            if left > 0 and held is not None and caller != HANDOVER:
                self._release(key, HANDOVER)
        return answer

    def begin_encoding(self, keys: list[str]) -> None:
        """`keys` are being encoded behind an answer already given: lookups say "pending"."""
        self._encoding.update(keys)
        self._notify()

    def end_encoding(self, keys: list[str]) -> None:
        """Their encode ended (rows held, or failed): lookups answer present or absent again."""
        self._encoding.subtract(keys)
        for key in keys:
            if self._encoding[key] <= 0:
                del self._encoding[key]
        self._notify()

    def changed(self) -> asyncio.Future:
        """Done at the next change of what lookups would answer about items being encoded
        (one began, or ended, or rows were held); on the event loop, as every change is."""
        future = asyncio.get_running_loop().create_future()
        if len(self._watchers) >= 64:  # waits that timed out, until the next change
            self._watchers = [f for f in self._watchers if not f.done()]
        self._watchers.append(future)
        return future

    def _notify(self) -> None:
        watchers, self._watchers = self._watchers, []
        for future in watchers:
            if not future.done():
                future.set_result(None)

    def pending(self, key: str) -> bool:
        """Whether `key` is still being encoded behind an answer already given."""
        return key in self._encoding  # end_encoding drops a key at 0

    def hold(self, key: str, out: VisionOutput, now: float | None = None) -> bool:
        """Pin freshly encoded rows for the engine that will ask; whether the service holds
        them (cached or pinned) for a later load."""
        now = time.monotonic() if now is None else now
        self._expire(now)
        left, _ = self._pin(key, HANDOVER, now, None, fresh=out)
        self._notify()
        return left > 0 or self.cache.peek(key) is not None

    def take_all(
        self, keys: list[str], caller: str, now: float | None = None
    ) -> dict[str, VisionOutput]:
        """Every key's rows, releasing `caller`'s pins on them (and the encode route's);
        KeyError naming the missing ones, and then nothing is released (the engine will encode
        those items, or retry)."""
        now = time.monotonic() if now is None else now
        self._expire(now)
        rows = {}
        for key in dict.fromkeys(keys):
            held, cached = self._current(key)
            out = held.out if held is not None else cached
            if out is not None:
                rows[key] = out
        gone = [k for k in keys if k not in rows]
        if gone:
            raise KeyError(gone)
        for key in rows:
            self._release(key, caller)
            self._release(key, HANDOVER)
        return rows
