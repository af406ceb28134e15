"""The load benchmark's workloads and checks (the timed run itself is `mmferry bench load`)."""

from __future__ import annotations

import dataclasses
import io
import time

import numpy as np
import pytest
import torch
from PIL import Image

import mmferry as mf
from mmferry.bench import load
from mmferry.server.encoded import EncodedItem


@pytest.fixture(scope="module")
def loads() -> list[load.Workload]:
    return load.workloads()


def test_the_distinct_workloads_repeat_no_image(loads):
    loads = {w.name: w for w in loads}
    for name in ("all distinct", f"{load.PER_REQUEST} JPEGs each"):
        w = loads[name]
        sent = [j for request in w.seq for j in request]
        assert sorted(sent) == list(range(len(w.datas)))  # every image once
        assert len(set(w.datas)) == len(w.datas)
    multi = loads[f"{load.PER_REQUEST} JPEGs each"]
    assert {len(r) for r in multi.seq} == {load.PER_REQUEST}
    sizes = [Image.open(io.BytesIO(d)).size for d in multi.datas]
    assert len(set(sizes)) == len(sizes)  # all-distinct sizes


def test_the_headline_workload_is_the_all_distinct_one(loads):
    # Repeats measure mostly the cache, which the transformers baseline lacks: they come second.
    first, second = loads[:2]
    assert first.name == "all distinct"
    assert len({j for r in first.seq for j in r}) == len(first.seq)
    assert "repeats" in second.name and "cache" in second.name
    assert len({j for r in second.seq for j in r}) < len(second.seq)


def test_check_refuses_items_out_of_order_and_a_cache_over_its_bound(loads):
    proc = mf.Processor.for_model("qwen3-vl")
    w = loads[-1]
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


def test_pixels_are_compared_with_the_baselines_processor_and_bounded_where_pillow_resizes(loads):
    # Without torchvision (this environment's torch) transformers' default is its Pillow one.
    processor = load.baseline_processor()
    assert type(processor).__name__ == "Qwen2VLImageProcessorPil"
    distinct = loads[0].datas[:4]  # 256x256, 320x240, 240x320, 384x256
    # Sizes on the 32-pixel grid keep their pixels; the others are resized by two kernels
    # that round apart by a level here and there.
    assert load.pixels_agree(distinct, processor) == [True, False, False, True]
    jpegs = loads[-1].datas[:3]
    assert load.pixels_agree(jpegs, processor) == [False, False, False]


def test_pillow_rounding_in_many_values_passes_where_mmferry_matches_the_exact_resample(loads):
    # JPEG 14 (199x353 -> 192x352) differs from Pillow's in 19 % of its values, by at most 2
    # levels: more values than PIL_SHARE, so it is held to the exact resample instead (the
    # 4-JPEG workload stopped the benchmark here).
    processor = load.baseline_processor()
    jpeg = loads[-1].datas[14]
    assert load.pixels_agree([jpeg], processor) == [False]
    proc = mf.Processor.for_model("qwen3-vl")
    assert load.exact_distance(jpeg, proc) <= load.EXACT_LEVELS
    assert load.exact_distance(loads[0].datas[1], proc) <= 0.52  # one pass (240 -> 256 rows)


def test_the_exact_resample_tells_another_resize_apart(loads):
    """Rows from Pillow's nearest-neighbour resize of the same image, in the same layout, lie
    far from the exact bicubic resample."""
    proc = mf.Processor.for_model("qwen3-vl")
    jpeg = loads[-1].datas[14]
    item = proc.image(jpeg, "compact-u8")
    _, gh, gw = item.grid_thw
    p, m = proc.config.patch_size, item.merge_size
    near = load.baseline_image(jpeg).resize((gw * p, gh * p), Image.NEAREST)
    x = torch.from_numpy(np.array(near)).permute(2, 0, 1)
    rows = x.reshape(3, gh // m, m, p, gw // m, m, p).permute(1, 4, 2, 5, 0, 3, 6)

    class Nearest:
        config = proc.config

        def image(self, data, layout):
            return dataclasses.replace(item, feature=rows.reshape(-1, 3 * p * p).contiguous())

    assert load.exact_distance(jpeg, Nearest()) > 4 * load.EXACT_LEVELS


def test_pixels_that_differ_beyond_resize_rounding_stop_the_benchmark(loads):
    processor = load.baseline_processor()
    processor.image_mean = [m + 0.01 for m in processor.image_mean]  # another normalisation
    with pytest.raises(AssertionError, match="image 0: pixels differ"):
        load.pixels_agree(loads[0].datas[:1], processor)


def test_rows_are_compared_only_for_items_whose_pixels_agree():
    def run(rows: torch.Tensor) -> load.Run:
        r = load.Run()
        r.responses[0] = [EncodedItem("image", rows, (), (1, 2, 2), 1, "")]
        return r

    ours, base = run(torch.zeros(1, 4)), run(torch.full((1, 4), 0.5))
    assert load._agreement(ours, base, [(0,)], [False]) == 0.0
    with pytest.raises(AssertionError, match="request 0"):
        load._agreement(ours, base, [(0,)], [True])
    close = run(torch.full((1, 4), load.ROWS_TOLERANCE / 2))
    assert load._agreement(ours, close, [(0,)], [True]) == pytest.approx(load.ROWS_TOLERANCE / 2)


def test_row_distances_of_another_dtype_skip_items_whose_pixels_differ():
    def run(rows: torch.Tensor) -> load.Run:
        r = load.Run()
        r.responses[0] = [EncodedItem("image", rows, (), (1, 2, 2), 1, "")]
        return r

    f32 = run(torch.zeros(1, 4))
    bf16 = run(torch.tensor([[0.0, 0.25, -0.5, 0.0]], dtype=torch.bfloat16))
    assert load._largest(bf16, f32, [(0,)], [True]) == 0.5
    assert load._largest(bf16, f32, [(0,)], [False]) == 0.0


def test_cpu_seconds_count_every_thread_of_a_process():
    import os
    import threading

    def spin() -> None:
        end = time.thread_time() + 0.3
        while time.thread_time() < end:
            pass

    before = load.cpu_seconds(os.getpid())
    threads = [threading.Thread(target=spin) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # two threads of 0.3 s each, in clock ticks (1/100 s)
    assert load.cpu_seconds(os.getpid()) - before >= 0.55


def test_concurrency_is_a_setting_of_the_capacity_run():
    with pytest.raises(SystemExit, match="--concurrency is a setting of --capacity"):
        load.main(["--concurrency", "1,4,16"])
