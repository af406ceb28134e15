"""Encoder output cache keyed by item hash, bounded in bytes, verified by length on every hit."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mmferry.encoder.model import VisionOutput
    from mmferry.items import MultimodalItem


def _nbytes(out: VisionOutput) -> int:
    return sum(t.numel() * t.element_size() for t in (out.embeds, *out.deepstack))


class EncoderCache:
    """LRU of `VisionOutput`s by item hash, holding at most `capacity_bytes`."""

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes < 0:
            raise ValueError("capacity_bytes must be >= 0")
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self.hits = self.misses = self.length_mismatches = 0
        self._entries: OrderedDict[str, VisionOutput] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: str, num_tokens: int) -> VisionOutput | None:
        """The cached output for `key` if it has exactly `num_tokens` rows, else None."""
        out = self._entries.get(key)
        if out is not None and out.embeds.shape[0] != num_tokens:
            # NOTE: never trim: a wrong-length entry is evicted and the item re-encoded.
            self.length_mismatches += 1
            self._evict(key)
            out = None
        if out is None:
            self.misses += 1
            return None
        self.hits += 1
        self._entries.move_to_end(key)
        return out

    def put(self, key: str, out: VisionOutput) -> bool:
        """Insert; False when the entry alone is larger than the whole cache."""
        size = _nbytes(out)
        if size > self.capacity_bytes:
            return False
        if key in self._entries:
            self._evict(key)
        while self.used_bytes + size > self.capacity_bytes:
            self._evict(next(iter(self._entries)))
        self._entries[key] = out
        self.used_bytes += size
        return True

    def _evict(self, key: str) -> None:
        self.used_bytes -= _nbytes(self._entries.pop(key))


def encode_with_cache(
    encode: Callable[[Sequence[MultimodalItem]], list[VisionOutput]],
    items: Sequence[MultimodalItem],
    cache: EncoderCache,
) -> list[VisionOutput]:
    """Outputs for `items`: cache hits reused, misses deduplicated by hash and encoded once."""
    found: dict[str, VisionOutput] = {}
    misses: dict[str, MultimodalItem] = {}
    for it in items:
        if it.hash in found or it.hash in misses:
            continue
        hit = cache.get(it.hash, it.num_tokens)
        if hit is None:
            misses[it.hash] = it
        else:
            found[it.hash] = hit
    if misses:
        for key, out in zip(misses, encode(list(misses.values()))):
            found[key] = out
            cache.put(key, out)
    return [found[it.hash] for it in items]
