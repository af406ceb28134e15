"""`EncoderService`: one request from checked bytes to its response, free of HTTP details.

The app (app.py) calls `handle` with the parsed JSON body (content parts or chat messages,
sources.py); the service fetches each part's remote URLs (in their own slots, remote.py), reads
and checks the rest and preprocesses on a small thread pool (with the part's own qwen-vl-utils
keys, as the library does), encodes through the batcher and builds the response (safetensors
bytes, or shared-memory handles for a client on the same host).
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import itertools
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch

from mmferry.chat.media import build_item
from mmferry.chat.parts import MediaPart, PartError, read_part
from mmferry.chat.sources import Reference
from mmferry.embed.cache import EncoderCache
from mmferry.encoder.model import VisionEncoder, VisionOutput
from mmferry.items import MultimodalItem
from mmferry.preprocess.batch import batch_threads
from mmferry.preprocess.item_pool import ItemPool
from mmferry.preprocess.scheduler import header_size, image_bytes
from mmferry.processor import Processor
from mmferry.server.batching import Batcher
from mmferry.server.encoded import EncodedItem, to_bytes
from mmferry.server.limits import Limits, RequestError, shown
from mmferry.server.metrics import Metrics
from mmferry.server.remote import RemoteFetcher
from mmferry.server.sglang_push import CONNECT_S
from mmferry.server.sources import (
    check_frame,
    check_frame_count,
    check_generic,
    check_media,
    parse_request,
    refused,
    source_policy,
)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
RESPONSES = ("safetensors", "shm")
OPTIONS = ("layout", "dtype", "response")
# Base64 characters decoded to read an image's size for scheduling: 3 KiB first (a PNG's or a
# plain JPEG's header), then 48 KiB (a JPEG's frame header after a large EXIF block too). The
# whole of a small image's payload took 75 us to decode, for a header in its first bytes.
_HEADER_B64 = (4096, 65536)


@dataclass(frozen=True)
class ServiceConfig:
    """Runtime settings of one service process (the model is passed in built)."""

    limits: Limits = field(default_factory=Limits)
    max_batch_patches: int = 16384  # 0: batching off, one item per encoder call
    batch_wait_s: float = 0.0
    max_queue: int = 64  # admitted requests at once; the next one gets 503
    cache_bytes: int = 512 << 20
    shm_bytes: int = 256 << 20  # 0: no shared-memory responses
    shm_ttl_s: float = 60.0  # handles nobody opened within this are cancelled
    # Parts preprocessed at once, across requests (None: this machine's cores, as the batch API).
    preprocess_threads: int | None = None
    fetch_concurrency: int = 8  # remote fetches at once, beside the preprocessing threads
    # Encoder calls at once, the intra-op threads split among them (None: one per intra-op
    # thread on a CPU tower, one call on an accelerator; see `encoder_workers`).
    encoder_workers: int | None = None
    api_key: str | None = None
    drain_timeout_s: float = 30.0  # SIGTERM to exit, however many requests are still open
    body_timeout_s: float = 30.0  # a request body must arrive in full within this (408)
    header_timeout_s: float = 10.0  # a request's headers must arrive within this (408)
    # SGLang's /encode: its receive address must be connected within this (sglang_push.py).
    sglang_connect_s: float = CONNECT_S
    max_uploads: int = 64  # request bodies arriving at once; the next one gets 503
    # A shared store of encoder outputs (mooncake://...; mmferry/store/) and the checkpoint
    # folder (or random tower's name) whose identity keys it; None: this service's cache only.
    store: str | None = None
    model: str = ""

    def __post_init__(self) -> None:
        if self.preprocess_threads is None:
            # NOTE: frozen: the resolved default is written once, here.
            object.__setattr__(self, "preprocess_threads", batch_threads(None))
        if self.encoder_workers is not None and self.encoder_workers < 1:
            raise ValueError("encoder_workers must be at least 1")
        for name in ("max_queue", "max_uploads", "preprocess_threads", "fetch_concurrency"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")
        for name in ("drain_timeout_s", "body_timeout_s", "header_timeout_s", "sglang_connect_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive")


@dataclass
class EncodeResult:
    """A response: a safetensors blob, or a JSON document of shared-memory handles."""

    items: list[EncodedItem]
    body: bytes | dict[str, Any]


def _handle_json(handle: Any) -> dict[str, Any]:
    d = dataclasses.asdict(handle)
    inline = d.pop("inline")
    d["inline_b64"] = None if inline is None else base64.b64encode(inline).decode()
    d["shape"] = list(d["shape"])
    return d


class EncoderService:
    """Fetch, check, preprocess, batch-encode and answer; shared by every request."""

    def __init__(
        self,
        processor: Processor,
        encoder: VisionEncoder,
        config: ServiceConfig,
        *,
        encode: Callable[[Sequence[MultimodalItem]], list[VisionOutput]] | None = None,
    ) -> None:
        self.processor = processor
        self.encoder = encoder
        self.config = config
        # The generic family (transformers' own processor, images only) has no native
        # settings: no resize rules to size a header by, no per-item keys, no videos.
        self.generic = not processor.native
        self._cfg = None if self.generic else processor.config
        self.metrics = Metrics()
        self.cache = EncoderCache(config.cache_bytes)
        self.metrics.cache_bytes.set_function(lambda: self.cache.used_bytes)
        self.store = _shared_store(config, encoder, self.metrics, generic=self.generic)
        # `encode` replaces a plain encoder call (the sharded leader under torchrun: one call at
        # a time, its ranks in step).
        workers, threads = encoder_workers(
            config.encoder_workers, encoder.device if encode is None else None
        )
        self.batcher = Batcher(
            encode or encoder,
            self.cache,
            self.metrics,
            max_batch_patches=config.max_batch_patches,
            batch_wait_s=config.batch_wait_s,
            store=self.store,
            workers=workers,
            threads=threads,
        )
        # Requests first come, first served; a request's items largest first (item_pool.py).
        self._pool = ItemPool(config.preprocess_threads)
        self._requests = itertools.count()
        limits = config.limits
        self._policy = source_policy(limits)
        self._remote = RemoteFetcher(
            config.fetch_concurrency, limits.fetch_timeout_s, limits.max_request_bytes
        )
        self._arena: Any = None
        self._handles: deque[tuple[float, Any]] = deque()
        if config.shm_bytes > 0:
            from mmferry.transport.shm import ShmArena

            self._arena = ShmArena(config.shm_bytes, on_full="inline", max_readers=1)

    @property
    def shm_segment(self) -> str | None:
        return None if self._arena is None else self._arena.name

    async def start(self) -> None:
        items = self._calibration_items() if self.batcher.workers > 1 else None
        if items is not None:
            await self.batcher.calibrate(*items)
        self.batcher.start()

    def _calibration_items(self) -> tuple[list[MultimodalItem], list[MultimodalItem]] | None:
        """Two blank images of 64 and 256 patches at a merge size of 2, the items that measure
        a call's fixed and per-patch cost (call_cost.py); None for the generic family (its
        processor's items, its sizes)."""
        cfg = self._cfg
        if cfg is None:
            return None
        layout = self.processor.layouts[0]
        m, p = cfg.merge_size, cfg.patch_size
        width = 3 * p * p * (cfg.temporal_patch_size if layout == "hf" else 1)
        dtype = torch.float32 if layout == "hf" else torch.uint8

        def blank(side: int) -> MultimodalItem:
            grid = (1, side * m, side * m)
            rows = torch.zeros(grid[1] * grid[2], width, dtype=dtype)
            return MultimodalItem("image", rows, grid, layout, f"calibration-{side}", m)

        return [blank(4)], [blank(8)]

    async def close(self) -> None:
        """Stop the encoder thread and release the shared-memory arena."""
        await self.batcher.stop()
        await self._remote.close()
        await asyncio.to_thread(self._pool.shutdown)
        if self._arena is not None:
            self._arena.close()
        if self.store is not None:
            await asyncio.to_thread(self.store.close)

    # -- one request ----------------------------------------------------------------------

    def _options(self, options: dict[str, Any], local: bool) -> tuple[str, torch.dtype, str]:
        unknown = sorted(set(options) - set(OPTIONS))
        if unknown:
            named = ", ".join(shown(k, 40) for k in unknown[:5])
            more = f" and {len(unknown) - 5} more" if len(unknown) > 5 else ""
            raise RequestError(
                422,
                "bad_request",
                f"unknown field(s) {named}{more}; accepted: content or messages, "
                f"{', '.join(OPTIONS)}",
            )
        layouts = self.processor.layouts
        layout = _choice(options, "layout", layouts[0], layouts)
        dtype_name = _choice(
            options, "dtype", str(self.encoder.dtype).removeprefix("torch."), tuple(DTYPES)
        )
        response = _choice(options, "response", "safetensors", RESPONSES)
        if response == "shm" and (self._arena is None or not local):
            why = "the server runs with --shm-mib 0" if self._arena is None else "it is remote"
            raise RequestError(
                422, "bad_request", f"shared-memory responses need a same-host client; {why}"
            )
        return layout, DTYPES[dtype_name], response

    async def _prepare(self, part: MediaPart, layout: str, request: int) -> MultimodalItem:
        remote = [r.value for r in part.references() if r.scheme == "remote"]
        fetched, fetched_s = {}, 0.0
        if remote:
            # NOTE: on the event loop, in their own slots: never on the preprocessing threads.
            t0 = time.perf_counter()
            datas = await asyncio.gather(*(self._remote.fetch(u, part.where) for u in remote))
            fetched, fetched_s = dict(zip(remote, datas)), time.perf_counter() - t0
        job = partial(self._preprocess, part, layout, fetched, fetched_s)
        # NOTE: a fetched file's header is parsed off the event loop (its bytes are any
        # size); a data: URL's on it: its head is at most 48 KiB decoded, 20-40 us for a plain
        # JPEG's first 3 KiB, where a hop to a thread and back cost 60-150 us of CPU a part.
        if remote:
            size = await asyncio.to_thread(self._size, part, layout, fetched)
        else:
            size = self._size(part, layout, fetched)
        return await asyncio.wrap_future(self._pool.submit(job, group=request, size=size))

    def _size(self, part: MediaPart, layout: str, fetched: dict[str, bytes]) -> int | None:
        """Host bytes an image part will hold, from its header where one is at hand (fetched
        bytes, the head of a data: payload); None otherwise (a file not read yet, videos) and
        for a header over the pixel limit (refused when the part is read, and never a size
        the buffer cache is raised to)."""
        source = part.source
        if part.modality != "image" or not isinstance(source, Reference) or self._cfg is None:
            return None
        if source.scheme == "remote":
            heads: list[Any] = [fetched.get(source.value)]
        elif source.scheme == "data":
            heads = list(dict.fromkeys(source.value[:n] for n in _HEADER_B64))  # distinct
        else:
            return None
        cfg = self._cfg
        limit = min(self.config.limits.max_pixels, cfg.max_decoded_pixels)
        for head in heads:
            if isinstance(head, str):
                try:
                    head = base64.b64decode(head, validate=False)
                except ValueError:  # a slice off the 4-character grid: the next one
                    continue
            size = header_size(head) if head is not None else None
            if size is not None:
                return image_bytes(*size, cfg, layout, limit)
        return None

    def _preprocess(
        self,
        part: MediaPart,
        layout: str,
        fetched: dict[str, bytes],
        fetched_s: float,
        threads: int,
    ) -> MultimodalItem:
        """On the pool: read a part's local sources, check their headers, preprocess it."""
        limits = self.config.limits
        t0 = time.perf_counter()
        try:
            if part.modality == "video" and isinstance(part.source, list):
                # A list of frames: each read and checked from its header just before it is
                # decoded (chat/media.py), so one frame's bytes and pixels are held at a time.
                def read_frame(k: int, source: Any) -> Any:
                    one = read_part(dataclasses.replace(part, source=source), self._policy, fetched)
                    check_frame(part, k, one.source, limits, self._cfg)
                    return one.source

                t1 = time.perf_counter()
                self.metrics.stage_seconds.labels("fetch").observe(fetched_s)
                item = build_item(
                    self.processor, part, layout, {}, threads=threads, read_frame=read_frame
                )
            else:
                part = read_part(part, self._policy, fetched)
                check_media(part, limits, self._cfg)
                t1 = time.perf_counter()
                self.metrics.stage_seconds.labels("fetch").observe(fetched_s + t1 - t0)
                if self.generic:
                    item = self.processor.image(part.source, layout, threads=threads)
                else:
                    item = build_item(self.processor, part, layout, {}, threads=threads)
        except PartError as e:
            raise refused(e) from None
        except ValueError as e:  # a decoder's refusal outside the part's own checks
            raise RequestError(422, "bad_media", f"{part.where}: {e}") from None
        self.metrics.stage_seconds.labels("preprocess").observe(time.perf_counter() - t1)
        return item

    async def prepare(
        self, body: Any, *, local: bool
    ) -> tuple[list[MultimodalItem], torch.dtype, str]:
        """A request's items, preprocessed (fetches in their slots, the rest on the pool), with
        the answer's dtype and form; RequestError for anything refused."""
        parts, options = parse_request(body, self._policy)
        layout, dtype, response = self._options(options, local)
        for part in parts:
            if self.generic:
                check_generic(part, self.processor)
                continue
            # NOTE: before any source is fetched or read: a list of frames is counted from its
            # length (500 references under --limit-frames 10 read nothing).
            check_frame_count(part, self.config.limits, self._cfg)
        request = next(self._requests)
        tasks = [asyncio.ensure_future(self._prepare(part, layout, request)) for part in parts]
        try:
            items = await asyncio.gather(*tasks)
        except BaseException:
            # One refused part refuses the request: the others' fetches and queued work stop.
            for t in tasks:
                t.cancel()
            raise
        return list(items), dtype, response

    async def handle(self, body: Any, *, local: bool) -> EncodeResult:
        """Encode every part of one request; RequestError for anything refused."""
        items, dtype, response = await self.prepare(body, local=local)
        outs = await self.batcher.encode(items)
        with self.metrics.stage("respond"):
            encoded = [EncodedItem.of(it, out, dtype=dtype) for it, out in zip(items, outs)]
            if response == "shm":
                return EncodeResult(encoded, self._shm_body(encoded))
            return EncodeResult(encoded, to_bytes(encoded))

    def can_share(self, local: bool) -> bool:
        """Whether answers in shared memory can go to this client (same host, arena on)."""
        return self._arena is not None and local

    def share(self, tensor: torch.Tensor) -> dict[str, Any]:
        """`tensor` in the service's arena, as the JSON of its handle; a handle nobody opens
        within `shm_ttl_s` is cancelled."""
        arena = self._arena
        now = time.monotonic()
        while self._handles and self._handles[0][0] < now:
            arena.cancel(self._handles.popleft()[1])
        handle = arena.put(tensor)
        if handle.inline is not None and handle.nbytes:
            self.metrics.pool_fallbacks.inc()
        else:
            self._handles.append((now + self.config.shm_ttl_s, handle))
        return _handle_json(handle)

    def _shm_body(self, encoded: list[EncodedItem]) -> dict[str, Any]:
        docs = []
        for it in encoded:
            doc = it.facts()
            doc["embeds"] = self.share(it.embeds)
            doc["deepstack"] = [self.share(t) for t in it.deepstack]
            docs.append(doc)
        return {"items": docs}


