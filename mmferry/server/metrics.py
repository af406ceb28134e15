"""The service's Prometheus metrics, in a registry of its own (the `server` extra)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

STAGES = ("read", "fetch", "preprocess", "queue", "encode", "respond")


class Staged:
    """What the service's and the proxy's metrics share: a registry with a `stage_seconds`
    histogram, stage timing and the scrape body."""

    registry: Any
    stage_seconds: Any

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        """Time the enclosed block as stage `name`."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.stage_seconds.labels(name).observe(time.perf_counter() - t0)

    def render(self) -> tuple[bytes, str]:
        """(body, content type) for GET /metrics."""
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class Metrics(Staged):
    """Queue depth, batch sizes, per-stage latency, cache hits, pool fallbacks, errors."""

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry()
        r = self.registry
        self.queue_depth = Gauge("mmferry_queue_depth", "items waiting for the encoder", registry=r)
        self.in_flight = Gauge("mmferry_requests_in_flight", "admitted requests", registry=r)
        self.batch_items = Histogram(
            "mmferry_batch_items",
            "items per encoder call",
            buckets=(1, 2, 4, 8, 16, 32, 64, 128),
            registry=r,
        )
        self.batch_patches = Histogram(
            "mmferry_batch_patches",
            "patches per encoder call",
            buckets=(256, 1024, 4096, 16384, 65536, 262144),
            registry=r,
        )
        self.stage_seconds = Histogram(
            "mmferry_stage_seconds",
            "latency of each request stage",
            ["stage"],
            buckets=(0.001, 0.005, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
            registry=r,
        )
        self.requests = Counter("mmferry_requests", "requests answered", ["status"], registry=r)
        self.errors = Counter("mmferry_errors", "refused or failed requests", ["kind"], registry=r)
        self.cache_hits = Counter("mmferry_cache_hits", "items served by the cache", registry=r)
        self.cache_misses = Counter("mmferry_cache_misses", "items the cache lacked", registry=r)
        self.cache_bytes = Gauge("mmferry_cache_bytes", "bytes the encoder cache holds", registry=r)
        self.dedup_hits = Counter(
            "mmferry_inflight_dedup", "items joined to an identical item in flight", registry=r
        )
        self.encoded_items = Counter("mmferry_encoded_items", "items encoded", registry=r)
        self.lookups = Counter(
            "mmferry_cache_lookups",
            "items engines' connectors looked up, by answer (present, pending or absent)",
            ["answer"],
            registry=r,
        )
        self.pool_fallbacks = Counter(
            "mmferry_pool_fallbacks",
            "shared-memory responses sent inline because the arena was full",
            registry=r,
        )
        for stage in STAGES:  # every stage shows up from the first scrape
            self.stage_seconds.labels(stage)
