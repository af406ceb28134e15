"""Pool: a capacity model of the encoder tier past one rack, with the real `Router`.

Requests for images drawn from a Zipf population (10^6 requests over 10^5 distinct images by
default, exponent `--zipf`) go to a pool of 4 to 256 simulated encoders, each an LRU cache of
`--cache` items (no shared store). Placements, side by side on the same request stream:
- hash: `mmferry.routing.Router` with its defaults (`--epsilon`, `--hot-share`): rendezvous
  hashing, hot keys spread over their first choices, bounded load: requests are in flight
  `--inflight` per encoder on average (the oldest one answered as a new one is placed: every
  encode takes equally long), acquired and released on the router (`mmferry proxy` passes its
  own `--epsilon`);
- hash, no bound: the key's first choice always (rendezvous hashing alone);
- round-robin and random: what vLLM's and SGLang's fronts do with several encoders;
- one big cache: a single LRU of the pool's total size, the bound hash routing is held to.
Figures per pool size: the cache hit rate, the load imbalance (max/mean requests an encoder
served), and the share of distinct keys whose encoder changes when one encoder leaves or one
joins (hash routing by fresh `Router`s over the changed URL lists; `hash % n`, what a plain
modulo placement would move, beside it; round-robin and random keep no key on an encoder, so
nothing of theirs can move: every repeat already lands anywhere).

The model leaves out encode times, a shared store (`serve --store`, which turns every miss an
encoder can read from it into a hit) and failures. Pure CPU, one thread: 7 to 8 minutes at the
full size on a busy 2-core machine (the 128- and 256-encoder pools most of it: a hot key there
may go to any of its first 165 choices, each looked at), under 20 s with --quick (10^5
requests, 10^4 images). No timing is
measured, so nothing here is interleaved or repeated: the stream is seeded, the figures exact.

Goals: hash routing's hit rate within 5 % of one big cache; imbalance at most 1.1 at 64
encoders. Each is printed as met or not, never asserted (a model, not a test).

Run: mmferry bench pool [--quick] or python -m mmferry.bench.pool [--quick] [--zipf S]
[--requests N] [--images N] [--cache N] [--inflight N] [--epsilon E] [--hot-share H]
[--sizes 4,8,...] [--json FILE] [--plot FILE.png]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import sys
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import numpy as np

from mmferry.routing import EPSILON, HOT_SHARE, Router

SIZES = (4, 8, 16, 32, 64, 128, 256)
TOP = 16  # choices kept per key; see `_hash_placement`
MOVE_SAMPLE = 20_000  # distinct keys ranked afresh for the leave/join figures


@dataclass
class Row:
    encoders: int
    placement: str
    hit_rate: float
    imbalance: float  # max/mean requests served per encoder
    encode_imbalance: float  # max/mean misses (encodes) per encoder
    moved_leave: float | None  # share of distinct keys whose encoder changed
    moved_join: float | None


class Lru:
    """An LRU cache of `size` keys: `touch` says whether the key was there, and keeps it."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.keys: OrderedDict[str, None] = OrderedDict()

    def touch(self, key: str) -> bool:
        if key in self.keys:
            self.keys.move_to_end(key)
            return True
        self.keys[key] = None
        if len(self.keys) > self.size:
            self.keys.popitem(last=False)
        return False


def zipf_stream(requests: int, images: int, exponent: float, seed: int) -> list[str]:
    """`requests` item keys (hex digests, as item hashes are) drawn from `images` ranks with
    P(rank k) proportional to k^-exponent."""
    rng = np.random.default_rng(seed)
    p = np.arange(1, images + 1, dtype=np.float64) ** -exponent
    ranks = rng.choice(images, size=requests, p=p / p.sum())
    keys = [hashlib.blake2b(str(i).encode(), digest_size=16).hexdigest() for i in range(images)]
    return [keys[r] for r in ranks]


def _served(stream: Sequence[str], place: Callable[[int, str], int], n: int, cache: int):
    caches = [Lru(cache) for _ in range(n)]
    load = [0] * n
    misses = [0] * n
    for i, key in enumerate(stream):
        e = place(i, key)
        load[e] += 1
        misses[e] += not caches[e].touch(key)
    hits = len(stream) - sum(misses)
    return hits / len(stream), max(load) / (len(stream) / n), max(misses) / (sum(misses) / n)


