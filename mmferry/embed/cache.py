"""Encoder output cache keyed by item hash, bounded in bytes, verified by length on every hit.

The encoder returns each item's rows as views of one batch tensor, so a cached view would keep
the whole batch alive. Entries therefore own their rows (copied on insert when they are a view
of something larger), and `used_bytes` counts the storages the cache really holds.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from mmferry.encoder.model import VisionOutput

if TYPE_CHECKING:
    from mmferry.items import MultimodalItem


def _owned(t: torch.Tensor) -> torch.Tensor:
    """`t` itself when it is its storage's only content, else a compact copy of its rows."""
    own = t.numel() * t.element_size()
    if t.untyped_storage().nbytes() == own and t.is_contiguous():
        return t
    return t.clone(memory_format=torch.contiguous_format)


def _nbytes(out: VisionOutput) -> int:
    return sum(t.untyped_storage().nbytes() for t in (out.embeds, *out.deepstack))


class EncoderCache:
    """LRU of `VisionOutput`s by item hash, holding at most `capacity_bytes` of storage."""

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes < 0:
            raise ValueError("capacity_bytes must be >= 0")
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self.hits = self.misses = self.evictions = self.length_mismatches = 0
        self._entries: OrderedDict[str, VisionOutput] = OrderedDict()
        # Called with a key whose entry was stored or dropped (server/pins.py keeps its count
        # of pinned rows outside the cache by them, instead of scanning every pin).
        self._watchers: list[Callable[[str], None]] = []

    def watch(self, changed: Callable[[str], None]) -> None:
        """`changed(key)` after each entry stored or dropped, on the thread that did it."""
        self._watchers.append(changed)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def stats(self) -> dict[str, int]:
        """Counters and occupancy, for an engine's metrics."""
        return {
            "hits": self.hits,
            "misses": self.misses,
            "evictions": self.evictions,
            "length_mismatches": self.length_mismatches,
            "entries": len(self._entries),
            "used_bytes": self.used_bytes,
            "capacity_bytes": self.capacity_bytes,
        }

    def get(self, key: str, num_tokens: int) -> VisionOutput | None:
        """The cached output for `key` if it has exactly `num_tokens` rows, else None."""
        out = self._entries.get(key)
        if out is not None and out.embeds.shape[0] != num_tokens:
            # NOTE: never trim: a wrong-length entry is dropped and the item re-encoded.
            self.length_mismatches += 1
            self._drop(key)
            out = None
        if out is None:
            self.misses += 1
            return None
        self.hits += 1
        self._entries.move_to_end(key)
        return out

    def put(self, key: str, out: VisionOutput) -> bool:
        """Insert (owning the rows); False when the entry alone is larger than the whole cache."""
        own = sum(t.numel() * t.element_size() for t in (out.embeds, *out.deepstack))
        if own > self.capacity_bytes:
            return False
        if key in self._entries:
            self._drop(key)
        while self._entries and self.used_bytes + own > self.capacity_bytes:
            self._drop(next(iter(self._entries)))
            self.evictions += 1
        entry = VisionOutput(_owned(out.embeds), tuple(_owned(d) for d in out.deepstack))
        self._entries[key] = entry
        self.used_bytes += _nbytes(entry)
        for changed in self._watchers:
            changed(key)
        return True

    def peek(self, key: str) -> VisionOutput | None:
        """The entry for `key` without touching counters or recency."""
        return self._entries.get(key)

    def _drop(self, key: str) -> None:
        self.used_bytes -= _nbytes(self._entries.pop(key))
        for changed in self._watchers:
            changed(key)


def encode_with_cache(
    encode: Callable[[Sequence[MultimodalItem]], list[VisionOutput]],
    items: Sequence[MultimodalItem],
    cache: EncoderCache | None,
) -> list[VisionOutput]:
    """Outputs for `items`: cache hits reused, misses deduplicated by hash and encoded once."""
    # Keyed by token count too, so a (vanishingly unlikely) hash collision between two items of
    # different sizes can never hand one the other's rows.
    found: dict[tuple[str, int], VisionOutput] = {}
    misses: dict[tuple[str, int], MultimodalItem] = {}
    for it in items:
        key = (it.hash, it.num_tokens)
        if key in found or key in misses:
            continue
        hit = cache.get(*key) if cache is not None else None
        if hit is None:
            misses[key] = it
        else:
            found[key] = hit
    if misses:
        outs = encode(list(misses.values()))
        if len(outs) != len(misses):
            raise ValueError(f"the encoder returned {len(outs)} outputs for {len(misses)} items")
        for key, out in zip(misses, outs):
            # Hand back the cache's own copy when it kept one, so later hits are the same rows.
            kept = cache is not None and cache.put(key[0], out)
            found[key] = cache.peek(key[0]) if kept else out
    return [found[(it.hash, it.num_tokens)] for it in items]
