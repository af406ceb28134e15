"""128-bit item keys: the source's identity bytes plus every processor setting.

The layout is deliberately left out: both layouts encode to the same embeddings, so they share
one cache key. Parts are buffers (memoryviews of arrays, encoded bytes), never copied.

BLAKE3 with a 128-bit output: as collision-resistant as the key length allows (a cache key an
attacker could collide would serve one user's image rows to another), and 3-7x the speed of
SHA-256 on one core, even against x86 SHA-NI (BENCHMARKS.md), so a 12 MP item's key costs
well under its resize. vLLM keys multimodal items with BLAKE3 too.

NOTE: one thread per key. The key runs beside its item's resize and gather (threads.py) or,
in a batch, beside other items, so those threads are busy; blake3's own threads were slower
than one on a shared 2-core host (BENCHMARKS.md) and would only help one huge item on an
otherwise idle many-core host, where the key is already not the longest part.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from blake3 import blake3

from mmferry.config import ProcessorConfig

DIGEST_BYTES = 16


class ChunkedPart:
    """An identity part whose bytes are made a chunk at a time while they are hashed (RGB held
    in 4-byte pixels, packed: decode.py); hashed exactly as one buffer of those bytes."""

    nbytes: int

    def chunks(self) -> Iterator[memoryview]:
        raise NotImplementedError


def _nbytes(part: bytes | memoryview | ChunkedPart) -> int:
    return part.nbytes if isinstance(part, ChunkedPart) else memoryview(part).nbytes


def item_hash(
    modality: str,
    identity: Iterable[bytes | memoryview | ChunkedPart],
    cfg: ProcessorConfig,
    extra: bytes = b"",
) -> str:
    """128-bit hex digest over length-framed parts, so no two part lists collide.

    The bytes hashed: for each part of (modality, settings fingerprint, extra, *identity), its
    length as 8 little-endian bytes, then the part itself."""
    # NOTE: blake3 releases the GIL while it hashes a large buffer, so keys of items on
    # different threads run in parallel.
    h = blake3()
    for part in (modality.encode(), cfg.fingerprint(), extra, *identity):
        h.update(_nbytes(part).to_bytes(8, "little"))
        if isinstance(part, ChunkedPart):
            for chunk in part.chunks():
                h.update(chunk)
        else:
            h.update(part)
    return h.digest(length=DIGEST_BYTES).hex()


def identity_nbytes(identity: Iterable[bytes | memoryview | ChunkedPart]) -> int:
    """Bytes an item hash reads for these parts (what decides whether it runs alongside)."""
    return sum(_nbytes(part) for part in identity)