def _hash_placement(
    urls: list[str], stream: Sequence[str], inflight: int, epsilon: float, hot_share: float
):
    """The real Router placing the stream with `inflight` requests per encoder in flight.

    NOTE: `Router.choices` ranks all n encoders per call (n hashes); it is computed once per
    distinct key and its first TOP kept, then handed to the router in place of its own (the
    same list, cut). Where the cut list could have changed the answer (a hot key that may go
    further down its list than TOP, or an answer over the bound: every choice in it loaded),
    the key's whole ranking replaces the cut one and the router looks again (not counted as
    another request), so every placement is the one the Router makes with its own list.
    """
    router = Router(urls, epsilon=epsilon, hot_share=hot_share)
    ranked = {k: Router.choices(router, k)[:TOP] for k in dict.fromkeys(stream)}
    router.choices = ranked.__getitem__  # type: ignore[method-assign]
    index = {u: i for i, u in enumerate(urls)}
    window = len(urls) * inflight
    ring: list[str | None] = [None] * window
    over = 0
    placed = []
    for i, key in enumerate(stream):
        old = ring[i % window]
        if old is not None:
            router.release(old)
        url = router.route(key)
        assert url is not None  # none is ever marked down here
        cut = len(ranked[key]) < len(urls)
        if cut and (
            router.spread(key) > len(ranked[key])
            or router.encoders[url].in_flight >= router.capacity()
        ):
            ranked[key] = Router.choices(router, key)
            url = router.route(key, count=False)
            assert url is not None
        if router.encoders[url].in_flight >= router.capacity():
            over += 1  # the Router's own rule when every encoder is loaded: the first choice
        router.acquire(url)
        ring[i % window] = url
        placed.append(index[url])
    return placed, ranked, over


def _moved(urls: list[str], keys: list[str], first: dict[str, str]) -> tuple[float, float]:
    """Share of `keys` whose first choice changes when the last encoder leaves, and when a new
    one joins, each ranked by a fresh Router over the changed list."""
    less = Router(urls[:-1])
    more = Router([*urls, "http://encoder-new:8000"])
    leave = sum(less.choices(k)[0] != first[k] for k in keys) / len(keys)
    join = sum(more.choices(k)[0] != first[k] for k in keys) / len(keys)
    return leave, join


def _mod(key: str, n: int) -> int:
    return int(key[:16], 16) % n


def model(
    stream: Sequence[str],
    n: int,
    cache: int,
    inflight: int,
    epsilon: float,
    seed: int,
    hot_share: float = HOT_SHARE,
) -> list[Row]:
    urls = [f"http://encoder-{i}:8000" for i in range(n)]
    placed, ranked, over = _hash_placement(urls, stream, inflight, epsilon, hot_share)
    if over:
        print(f"  {n} encoders: {over} placements over the bound (every encoder loaded)")
    rows = []
    hit, imb, enc = _served(stream, lambda i, _k: placed[i], n, cache)
    distinct = list(ranked)
    sample = random.Random(seed).sample(distinct, min(MOVE_SAMPLE, len(distinct)))
    first = {k: ranked[k][0] for k in sample}
    leave, join = _moved(urls, sample, first)
    rows.append(Row(n, "hash", hit, imb, enc, leave, join))
    index = {u: i for i, u in enumerate(urls)}
    hit, imb, enc = _served(stream, lambda _i, k: index[ranked[k][0]], n, cache)
    rows.append(Row(n, "hash, no bound", hit, imb, enc, leave, join))
    hit, imb, enc = _served(stream, lambda _i, k: _mod(k, n), n, cache)
    mleave = sum(_mod(k, n) != _mod(k, n - 1) for k in sample) / len(sample)
    mjoin = sum(_mod(k, n) != _mod(k, n + 1) for k in sample) / len(sample)
    rows.append(Row(n, "hash % n", hit, imb, enc, mleave, mjoin))
    hit, imb, enc = _served(stream, lambda i, _k: i % n, n, cache)
    rows.append(Row(n, "round-robin", hit, imb, enc, None, None))
    rng = random.Random(seed)
    hit, imb, enc = _served(stream, lambda _i, _k: rng.randrange(n), n, cache)
    rows.append(Row(n, "random", hit, imb, enc, None, None))
    big = Lru(cache * n)
    big_hit = sum(map(big.touch, stream)) / len(stream)
    rows.append(Row(n, "one big cache", big_hit, 1.0, 1.0, None, None))
    return rows


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


