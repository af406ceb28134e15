"""`Batcher`: items from concurrent requests -> one encoder call per batch, up to a patch budget.

Requests hand their items over and await them. A cache hit is answered at once; an item whose
hash is already queued or being encoded joins that item's future (encoded once); the rest
queue. `workers` encoder threads (one per core on a CPU tower, one on an accelerator) each run
one call at a time: while they are busy, new items pile up, and a worker that frees up takes
its share of the queue up to the patch budget (no fixed wait, so a lone request is not held):
the queue over the workers, or over fewer where a split would cost more than a tenth more CPU
(`calibrate`, call_cost.py).
A `store` in front (`serve --store`: `mmferry.store.shared`) is asked for the items neither
cached nor in flight before they queue, and given what was encoded once it is answered.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
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
from mmferry.server.call_cost import EXTRA, CallCost, measure
from mmferry.server.metrics import Metrics

log = logging.getLogger("mmferry.server")

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


def pin_threads(n: int) -> None:
    """This thread's torch intra-op count fixed at `n` for its life.

    NOTE: torch copies the process-wide count (the one any thread set last) into a thread at
    the thread's first parallel op, its lazy init, whatever the thread set before: a
    preprocessing job that set 1 around its ops between an encoder thread's start and its first
    op left that encoder on one core for the service's life (one `mmferry serve` run in two, by
    timing). Asking for the count runs that init now; the count set after it stays."""
    torch.get_num_threads()
    torch.set_num_threads(n)


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
        workers: int = 1,
        threads: int | None = None,
    ) -> None:
        """`workers` encoder calls run at once, each on `threads` intra-op threads (default:
        the count of the thread building the batcher: torch's default, or what its caller
        set)."""
        if threads is None:
            threads = torch.get_num_threads()
        self._encode = encode
        self.cache = cache
        self.metrics = metrics
        self.store = store
        # 0 turns batching off: every item is its own encoder call.
        self.max_batch_patches = max_batch_patches
        self.batch_wait_s = batch_wait_s
        self._pending: deque[_Job] = deque()
        self._queued = 0  # patches in `_pending`
        # None: a short queue is split over every idle worker (one worker, or not measured).
        self.cost: CallCost | None = None
        self._inflight: dict[str, asyncio.Future[VisionOutput]] = {}
        self._wake = asyncio.Event()
        if workers < 1 or threads < 1:
            raise ValueError(f"workers and threads must be at least 1, got {workers}, {threads}")
        self.workers, self.threads = workers, threads
        self._idle = workers
        self._executor = ThreadPoolExecutor(
            workers,
            thread_name_prefix="mmferry-encoder",
            initializer=pin_threads,
            initargs=(threads,),
        )
        self._task: asyncio.Task[None] | None = None
        self._calls: set[asyncio.Task[None]] = set()  # held: the loop keeps weak references

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        for task in [self._task, *self._calls]:
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._executor.shutdown(wait=True)

    async def calibrate(self, small: list[MultimodalItem], large: list[MultimodalItem]) -> None:
        """Weigh later splits by this encoder's call cost, measured on `small` and `large` (a
        few items of different sizes) on a worker; only where several workers run."""
        if self.workers < 2:
            return
        patches = (sum(i.num_patches for i in small), sum(i.num_patches for i in large))
        loop = asyncio.get_running_loop()
        self.cost = cost = await loop.run_in_executor(
            self._executor, measure, self._encode, small, large, patches
        )
        if cost is not None:
            log.info(
                "an encoder call costs %.2f ms of CPU and %.1f us a patch: a short queue is "
                "split over the %d workers where each further call adds at most %d%% of its CPU",
                cost.fixed_s * 1e3,
                cost.per_patch_s * 1e6,
                self.workers,
                round(EXTRA * 100),
            )

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
                self._queued += it.num_patches
            futures.append(fut)
        self.metrics.queue_depth.set(len(self._pending))
        self._wake.set()
        # NOTE: shielded, so a client that disconnects cancels only its own wait, never the
        # shared future other requests joined.
        return list(await asyncio.gather(*(asyncio.shield(f) for f in futures)))

    def _take(self, most: int) -> list[_Job]:
        """The next batch: queued items in order, up to the patch budget and `most` items."""
        batch = [self._pending.popleft()]
        patches = batch[0].item.num_patches
        while self._pending and self.max_batch_patches > 0 and len(batch) < most:
            n = self._pending[0].item.num_patches
            if patches + n > self.max_batch_patches:
                break
            batch.append(self._pending.popleft())
            patches += n
        self._queued -= patches
        return batch

    def _share(self) -> int:
        """Items a worker takes now: the queue over the workers, or over as many calls as
        are worth their fixed cost."""
        calls = self.workers
        if self.cost is not None:
            calls = self.cost.shares(self._queued, calls)
        return -(-len(self._pending) // calls)

    def _encode_owned(self, items: list[MultimodalItem]) -> list[VisionOutput]:
        return [_owned(o) for o in self._encode(items)]

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            # NOTE: the queue is shared among all the workers, busy ones too: a worker that
            # took everything would leave the others idle when they free up (on a CPU host
            # each worker is a core), and a share left queued goes to the next one free.
            share = self._share()
            while self._pending and self._idle:
                if self.batch_wait_s > 0:
                    await asyncio.sleep(self.batch_wait_s)
                    if not self._pending:
                        break
                    share = self._share()
                batch = self._take(share)
                self._idle -= 1
                call = asyncio.ensure_future(self._call(batch))
                self._calls.add(call)
                call.add_done_callback(self._calls.discard)

    async def _call(self, batch: list[_Job]) -> None:
        """One encoder call on a worker; its items answered, then the worker is idle again."""
        try:
            await self._answer(batch)
        finally:
            self._idle += 1
            self._wake.set()

    async def _answer(self, batch: list[_Job]) -> None:
        loop = asyncio.get_running_loop()
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
            return
        self.metrics.encoded_items.inc(len(batch))
        for job, out in zip(batch, outs):
            self.cache.put(job.item.hash, out)
            self._inflight.pop(job.item.hash, None)
            if not job.future.done():
                job.future.set_result(out)
