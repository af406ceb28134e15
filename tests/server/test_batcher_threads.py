"""The service's encoder thread runs on a definite intra-op thread count."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import torch

import mmferry as mf
from mmferry.embed.cache import EncoderCache
from mmferry.encoder.model import VisionOutput
from mmferry.server.batching import Batcher
from mmferry.server.metrics import Metrics
from mmferry.server.service import encoder_workers


def _encode_once(batcher: Batcher, item) -> None:
    """`item` through a started batcher, then the batcher stopped."""

    async def run() -> None:
        batcher.start()
        try:
            await batcher.encode([item])
        finally:
            await batcher.stop()

    asyncio.run(run())


def test_the_encoder_thread_keeps_the_builders_thread_count():
    """A new thread starts at the count any thread set last; preprocessing sets 1 around its
    ops. The encoder thread must not inherit that: it runs on the count of the thread that
    built the service."""
    item = mf.Processor.for_model("qwen3-vl").image(
        np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8), "compact-u8"
    )
    seen: list[int] = []

    def encode(items):
        seen.append(torch.get_num_threads())
        return [VisionOutput(torch.zeros(it.num_tokens, 4), ()) for it in items]

    before = torch.get_num_threads()
    torch.set_num_threads(3)  # not this host's default, so the test tells the two apart
    try:
        batcher = Batcher(encode, EncoderCache(0), Metrics(), max_batch_patches=0)
        # What a preprocessing thread leaves behind before the first encode.
        poison = threading.Thread(target=torch.set_num_threads, args=(1,))
        poison.start()
        poison.join()

        _encode_once(batcher, item)
    finally:
        torch.set_num_threads(before)
    assert seen == [3]


def test_the_encoder_thread_keeps_its_count_when_another_thread_sets_one_before_its_first_op():
    """torch copies the process-wide count into a thread at the thread's first parallel op
    (its lazy init), not when the thread starts: a preprocessing job that set 1 between the
    encoder thread's start and its first op made the encoder run on one thread for the
    service's whole life (seen in about one `mmferry serve` run in two)."""
    item = mf.Processor.for_model("qwen3-vl").image(
        np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8), "compact-u8"
    )
    seen: list[int] = []

    def encode(items):
        # What a preprocessing job does meanwhile: set 1 (process-wide) around its ops.
        poison = threading.Thread(target=torch.set_num_threads, args=(1,))
        poison.start()
        poison.join()
        seen.append(torch.get_num_threads())  # this thread's first op: torch's lazy init
        return [VisionOutput(torch.zeros(it.num_tokens, 4), ()) for it in items]

    before = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        batcher = Batcher(encode, EncoderCache(0), Metrics(), max_batch_patches=0)

        _encode_once(batcher, item)
    finally:
        torch.set_num_threads(before)
    assert seen == [3]


def test_two_workers_split_the_queue_and_run_at_once_each_on_its_own_threads():
    """Eight items queued before the encoder starts go to two calls of four that run at once
    (one worker taking the whole queue would leave the other idle), each on its worker thread
    with the pinned intra-op count, not the builder's."""
    proc = mf.Processor.for_model("qwen3-vl")
    rng = np.random.default_rng(1)
    items = [
        proc.image(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8), "compact-u8")
        for _ in range(8)
    ]
    calls: list[tuple[str, int, int]] = []
    together = threading.Barrier(2, timeout=30)  # broken unless two calls overlap

    def encode(batch):
        together.wait()
        calls.append((threading.current_thread().name, len(batch), torch.get_num_threads()))
        return [VisionOutput(torch.zeros(it.num_tokens, 4), ()) for it in batch]

    before = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        batcher = Batcher(
            encode, EncoderCache(0), Metrics(), max_batch_patches=1 << 20, workers=2, threads=1
        )

        async def run() -> list:
            queued = asyncio.ensure_future(batcher.encode(items))
            await asyncio.sleep(0)  # the items queue before the encoder starts
            batcher.start()
            try:
                return await queued
            finally:
                await batcher.stop()

        outs = asyncio.run(run())
    finally:
        torch.set_num_threads(before)
    assert [o.embeds.shape[0] for o in outs] == [it.num_tokens for it in items]
    assert sorted(size for _, size, _ in calls) == [4, 4]
    assert len({name for name, _, _ in calls}) == 2
    assert [n for _, _, n in calls] == [1, 1]


def test_a_cpu_tower_gets_one_single_thread_worker_per_thread_an_accelerator_one_call():
    before = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        assert encoder_workers(None, torch.device("cpu")) == (4, 1)
        assert encoder_workers(2, torch.device("cpu")) == (2, 2)
        assert encoder_workers(None, torch.device("cuda", 0)) == (1, 4)
        assert encoder_workers(None, None) == (1, 4)  # the sharded leader: its ranks in step
    finally:
        torch.set_num_threads(before)
