"""`Router`: which encoder holds an item, by rendezvous (highest-random-weight) hashing.

Every encoder gets a weight per item key, a hash of (encoder URL, key); the item's choices are
the encoders by falling weight. The same key always ranks the encoders the same way, so repeats
of an item go where its rows are cached; adding an encoder moves only the keys it now wins
(about 1/n of them); and two routers given the same URLs agree with no shared state.

On top of that ranking:
- hot keys spread: the router counts each key's requests, decayed (`HEAT_HALF_LIFE`). A key
  with at least `hot_share` / n of the recent requests (n: the encoders up), and `HOT_MIN` of
  them, is hot: it may go to any of its first `ceil(SPREAD x share x n) + 1` choices, and goes
  to the first of them that is under capacity and whose recent placements (decayed) are under
  the mean, else to the one of them with the fewest. Every other key goes to its first
  choice. A hot key is then cached on a few encoders, at one encode each, and levels the load
  (its placements fill the encoders its rendezvous order names, up to the mean); a cold key
  stays where its rows are cached. Bounded load alone balanced by spilling any key, and a
  cold key spilled to its next choice is an encode there: it cost hits what it gained in
  balance;
- bounded load: an encoder holding more than (1 + epsilon) x the mean in-flight items of the
  encoders that are up passes new items to the key's next choice (a hot key's go to the others
  within its spread first). With hot keys levelling the load, this is the guard against an
  encoder that has fallen behind (slow, stuck), not the balance: hence epsilon 1.0 by default.
  At a few items in flight an encoder, arrivals alone often cross a bound of 1.25 x the mean
  (4 in flight: the bound is 5), and every cold key spilled is a miss: in `mmferry bench
  pool`'s model (64 encoders, 4 in flight, Zipf 1.0 over 10^4 images) 27.5 % of the items of
  keys outside the hottest 1000 left their first choice at epsilon 0.25 (45 % without hot
  keys spread), 0.6 % at 1.0;
- down marking: an encoder that failed is skipped until its next probe is due; each failed
  probe doubles the wait (up to `max_backoff_s`), a passed one brings it back. An encoder that
  said how long to leave it alone (a 429's Retry-After) is not probed before then.

Two routers given the same URLs rank alike; what they count (loads, hot keys) is their own, so
a hot key's copies may differ between proxy replicas (each within the key's first choices,
where vLLM's connector looks for it in that order).

Pure: no I/O, no import of mmferry, so it sits below both of its users, `mmferry proxy` (which
places items on encoders) and vLLM's connector (`mmferry.engines.vllm_connector`, which finds an
item's encoder the way the proxy placed it); `mmferry.proxy.Router` is this class.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["EncoderState", "Router", "item_name", "parse_item_name"]

# The Router's defaults (`mmferry bench pool` models them): see the class.
EPSILON = 1.0
HOT_SHARE = 0.05
# A key is hot once its decayed request count reaches this (fewer say nothing of its rate).
HOT_MIN = 32.0
# A hot key with `share` of the requests may use its first ceil(SPREAD x share x n) + 1 choices:
# room for SPREAD times the encoders its rate alone would fill, since they serve their own keys.
SPREAD = 8.0
# Request counts halve over HEAT_HALF_LIFE x n / hot_share requests (n: the router's encoders;
# at least MIN_HALF_LIFE), so a key at the hot threshold has about HEAT_HALF_LIFE requests in a
# half-life: its share is measured, not guessed. Placements halve over PLACED_HALF_LIFE x n
# items: the recent load, exact (it is what this router placed), with no noise to average out.
HEAT_HALF_LIFE = 32.0
MIN_HALF_LIFE = 10_000.0
PLACED_HALF_LIFE = 64.0
# Decayed counts are kept in a growing unit (no decay pass over every key per request); past
# this, every count is divided by it.
RESCALE = 2.0**64

# Between an item's hash and its routing key in the name a router gives an engine (its uuid).
KEY_MARK = "@"
# Before the rank of the encoder an item named ahead of its encode was sent to.
AHEAD_MARK = "+"


def item_name(item_hash: str, key: str, ahead: int | None = None) -> str:
    """The item's name for an engine's connector: `<hash>@<key>`, the key its encoders are
    ranked by (so the connector asks them in the router's order); an item named before its
    encoder has read it (`ahead`: that encoder's rank among the key's choices) is
    `<hash>@<key>+<rank>`: its encoder may not know it yet, and is the one to wait for."""
    name = f"{item_hash}{KEY_MARK}{key}"
    return name if ahead is None else f"{name}{AHEAD_MARK}{ahead}"


def parse_item_name(name: str) -> tuple[str, str, int | None]:
    """(hash, routing key, rank of the encoder named ahead or None) of `item_name`'s names; a
    bare hash is its own key."""
    item, at, rest = name.partition(KEY_MARK)
    if not (at and item and rest):
        return name, name, None
    key, plus, rank = rest.rpartition(AHEAD_MARK)
    if plus and key and rank.isdigit() and rank.isascii():
        return item, key, int(rank)
    return item, rest, None


def _weight(url: str, key: str) -> int:
    # NOTE: blake2b, not hash(): Python salts str hashes per process, and every replica (and
    # the engine's connector) must rank alike.
    digest = hashlib.blake2b(f"{url}\0{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


@dataclass
class EncoderState:
    """What the router knows of one encoder: its load, and when to probe it if it is down."""

    url: str
    in_flight: int = 0
    down: bool = False
    failures: int = 0  # consecutive failures (calls, then probes) since it was last up
    probe_at: float = 0.0  # monotonic time of the next probe while down
    placed: float = 0.0  # items placed on it, decayed (in the router's placement unit)


class Router:
    """Rendezvous routing over encoder URLs with hot keys spread, bounded load and down
    marking.

    `epsilon`: the bound, (1 + epsilon) x the mean items in flight. `hot_share`: a key is hot
    from `hot_share` / n of the recent requests (0: none is, and the router is rendezvous
    hashing with bounded load alone, as it was before hot keys; with epsilon 0.25, its old
    default). `mmferry bench pool` models both.
    """

    def __init__(
        self,
        urls: Iterable[str],
        *,
        epsilon: float = EPSILON,
        hot_share: float = HOT_SHARE,
        backoff_s: float = 0.5,
        max_backoff_s: float = 30.0,
    ) -> None:
        urls = [u.rstrip("/") for u in urls]
        if not urls:
            raise ValueError("a router needs at least one encoder URL")
        if len(set(urls)) != len(urls):
            raise ValueError(f"encoder URLs repeat: {urls}")
        if not epsilon > 0:
            raise ValueError("epsilon must be positive (0 would refuse every item past the mean)")
        if not 0 <= hot_share < math.inf:
            raise ValueError("hot_share must be 0 (no key is hot) or positive")
        self.epsilon = epsilon
        self.hot_share = hot_share
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.encoders = {u: EncoderState(u) for u in urls}
        # Sums over the encoders that are up, kept as they change (`capacity` is asked for
        # every item; a sum over the encoders each time is O(n)).
        self._up = len(urls)
        self._up_in_flight = 0
        self._up_placed = 0.0
        self._placed_unit = 1.0
        self._placed_growth = 2.0 ** (1 / (PLACED_HALF_LIFE * len(urls)))
        # Requests per key, decayed; only keys near or over the hot threshold are kept.
        self._heat: dict[str, float] = {}
        self._heat_total = 0.0
        self._heat_unit = 1.0
        half_life = MIN_HALF_LIFE
        if hot_share:
            half_life = max(half_life, HEAT_HALF_LIFE * len(urls) / hot_share)
        self._heat_growth = 2.0 ** (1 / half_life)
        # Past this many keys counted, those under an eighth of the hot threshold are dropped:
        # at most 8 n / hot_share keys are over it, so a pruning is at most every
        # (limit - 8 n / hot_share) requests.
        self._heat_limit = int(32 * len(urls) / hot_share) + 4096 if hot_share else 0

    @property
    def urls(self) -> list[str]:
        return list(self.encoders)

    def choices(self, key: str) -> list[str]:
        """Every encoder for `key`, best first (up or down, loaded or not)."""
        return sorted(self.encoders, key=lambda u: _weight(u, key), reverse=True)

    def capacity(self) -> int:
        """In-flight items an up encoder may hold before new items pass it by."""
        if not self._up:
            return 0
        total = self._up_in_flight + 1  # counting the item being placed
        return math.ceil((1 + self.epsilon) * total / self._up)

    def share(self, key: str) -> float:
        """`key`'s share of the recent requests routed (0 for a key not counted: too few)."""
        heat = self._heat.get(key, 0.0)
        if heat < HOT_MIN * self._heat_unit or not self._heat_total:
            return 0.0
        return heat / self._heat_total

    def spread(self, key: str) -> int:
        """How many of `key`'s first choices it may go to: 1 for a key that is not hot."""
        share = self.share(key)
        if not self._up or not self.hot_share or share * self._up < self.hot_share:
            return 1
        return min(len(self.encoders), math.ceil(SPREAD * share * self._up) + 1)

    def route(self, key: str, exclude: Iterable[str] = (), *, count: bool = True) -> str | None:
        """The encoder for `key`: its first choice that is up, not over capacity and not in
        `exclude` (those already tried); the first up one when all are loaded; None when
        none is up. A hot key (`spread`): the first of its first choices that is under the mean
        of recent placements and under capacity. A call without `exclude` and with `count` is
        counted as a request for `key` (a retry, or a second look, is not)."""
        skip = set(exclude)
        if count and not skip and self.hot_share:
            self._count(key)
        up = [u for u in self.choices(key) if u not in skip and not self.encoders[u].down]
        if not up:
            return None
        cap = self.capacity()
        spread = self.spread(key)
        if spread > 1:
            within = [u for u in up[:spread] if self.encoders[u].in_flight < cap]
            if within:
                # NOTE: the mean counts the item being placed, as `capacity` does.
                mean = (self._up_placed + self._placed_unit) / self._up
                under = (u for u in within if self.encoders[u].placed + self._placed_unit <= mean)
                return next(under, None) or min(within, key=lambda u: self.encoders[u].placed)
        # NOTE: with a capacity over the mean, some encoder is always under it; it may be
        # excluded (tried already), and then the item goes to its best remaining choice.
        return next((u for u in up if self.encoders[u].in_flight < cap), up[0])

    def _count(self, key: str) -> None:
        if len(self._heat) >= self._heat_limit:
            floor = self._heat_total * self.hot_share / (8 * len(self.encoders))
            self._heat = {k: h for k, h in self._heat.items() if h >= floor}
        self._heat[key] = self._heat.get(key, 0.0) + self._heat_unit
        self._heat_total += self._heat_unit
        self._heat_unit *= self._heat_growth
        if self._heat_unit > RESCALE:
            unit = self._heat_unit
            self._heat = {k: h / unit for k, h in self._heat.items()}
            self._heat_total /= unit
            self._heat_unit = 1.0

    def acquire(self, url: str) -> None:
        """An item was sent to `url`."""
        e = self.encoders[url]
        e.in_flight += 1
        e.placed += self._placed_unit
        if not e.down:
            self._up_in_flight += 1
            self._up_placed += self._placed_unit
        self._placed_unit *= self._placed_growth
        if self._placed_unit > RESCALE:
            unit = self._placed_unit
            for s in self.encoders.values():
                s.placed /= unit
            self._placed_unit = 1.0
            self._up_placed = sum(s.placed for s in self.encoders.values() if not s.down)

    def release(self, url: str) -> None:
        """An item sent to `url` was answered (or failed)."""
        e = self.encoders[url]
        e.in_flight -= 1
        if not e.down:
            self._up_in_flight -= 1

    def mark_down(self, url: str, now: float | None = None, *, hold_s: float = 0.0) -> None:
        """`url` failed (refused, timed out, 5xx, or a failed probe): skip it until its probe,
        and for at least `hold_s` seconds (an overloaded encoder's Retry-After; at most
        `max_backoff_s`)."""
        e = self.encoders[url]
        now = time.monotonic() if now is None else now
        hold = min(max(hold_s, 0.0), self.max_backoff_s)
        if e.down and now < e.probe_at:
            # Calls already in flight failing too: one failure, one backoff step.
            e.probe_at = max(e.probe_at, now + hold)
            return
        wait = max(min(self.backoff_s * 2**e.failures, self.max_backoff_s), hold)
        if not e.down:
            self._up -= 1
            self._up_in_flight -= e.in_flight
            self._up_placed -= e.placed
        e.down, e.failures, e.probe_at = True, e.failures + 1, now + wait

    def mark_up(self, url: str) -> None:
        """`url` answered (a call or a probe): route to it again."""
        e = self.encoders[url]
        if e.down:
            # NOTE: it comes back at the mean of recent placements at least, not with the
            # deficit its time down left: hot keys would fill that deficit at once, on an
            # encoder just restarted (its cache empty).
            if self._up:
                e.placed = max(e.placed, self._up_placed / self._up)
            self._up += 1
            self._up_in_flight += e.in_flight
            self._up_placed += e.placed
        e.down, e.failures, e.probe_at = False, 0, 0.0

    def due(self, now: float | None = None) -> list[str]:
        """Down encoders whose probe is due."""
        now = time.monotonic() if now is None else now
        return [u for u, e in self.encoders.items() if e.down and e.probe_at <= now]

    def is_up(self, url: str) -> bool:
        return not self.encoders[url].down