def encoder_workers(asked: int | None, device: torch.device | None) -> tuple[int, int]:
    """(encoder calls at once, intra-op threads of each): this thread's intra-op count (torch's
    default: the cores) split among the calls.

    NOTE: on a CPU tower the default is one call per thread, each on one thread. One call on
    every thread splits each matmul across the cores and waits for the slowest part, so a core
    the event loop or preprocessing holds for a moment stalls the whole call while the other
    threads spin at the barrier; calls on one thread each never wait for one another. An
    accelerator (or `device` None: the caller's own encode function) runs one call at a
    time."""
    total = torch.get_num_threads()
    if asked is None:
        asked = total if device is not None and device.type == "cpu" else 1
    return asked, max(1, total // asked)


def _shared_store(
    config: ServiceConfig, encoder: VisionEncoder, metrics: Metrics, *, generic: bool
) -> Any:
    """The shared store the config names (looked up before encoding, published to after), or
    None; a generic-family encoder keys its rows by the generic identity."""
    if config.store is None:
        return None
    from mmferry.models.generic import GENERIC
    from mmferry.store.shared import SharedStore

    family = GENERIC if generic else None
    return SharedStore(config.store, encoder, config.model, metrics.registry, family=family)


def _choice(options: dict[str, Any], name: str, default: str, allowed: Sequence[str]) -> str:
    """The request's `name` option, or `default`; 422 unless it is one of `allowed`."""
    value = options.get(name, default)
    if value not in allowed:
        raise RequestError(
            422, "bad_request", f"{name} must be one of {tuple(allowed)}, got {shown(value)}"
        )
    return value
