"""`mmferry serve --cuda-graphs`: its options, and a clear refusal off CUDA."""

from __future__ import annotations

import argparse

import pytest

from mmferry.cli import main
from mmferry.commands import UsageError
from mmferry.commands.model_args import graph_options


def _args(**kw) -> argparse.Namespace:
    base = dict(cuda_graphs=True, device="cuda", max_batch_patches=16384, cuda_graph_mib=8192)
    return argparse.Namespace(**{**base, **kw})


def test_budgets_reach_the_largest_call_the_batcher_makes():
    opts = graph_options(_args())
    assert opts["cuda_graphs"] is True
    assert opts["token_budgets"] == (1024, 2048, 4096, 8192, 16384)
    assert opts["graph_memory_limit"] == 8192 << 20
    assert graph_options(_args(max_batch_patches=20000))["token_budgets"][-1] == 32768
    assert graph_options(_args(max_batch_patches=1 << 20))["token_budgets"][-1] == 65536
    assert graph_options(_args(max_batch_patches=0))["token_budgets"] == (1024,)
    assert graph_options(_args(cuda_graphs=False)) == {}
    assert graph_options(argparse.Namespace(device="cpu")) == {}  # encode has no such flag


def test_refusals_name_the_option():
    with pytest.raises(UsageError, match="--cuda-graphs needs a CUDA --device"):
        graph_options(_args(device="cpu"))
    with pytest.raises(UsageError, match="--cuda-graph-mib"):
        graph_options(_args(cuda_graph_mib=-1))


def test_serve_with_cuda_graphs_on_the_cpu_stops_before_listening(capsys):
    assert main(["serve", "--cuda-graphs", "--depth", "1", "--port", "0"]) == 2
    assert "--cuda-graphs needs a CUDA --device" in capsys.readouterr().err
