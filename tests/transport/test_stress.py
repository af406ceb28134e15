"""A short stress run: real producer and consumer processes, random consumer SIGKILLs."""

from __future__ import annotations

from mmferry.bench.stress import run_stress


def test_stress_every_delivery_intact_every_slot_reclaimed_no_segment_left():
    res = run_stress(producers=2, consumers=3, items=150, kill_rate=0.02, min_kills=3, seed=1)
    assert res.corrupt == 0, res.line()
    assert res.kills >= 3, res.line()
    assert res.delivered + res.cancelled == res.items, res.line()
    assert res.delivered >= res.items // 2, res.line()
    assert res.leaked_slots == 0 and res.leaked_bytes == 0, res.line()
    assert res.segments_left == [], res.line()
