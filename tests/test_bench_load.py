"""The load benchmark's workloads and checks (the timed run itself is `mmferry bench load`)."""

from __future__ import annotations

import io

import pytest
import torch
from PIL import Image

import mmferry as mf
from mmferry.bench import load
from mmferry.server.encoded import EncodedItem


def test_the_distinct_workloads_repeat_no_image():
    loads = {w.name: w for w in load.workloads()}
    for name in ("all distinct", f"{load.PER_REQUEST} JPEGs each"):
        w = loads[name]
        sent = [j for request in w.seq for j in request]
        assert sorted(sent) == list(range(len(w.datas)))  # every image once
        assert len(set(w.datas)) == len(w.datas)
    multi = loads[f"{load.PER_REQUEST} JPEGs each"]
    assert {len(r) for r in multi.seq} == {load.PER_REQUEST}
    sizes = [Image.open(io.BytesIO(d)).size for d in multi.datas]
    assert len(set(sizes)) == len(sizes)  # all-distinct sizes


def test_the_headline_workload_is_the_all_distinct_one():
    # Repeats measure mostly the cache, which the transformers baseline lacks: they come second.
    first, second = load.workloads()[:2]
    assert first.name == "all distinct"
    assert len({j for r in first.seq for j in r}) == len(first.seq)
    assert "repeats" in second.name and "cache" in second.name
    assert len({j for r in second.seq for j in r}) < len(second.seq)


def test_check_refuses_items_out_of_order_and_a_cache_over_its_bound():
    proc = mf.Processor.for_model("qwen3-vl")
    w = load.workloads()[-1]
    request = w.seq[0]
    expected = {j: proc.image(w.datas[j], "compact-u8") for j in request}

    def encoded(j: int) -> EncodedItem:
        it = expected[j]
        rows = torch.zeros(it.num_tokens, 8)
        return EncodedItem("image", rows, (), it.grid_thw, it.num_tokens, it.hash)

    everything = [expected.get(j) for j in range(len(w.datas))]
    run = load.Run(cache_bytes=1000)
    run.responses[0] = [encoded(j) for j in request]
    load.check("in order", run, [request], everything, hashes=True, cache_bytes=1000)
    with pytest.raises(AssertionError, match="encoder cache holds"):
        load.check("cache over", run, [request], everything, hashes=True, cache_bytes=999)
    run.responses[0] = [encoded(j) for j in reversed(request)]
    with pytest.raises(AssertionError, match="request 0"):
        load.check("reversed", run, [request], everything, hashes=True, cache_bytes=1000)
