"""`mmferry bench pool`, the capacity model: its figures against a plain recomputation (its own
rendezvous ranking and LRU, written here), and the command line."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys

from mmferry.bench import pool


def _first(urls: list[str], key: str) -> str:
    # The Router's documented ranking: the largest blake2b-64 of "url\0key".
    def w(u: str) -> int:
        return int.from_bytes(
            hashlib.blake2b(f"{u}\0{key}".encode(), digest_size=8).digest(), "big"
        )

    return max(urls, key=w)


def _lru_hits(stream: list[str], size: int) -> int:
    cache: list[str] = []
    hits = 0
    for k in stream:
        if k in cache:
            hits += 1
            cache.remove(k)
        elif len(cache) == size:
            cache.pop(0)
        cache.append(k)
    return hits


def test_rows_against_a_recomputation():
    stream = pool.zipf_stream(3000, 400, 1.1, seed=1)
    n, cache = 8, 20
    rows = {r.placement: r for r in pool.model(stream, n, cache, inflight=2, epsilon=0.25, seed=1)}
    urls = [f"http://encoder-{i}:8000" for i in range(n)]
    first = {k: _first(urls, k) for k in set(stream)}
    per = {u: [k for k in stream if first[k] == u] for u in urls}
    hits = sum(_lru_hits(s, cache) for s in per.values())
    assert rows["hash, no bound"].hit_rate == hits / len(stream)
    load = [len(s) for s in per.values()]
    assert rows["hash, no bound"].imbalance == max(load) / (len(stream) / n)
    assert rows["one big cache"].hit_rate == _lru_hits(stream, cache * n) / len(stream)
    rr = sum(_lru_hits(stream[i::n], cache) for i in range(n))
    assert rows["round-robin"].hit_rate == rr / len(stream)
    # Rendezvous: the keys that move when the last encoder leaves are exactly its own.
    assert rows["hash"].moved_leave == len(set(per[urls[-1]])) / len(set(stream))
    # Bounded load spreads the hot keys: never more imbalanced than the key's first choice.
    assert rows["hash"].imbalance < rows["hash, no bound"].imbalance
    assert rows["hash % n"].moved_leave > 0.5


def test_command_line(tmp_path):
    out = tmp_path / "pool.json"
    args = f"--requests 2000 --images 300 --sizes 4,8 --zipf 0.9 --json {out}"
    run = subprocess.run(
        [sys.executable, "-m", "mmferry", "bench", "pool", "--quick", f"--args={args}"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    data = json.loads(out.read_text())
    assert "Zipf 0.9" in data["setup"] and len(data["rows"]) == 12
    assert "hash hit rate" in run.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "mmferry", "bench", "pool", "prompt", "--args=--zipf 1"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert bad.returncode == 2 and "exactly one benchmark" in bad.stderr


def test_the_routers_defaults_beat_bounded_load_alone():
    # Hot keys spread (the Router's defaults) against bounded load alone (hot_share 0 and the
    # old epsilon 0.25): more hits, and the load more even, on the same stream.
    stream = pool.zipf_stream(3000, 400, 1.1, seed=1)
    old = {r.placement: r for r in pool.model(stream, 8, 20, 2, 0.25, seed=1, hot_share=0)}
    new = {r.placement: r for r in pool.model(stream, 8, 20, 2, pool.EPSILON, seed=1)}
    assert new["hash"].hit_rate > old["hash"].hit_rate + 0.03
    assert new["hash"].imbalance < 1.1 < old["hash"].imbalance
