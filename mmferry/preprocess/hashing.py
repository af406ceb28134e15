"""128-bit item hashes: the source's identity bytes plus every processor setting.

The layout is deliberately left out: both layouts encode to the same embeddings, so they share
one cache key.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

from mmferry.config import ProcessorConfig

_DIGEST_BYTES = 16


def item_hash(
    modality: str,
    identity: Iterable[bytes | memoryview],
    cfg: ProcessorConfig,
    extra: bytes = b"",
) -> str:
    """blake2b-128 hex digest over length-framed parts, so no two part lists collide."""
    h = hashlib.blake2b(digest_size=_DIGEST_BYTES)
    for part in (modality.encode(), cfg.fingerprint(), extra, *identity):
        h.update(memoryview(part).nbytes.to_bytes(8, "little"))
        h.update(part)
    return h.hexdigest()
