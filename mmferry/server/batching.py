"""`Batcher`: items from concurrent requests -> one encoder call per batch, up to a patch budget.

Requests hand their items over and await them. A cache hit is answered at once; an item whose
hash is already queued or being encoded joins that item's future (encoded once); the rest
queue. One worker thread runs the encoder: while it is busy, new items pile up, and the next
call takes as many as the patch budget allows (no fixed wait, so a lone request is not held).
A `store` in front (`serve --store`: `mmferry.store.shared`) is asked for the items neither
cached nor in flight before they queue, and given what was encoded once it is answered.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

import torch

from mmferry.embed.cache import EncoderCache
from mmferry.encoder.model import VisionOutput
from mmferry.items import MultimodalItem
from mmferry.server.metrics import Metrics

EncodeFn = Callable[[Sequence[MultimodalItem]], list[VisionOutput]]


class Store(Protocol):
    """A cache shared beyond this service, in front of its encoder."""

    async def fill(self, items: Sequence[MultimodalItem], cache: EncoderCache) -> None:
        """Put the store's rows of `items` (none cached, none in flight) in `cache`."""

    def publish(self, items: Sequence[MultimodalItem], outs: Sequence[VisionOutput]) -> None:
        """Hand over what was encoded (or found) for `items`, to share it."""


@dataclass
class _Job:
    item: MultimodalItem
    future: asyncio.Future[VisionOutput]
    queued_at: float


def _owned(out: VisionOutput) -> VisionOutput:
    # NOTE: encoder outputs are row views of the batch output; the cache keeps its own rows so
    # one cached item does not hold a whole batch alive (its byte bound stays true).
    return VisionOutput(out.embeds.clone(), tuple(d.clone() for d in out.deepstack))


class Batcher:
    """Deduplicating, batching front of one encoder; runs inside the server's event loop."""

    def __init__(
        self,
        encode: EncodeFn,
        cache: EncoderCache,
        metrics: Metrics,
        *,
        max_batch_patches: int,
        batch_wait_s: float = 0.0,
        store: Store | None = None,
    ) -> None:
        self._encode = encode
        self.cache = cache
        self.metrics = metrics
        self.store = store
        # 0 turns batching off: every item is its own encoder call.
        self.max_batch_patches = max_batch_patches
        self.batch_wait_s = batch_wait_s
        self._pending: deque[_Job] = deque()
        self._inflight: dict[str, asyncio.Future[VisionOutput]] = {}
        self._wake = asyncio.Event()
        # NOTE: torch's intra-op thread count is per thread, and a new thread starts at the
        # count any thread set last (preprocessing sets 1 around its ops and puts its own
        # back), so the encoder thread ran on one core or on all of them by the timing of the
        # first request: one run in about ten was 1.5x faster. It takes the count of the thread
        # that builds the service (torch's default, or what the caller set).
        self._executor = ThreadPoolExecutor(
            1,
            thread_name_prefix="mmferry-encoder",
            initializer=torch.set_num_threads,
            initargs=(torch.get_num_threads(),),
        )
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._executor.shutdown(wait=True)

    @property
    def depth(self) -> int:
        return len(self._pending)

    async def encode(self, items: Sequence[MultimodalItem]) -> list[VisionOutput]:
        """Each item's output, from the cache, an identical item in flight, the store, or a new
        batch."""
        if self.store is None:
            return await self._join(items)
        wanted = [i for i in items if i.hash not in self.cache and i.hash not in self._inflight]
        if wanted:
            await self.store.fill(wanted, self.cache)
        outs = await self._join(items)
        self.store.publish(items, outs)
        return outs

    async def _join(self, items: Sequence[MultimodalItem]) -> list[VisionOutput]:
        loop = asyncio.get_running_loop()
        futures: list[asyncio.Future[VisionOutput]] = []
        for it in items:
            fut = self._inflight.get(it.hash)
            if fut is not None:
                self.metrics.dedup_hits.inc()
                futures.append(fut)
                continue
            hit = self.cache.get(it.hash, it.num_tokens)
            if hit is not None:
                self.metrics.cache_hits.inc()
                fut = loop.create_future()
                fut.set_result(hit)
            else:
                self.metrics.cache_misses.inc()
                fut = loop.create_future()
                self._inflight[it.hash] = fut
                self._pending.append(_Job(it, fut, time.perf_counter()))
            futures.append(fut)
        self.metrics.queue_depth.set(len(self._pending))
        self._wake.set()
        # NOTE: shielded, so a client that disconnects cancels only its own wait, never the
        # shared future other requests joined.
        return list(await asyncio.gather(*(asyncio.shield(f) for f in futures)))

    def _take(self) -> list[_Job]:
        batch = [self._pending.popleft()]
        patches = batch[0].item.num_patches
        while self._pending and self.max_batch_patches > 0:
            n = self._pending[0].item.num_patches
            if patches + n > self.max_batch_patches:
                break
            batch.append(self._pending.popleft())
            patches += n
        return batch

    def _encode_owned(self, items: list[MultimodalItem]) -> list[VisionOutput]:
        return [_owned(o) for o in self._encode(items)]

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._pending:
                if self.batch_wait_s > 0:
                    await asyncio.sleep(self.batch_wait_s)
                batch = self._take()
                self.metrics.queue_depth.set(len(self._pending))
                now = time.perf_counter()
                for job in batch:
                    self.metrics.stage_seconds.labels("queue").observe(now - job.queued_at)
                self.metrics.batch_items.observe(len(batch))
                self.metrics.batch_patches.observe(sum(j.item.num_patches for j in batch))
                items = [j.item for j in batch]
                try:
                    with self.metrics.stage("encode"):
                        outs = await loop.run_in_executor(self._executor, self._encode_owned, items)
                except Exception as e:  # noqa: BLE001 - handed to every waiting request
                    for job in batch:
                        self._inflight.pop(job.item.hash, None)
                        if not job.future.done():
                            job.future.set_exception(e)
                    continue
                self.metrics.encoded_items.inc(len(batch))
                for job, out in zip(batch, outs):
                    self.cache.put(job.item.hash, out)
                    self._inflight.pop(job.item.hash, None)
                    if not job.future.done():
                        job.future.set_result(out)
