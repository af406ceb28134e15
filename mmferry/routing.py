"""`Router`: which encoder holds an item, by rendezvous (highest-random-weight) hashing.

Every encoder gets a weight per item key, a hash of (encoder URL, key); the item's choices are
the encoders by falling weight. The same key always ranks the encoders the same way, so repeats
of an item go where its rows are cached; adding an encoder moves only the keys it now wins
(about 1/n of them); and two routers given the same URLs agree with no shared state.

On top of that ranking:
- bounded load: an encoder holding more than (1 + epsilon) x the mean in-flight items of the
  encoders that are up passes new items to the key's next choice;
- down marking: an encoder that failed is skipped until its next probe is due; each failed
  probe doubles the wait (up to `max_backoff_s`), a passed one brings it back. An encoder that
  said how long to leave it alone (a 429's Retry-After) is not probed before then.

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


class Router:
    """Rendezvous routing over encoder URLs with bounded load and down marking."""

    def __init__(
        self,
        urls: Iterable[str],
        *,
        epsilon: float = 0.25,
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
        self.epsilon = epsilon
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.encoders = {u: EncoderState(u) for u in urls}

    @property
    def urls(self) -> list[str]:
        return list(self.encoders)

    def choices(self, key: str) -> list[str]:
        """Every encoder for `key`, best first (up or down, loaded or not)."""
        return sorted(self.encoders, key=lambda u: _weight(u, key), reverse=True)

    def capacity(self) -> int:
        """In-flight items an up encoder may hold before new items pass it by."""
        up = [e for e in self.encoders.values() if not e.down]
        if not up:
            return 0
        total = sum(e.in_flight for e in up) + 1  # counting the item being placed
        return math.ceil((1 + self.epsilon) * total / len(up))

    def route(self, key: str, exclude: Iterable[str] = ()) -> str | None:
        """The encoder for `key`: its first choice that is up, not over capacity and not in
        `exclude` (those already tried); the first up one when all are loaded; None when
        none is up."""
        skip = set(exclude)
        up = [u for u in self.choices(key) if u not in skip and not self.encoders[u].down]
        if not up:
            return None
        cap = self.capacity()
        # NOTE: with a capacity over the mean, some encoder is always under it; it may be
        # excluded (tried already), and then the item goes to its best remaining choice.
        return next((u for u in up if self.encoders[u].in_flight < cap), up[0])

    def acquire(self, url: str) -> None:
        """An item was sent to `url`."""
        self.encoders[url].in_flight += 1

    def release(self, url: str) -> None:
        """An item sent to `url` was answered (or failed)."""
        self.encoders[url].in_flight -= 1

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
        e.down, e.failures, e.probe_at = True, e.failures + 1, now + wait

    def mark_up(self, url: str) -> None:
        """`url` answered (a call or a probe): route to it again."""
        e = self.encoders[url]
        e.down, e.failures, e.probe_at = False, 0, 0.0

    def due(self, now: float | None = None) -> list[str]:
        """Down encoders whose probe is due."""
        now = time.monotonic() if now is None else now
        return [u for u, e in self.encoders.items() if e.down and e.probe_at <= now]

    def is_up(self, url: str) -> bool:
        return not self.encoders[url].down
