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

        async def run() -> None:
            batcher.start()
            try:
                await batcher.encode([item])
            finally:
                await batcher.stop()

        asyncio.run(run())
    finally:
        torch.set_num_threads(before)
    assert seen == [3]