def table(rows: list[Row]) -> str:
    head = f"{'encoders':>8}  {'placement':<15} {'hit rate':>8} {'imbalance':>9} {'encodes':>7} "
    head += f"{'moved (leave)':>13} {'moved (join)':>12}"
    lines = [head]
    for r in rows:
        lines.append(
            f"{r.encoders:>8}  {r.placement:<15} {_pct(r.hit_rate):>8} {r.imbalance:>9.3f} "
            f"{r.encode_imbalance:>7.3f} "
            f"{_pct(r.moved_leave):>13} {_pct(r.moved_join):>12}"
        )
    return "\n".join(lines)


def goals(rows: list[Row]) -> list[str]:
    out = []
    by = {(r.encoders, r.placement): r for r in rows}
    for n in sorted({r.encoders for r in rows}):
        hash_, big = by[(n, "hash")], by[(n, "one big cache")]
        gap = (big.hit_rate - hash_.hit_rate) / big.hit_rate if big.hit_rate else 0.0
        met = "met" if gap <= 0.05 else "NOT met"
        out.append(f"{n} encoders: hash hit rate {100 * gap:.1f}% below one big cache ({met})")
    if (64, "hash") in by:
        imb = by[(64, "hash")].imbalance
        out.append(f"64 encoders: imbalance {imb:.3f} ({'met' if imb <= 1.1 else 'NOT met'})")
    return out


def plot(rows: list[Row], path: str, title: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ImportError("--plot needs matplotlib: pip install 'mmferry[plot]'") from None
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name in dict.fromkeys(r.placement for r in rows):
        mine = [r for r in rows if r.placement == name]
        xs = [r.encoders for r in mine]
        left.plot(xs, [100 * r.hit_rate for r in mine], "o-", label=name)
        if name != "one big cache":
            right.plot(xs, [r.imbalance for r in mine], "o-", label=name)
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("encoders in the pool")
        ax.grid(alpha=0.3)
    left.set_ylabel("cache hit rate (%)")
    right.set_ylabel("load imbalance (max/mean requests)")
    right.set_yscale("log")
    right.axhline(1.1, color="black", linewidth=0.8, linestyle="--")
    left.legend(fontsize=7)
    right.legend(fontsize=7)
    fig.suptitle(title, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="10^5 requests over 10^4 images")
    p.add_argument("--requests", type=int, help="requests in the stream (default 10^6)")
    p.add_argument("--images", type=int, help="distinct images (default 10^5)")
    p.add_argument("--zipf", type=float, default=1.0, help="the popularity exponent (1.0)")
    p.add_argument("--cache", type=int, default=1000, help="items each encoder caches (1000)")
    p.add_argument("--inflight", type=int, default=4, help="requests in flight per encoder (4)")
    p.add_argument(
        "--epsilon", type=float, default=EPSILON, help=f"the router's load bound ({EPSILON})"
    )
    p.add_argument(
        "--hot-share",
        type=float,
        default=HOT_SHARE,
        help=f"the router's hot keys: share x n of the requests ({HOT_SHARE}; 0: none)",
    )
    p.add_argument("--sizes", default=",".join(map(str, SIZES)), help="pool sizes")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="FILE", help="every row, as JSON")
    p.add_argument("--plot", metavar="FILE.png", help="hit rate and imbalance (matplotlib)")
    a = p.parse_args(argv)
    requests = a.requests or (10**5 if a.quick else 10**6)
    images = a.images or (10**4 if a.quick else 10**5)
    sizes = [int(s) for s in a.sizes.split(",")]
    if min(sizes) < 2:
        print("pool sizes start at 2 (one must be able to leave)", file=sys.stderr)
        return 2
    title = (
        f"{requests:,} requests, {images:,} images, Zipf {a.zipf}, {a.cache} items per "
        f"encoder, {a.inflight} in flight per encoder, epsilon {a.epsilon}, hot share "
        f"{a.hot_share}, seed {a.seed}"
    )
    print(title, flush=True)
    stream = zipf_stream(requests, images, a.zipf, a.seed)
    rows: list[Row] = []
    for n in sizes:
        t = time.monotonic()
        rows += model(stream, n, a.cache, a.inflight, a.epsilon, a.seed, a.hot_share)
        print(f"  {n} encoders: {time.monotonic() - t:.0f} s", flush=True)
    print(table(rows))
    print("\n".join(goals(rows)))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"setup": title, "rows": [asdict(r) for r in rows]}, f, indent=1)
    if a.plot:
        plot(rows, a.plot, title)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
