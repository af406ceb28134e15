"""A short queue split over a CPU tower's workers only where the split is worth its fixed cost:
the cost measured (`call_cost.measure`), the split it allows (`CallCost.shares`), and a real
service's calls for a request of two images on a light tower and on a heavy one."""

from __future__ import annotations

import asyncio
import base64
import time

import pytest

import mmferry as mf
from mmferry.encoder.model import VisionEncoder
from mmferry.models import spec_for
from mmferry.server.call_cost import EXTRA, HEAVY_S, CallCost, measure
from mmferry.server.service import EncoderService, ServiceConfig

from .conftest import png


def test_a_split_is_taken_while_each_further_call_adds_at_most_a_tenth_of_the_compute():
    cost = CallCost(fixed_s=1e-3, per_patch_s=1e-6)
    # 1000 patches: 1 ms of compute; a second call would add 1 ms (100 %).
    assert cost.shares(1000, 2) == 1
    # One more call for each 10 ms of compute.
    assert cost.shares(int(1 / EXTRA) * 1000, 8) == 2
    assert cost.shares(int(3 / EXTRA) * 1000, 8) == 4
    assert cost.shares(int(3 / EXTRA) * 1000, 2) == 2  # never past the workers
    assert cost.shares(0, 2) == 1
    assert CallCost(fixed_s=0.0, per_patch_s=1e-6).shares(1, 4) == 4  # no fixed cost: split


def _burn(seconds: float) -> None:
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass


def test_the_fixed_and_per_patch_parts_are_read_from_two_sizes():
    fixed, per_patch = 4e-3, 50e-6

    def encode(items: list[int]) -> None:
        _burn(fixed + per_patch * sum(items))

    cost = measure(encode, [16], [64], (16, 64))
    assert cost is not None
    assert cost.fixed_s == pytest.approx(fixed, rel=0.25)
    assert cost.per_patch_s == pytest.approx(per_patch, rel=0.25)
    assert measure(encode, [16], [16], (16, 16)) is None  # one size tells nothing apart


def test_a_tower_whose_small_call_is_long_is_compute_and_splits_untimed_further():
    sizes: list[int] = []

    def encode(items: list[int]) -> None:
        sizes.append(sum(items))
        _burn(HEAVY_S * 1.2)

    cost = measure(encode, [64], [256], (64, 256))
    assert cost is not None and cost.fixed_s == 0.0
    assert cost.shares(64, 4) == 4
    assert sizes == [64, 64]  # the large call never run: seconds on a real tower


def _part(seed: int) -> dict:
    url = "data:image/png;base64," + base64.b64encode(png(224, 224, seed)).decode()
    return {"type": "image_url", "image_url": {"url": url}}


def _calls_for_two_images(config) -> tuple[list[int], object]:
    """The items of each encoder call a request of two images made, on a service of two
    single-thread workers with a random qwen3-vl tower of `config`."""
    proc = mf.Processor.for_model("qwen3-vl", image_max_pixels=65536)
    service = EncoderService(
        proc,
        VisionEncoder.random("qwen3-vl", config=config),
        ServiceConfig(shm_bytes=0, preprocess_threads=1, encoder_workers=2),
    )
    calls: list[int] = []

    async def run() -> None:
        await service.start()
        encode = service.batcher._encode  # counted from here: the calibration's calls are done
        service.batcher._encode = lambda items: calls.append(len(items)) or encode(items)
        try:
            await service.handle({"content": [_part(1), _part(2)]}, local=True)
        finally:
            await service.close()

    asyncio.run(run())
    return calls, service.batcher.cost


def test_a_light_tower_encodes_a_short_queue_in_one_call():
    """Two 224x224 images on a tiny tower: two calls of one would cost a quarter to a half
    more CPU than one of two (the call's fixed cost is most of it), so one worker takes both."""
    calls, cost = _calls_for_two_images(spec_for("qwen3-vl").tiny_config)
    assert cost is not None and cost.fixed_s > 0
    assert calls == [2]


def test_a_heavy_tower_still_splits_a_short_queue_over_its_workers():
    """One layer of Qwen3-VL-2B's tower: an image's compute dwarfs the call's fixed cost, so
    the two images go to the two workers at once."""
    calls, cost = _calls_for_two_images(spec_for("qwen3-vl").random_config.with_depth(1))
    assert cost is not None
    assert calls == [1, 1]
