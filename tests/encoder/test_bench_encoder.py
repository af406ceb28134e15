"""The encoder benchmark's CPU-checkable parts: its arguments, the towers it names, and the
--full path end to end on a tiny tower on the CPU (the device run must not be its first run)."""

from __future__ import annotations

import pytest
import torch

from mmferry.bench import encoder as bench
from mmferry.bench import harness
from mmferry.models import spec_for


def test_arguments_and_their_refusals():
    a = bench.parse_args([])
    assert (a.full, a.rounds, a.peak_tflops) == (False, 10, None)
    assert a.towers == ["qwen2.5-vl-7b", "qwen3-vl-2b", "qwen3-vl-8b"]
    a = bench.parse_args(["--full", "--towers", "qwen3-vl-2b, qwen3-vl-8b", "--peak-tflops", "989"])
    assert a.towers == ["qwen3-vl-2b", "qwen3-vl-8b"] and a.peak_tflops == 989
    for bad in (
        ["--full", "--towers", "qwen3-vl-4b"],
        ["--full", "--towers", ","],
        ["--full", "--rounds", "3"],
        ["--full", "--peak-tflops", "0"],
        ["--peak-tflops", "989"],
        ["--towers", "qwen3-vl-2b"],
    ):
        with pytest.raises(SystemExit) as e:
            bench.parse_args(bad)
        assert e.value.code == 2, bad


def test_full_size_towers_have_the_published_shapes():
    q25 = bench.TOWERS["qwen2.5-vl-7b"]()
    assert (q25.family, q25.depth, q25.hidden_size, q25.intermediate_size) == (
        "qwen2_5_vl", 32, 1280, 3420
    )  # fmt: skip
    assert q25.fullatt_block_indexes == (7, 15, 23, 31) and q25.window_size == 112
    q2 = bench.TOWERS["qwen3-vl-2b"]()
    assert (q2.depth, q2.hidden_size, q2.out_hidden_size) == (24, 1024, 2048)
    q8 = bench.TOWERS["qwen3-vl-8b"]()
    assert (q8.depth, q8.hidden_size, q8.intermediate_size, q8.out_hidden_size) == (
        27, 1152, 4304, 4096
    )  # fmt: skip
    assert q8.deepstack_visual_indexes == (8, 16, 24)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_full_without_cuda_fails_loudly():
    with pytest.raises(SystemExit, match="needs CUDA"):
        bench.main(["--full", "--towers", "qwen3-vl-2b"])


@pytest.mark.parametrize("model", ["qwen2.5-vl", "qwen3-vl"])
def test_tower_path_end_to_end_on_a_tiny_tower(model, capsys):
    report = harness.Report()
    bench.bench_tower(
        report,
        f"tiny {model}",
        5,
        1e12,
        config=spec_for(model).tiny_config,
        device="cpu",
        shapes=((64, 2),),
        latency=(1, 2),
    )
    figures = [f for figs in report.sections.values() for f in figs]
    assert [f.base_name for f in figures] == ["transformers", "eager", "eager"]
    assert all("mmferry MFU" in f.note for f in figures)
    # Both sides' utilisation beside each other.
    assert "transformers" in figures[0].note and "eager" in figures[1].note
    assert "graphs held" in capsys.readouterr().out
