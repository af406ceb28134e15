"""`Presence`: what an engine's scheduler believes the encoder service holds, and for how long.

The scheduler asks about a request's items together (`ask`), then answers vLLM item by item
(`has`); the service answers how long it keeps each item pinned for this caller (`pinned_s`,
counted from when the lookup was sent), and that answer is the only clock: presence is trusted
for half of it, so the load the plan leads to arrives while the pin still holds, and asked again
after. Anything else (the service down, late, or answering something that is not the protocol)
is "absent": the engine encodes the item itself and keeps serving. An item the service says it
is still encoding (it answered the encode before the rows) is "waiting": the scheduler defers
its request and asks again at its next pass, for at most `wait_s` from the first such answer,
after which the item is absent. An item its router named ahead of the encode (`ahead`) may be
asked about before the service has read it: unknown to the service, it is waiting too until the
service has once said it is encoding it (then unknown means its encode failed: absent), for at
most `wait_s`. The tables of items told present or waiting are bounded in size
and each entry expires, so items that are never allocated (aborted requests) cannot grow them.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Collection

from mmferry.engines.cache_client import CacheClient

log = logging.getLogger("mmferry.presence")
# Trust a present answer for this share of the pin's remaining life: the rest is the margin for
# the step between the plan and the worker's load.
TRUST_SHARE = 0.5
# A pin about to lapse is not worth planning a load on.
MIN_PIN_S = 1.0
# After a failed lookup, answer "absent" without asking for this long: a service that is down or
# slow must not cost every scheduler pass a timeout.
RETRY_AFTER_S = 1.0
MAX_ITEMS = 4096
# How long an item the service is still encoding is waited for: its encode queued behind a
# saturated tower takes seconds; one that takes longer than this is given up (absent).
WAIT_S = 30.0
# An item still being encoded is asked about again no sooner than this, the gap doubling with
# each pending answer up to POLL_MAX_S: the scheduler passes every millisecond or so while a
# request waits, and a lookup per pass would take CPU from the very encode it waits for where
# the two share cores; a short encode is still seen within a few ms.
POLL_S = 0.002
POLL_MAX_S = 0.016


class Presence:
    """The scheduler side of an encoder-cache connector: `has` per item (and `waiting`),
    `claim` when vLLM allocates it, `end_pass` when the step's plan is built. Never raises."""

    def __init__(
        self,
        client: CacheClient,
        *,
        max_items: int = MAX_ITEMS,
        retry_after_s: float = RETRY_AFTER_S,
        wait_s: float = WAIT_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.client = client
        self.max_items = max_items
        self.retry_after_s = retry_after_s
        self.wait_s = wait_s
        self._clock = clock
        # identifier -> (when the service first said it was still encoding it (or, for an item
        # named ahead, did not know it yet), when to ask again, the gap that was, whether the
        # service has said it is encoding it), oldest first.
        self._pending: OrderedDict[str, tuple[float, float, float, bool]] = OrderedDict()
        # Answered "still encoding" in this pass: not asked again before the next.
        self._waiting: set[str] = set()
        # identifier -> until when "present" holds (monotonic seconds), oldest first.
        self._trusted: OrderedDict[str, float] = OrderedDict()
        # Answered "present" in this scheduler pass: the alloc that follows must plan a load
        # even if the entry expired or was pushed out of the table meanwhile.
        self._claimed: set[str] = set()
        # Answered absent in this pass: not asked again before the next.
        self._absent: set[str] = set()
        self._quiet_until = 0.0
        self._down = False

    def __len__(self) -> int:
        return len(self._trusted)

    def has(self, identifier: str) -> bool:
        """Whether the service holds `identifier` now and its pin outlasts the coming load."""
        self.ask([identifier])
        return identifier in self._claimed

    def waiting(self, identifier: str) -> bool:
        """Whether the service said in this pass that it is still encoding `identifier` (and
        it has not been waited for longer than `wait_s`): its request is to be deferred."""
        return identifier in self._waiting

    def ask(self, identifiers: list[str], ahead: Collection[str] = (), wait_s: float = 0.0) -> None:
        """Ask the service about every item of `identifiers` not already answered in this
        pass or trusted, in one lookup; `has` then answers from what it said. A request's
        items are asked together, so the scheduler waits one round trip per service, not one
        per item. `ahead`: items named before the service read them (waited for while it does
        not know them yet). `wait_s`: the items are being waited for and the engine has nothing
        else to do: asked now, whatever the gap, and the service answers once one is held or
        an encode of one begins or ends (at most `wait_s`), instead of the engine asking again
        every pass."""
        now = self._clock()
        self._expire(now)
        unknown = []
        for identifier in dict.fromkeys(identifiers):
            until = self._trusted.get(identifier)
            if until is not None and now < until:
                self._claimed.add(identifier)
                continue
            self._trusted.pop(identifier, None)
            answered = self._claimed, self._absent, self._waiting
            if any(identifier in a for a in answered):
                continue
            entry = self._pending.get(identifier)
            if entry is not None and now < entry[1] and not wait_s:
                self._waiting.add(identifier)  # said pending a moment ago
                continue
            unknown.append(identifier)
        if not unknown or now < self._quiet_until:
            return
        sent = self._clock()
        try:
            if wait_s:
                pins = self.client.lookup_pins(unknown, wait_s)
            else:  # NOTE: a store's reader is asked without a wait (it takes none)
                pins = self.client.lookup_pins(unknown)
            if len(pins) != len(unknown):
                raise ValueError(f"{len(pins)} answers for {len(unknown)} hashes")
        except Exception as e:  # noqa: BLE001 - any failure of the service is "absent"
            self._quiet_until = self._clock() + self.retry_after_s
            if not self._down:
                log.warning(
                    "mmferry service %s unusable, vLLM encodes items itself meanwhile: %s: %s",
                    self.client.url,
                    type(e).__name__,
                    e,
                )
            self._down = True
            return
        if self._down:
            log.warning("mmferry service %s answers again", self.client.url)
            self._down = False
        for identifier, pinned in zip(unknown, pins):
            encoding = pinned is None
            unread = pinned == 0 and identifier in ahead and not self._told(identifier)
            if (encoding or unread) and self._still_waiting(identifier, sent, encoding):
                self._waiting.add(identifier)
                continue
            self._pending.pop(identifier, None)
            if pinned is None or pinned < MIN_PIN_S:
                self._absent.add(identifier)
                continue
            self._remember(identifier, sent + pinned * TRUST_SHARE)
            self._claimed.add(identifier)

    def _told(self, identifier: str) -> bool:
        """Whether the service has said it is encoding `identifier` (while it is waited for)."""
        entry = self._pending.get(identifier)
        return entry is not None and entry[3]

    def _still_waiting(self, identifier: str, now: float, told: bool) -> bool:
        """Whether an item the service is still encoding (`told`), or has not read yet, is
        worth waiting for (within `wait_s` of the first such answer); if so, when to ask
        again: the gap doubles each time."""
        since, _, gap, was_told = self._pending.get(identifier, (now, now, POLL_S / 2, False))
        if now - since < self.wait_s:
            gap = min(2 * gap, POLL_MAX_S)
            self._pending[identifier] = (since, now + gap, gap, was_told or told)
            return True
        log.warning(
            "mmferry service %s has not held %s within %g s; given up (absent)",
            self.client.url,
            identifier,
            self.wait_s,
        )
        return False

    def claim(self, identifier: str) -> bool:
        """vLLM allocated `identifier`: whether it is to be loaded (answered present in this
        pass). The load takes the service's pin, so the entry is forgotten."""
        self._trusted.pop(identifier, None)
        return identifier in self._claimed

    def end_pass(self) -> None:
        """The scheduler pass is over: its "present" answers no longer bind an alloc, and its
        "absent" answers are asked again."""
        self._claimed.clear()
        self._absent.clear()
        self._waiting.clear()

    def _remember(self, identifier: str, until: float) -> None:
        self._trusted.pop(identifier, None)
        self._trusted[identifier] = until
        while len(self._trusted) > self.max_items:
            self._trusted.popitem(last=False)

    def _expire(self, now: float) -> None:
        # Items waited for past twice `wait_s` are no request's any more (aborted ones).
        while self._pending:
            identifier, (since, *_) = next(iter(self._pending.items()))
            if now - since < 2 * self.wait_s and len(self._pending) <= self.max_items:
                break
            del self._pending[identifier]
        # NOTE: entries are in the order they were told; a later one may end sooner, and
        # stays until it reaches the front or the size bound pushes it out (`has` checks it).
        while self._trusted:
            identifier, until = next(iter(self._trusted.items()))
            if until > now:
                break
            del self._trusted[identifier]
