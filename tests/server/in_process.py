"""A service in the test's own process (a real pool, a one-layer random tower), for tests
that instrument what a request makes it do."""

from __future__ import annotations

import asyncio
from typing import Any

import mmferry as mf
from mmferry.encoder.model import VisionEncoder
from mmferry.models import spec_for
from mmferry.server.limits import Limits
from mmferry.server.service import EncoderService, ServiceConfig

PROC = mf.Processor.for_model("qwen3-vl")
# prepare() never encodes; a one-layer tower keeps the service quick to build.
TOWER = spec_for("qwen3-vl").random_config.with_depth(1)


def prepare(body: dict[str, Any], limits: Limits) -> list[Any]:
    """The request's items from a service in this process (a real pool and encoder)."""

    async def run() -> list[Any]:
        service = EncoderService(
            PROC,
            VisionEncoder.random("qwen3-vl", config=TOWER),
            ServiceConfig(limits=limits, shm_bytes=0, preprocess_threads=2),
        )
        await service.start()
        try:
            return (await service.prepare(body, local=True))[0]
        finally:
            await service.close()

    return asyncio.run(run())
