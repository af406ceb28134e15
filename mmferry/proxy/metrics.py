"""The proxy's Prometheus metrics, in a registry of its own (the `server` extra)."""

from __future__ import annotations

from collections.abc import Sequence

from mmferry.server.metrics import Staged

LATENCY_BUCKETS = (0.001, 0.005, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class ProxyMetrics(Staged):
    """Per-encoder latency, failures and up/down; items routed and fallen back; TTFT."""

    def __init__(self, encoders: Sequence[str]) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = r = CollectorRegistry()
        self.requests = Counter(
            "mmferry_proxy_requests", "requests answered", ["route", "status"], registry=r
        )
        self.errors = Counter(
            "mmferry_proxy_errors", "refused or failed requests", ["kind"], registry=r
        )
        self.stage_seconds = Histogram(
            "mmferry_proxy_stage_seconds",
            "time in each stage of a request (read: its body arriving and parsed)",
            ["stage"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.in_flight = Gauge("mmferry_proxy_requests_in_flight", "admitted requests", registry=r)
        self.encoder_seconds = Histogram(
            "mmferry_proxy_encoder_seconds",
            "one item's call to one encoder, as the proxy sees it",
            ["encoder"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.encoder_failures = Counter(
            "mmferry_proxy_encoder_failures",
            "encoder calls that failed (refused, timed out, 5xx, an answer not the protocol's)",
            ["encoder", "reason"],
            registry=r,
        )
        self.encoder_up = Gauge(
            "mmferry_proxy_encoder_up", "1 while the encoder is routed to", ["encoder"], registry=r
        )
        self.items_routed = Counter(
            "mmferry_proxy_items_routed", "items an encoder answered", ["encoder"], registry=r
        )
        self.items_fallback = Counter(
            "mmferry_proxy_items_fallback",
            "items sent to the engine as pixels (no encoder could serve them, not held, or "
            "the engine lacked them when they went by reference)",
            ["reason"],
            registry=r,
        )
        self.items_moved = Counter(
            "mmferry_proxy_items_moved",
            "items the engine could not find where they went by reference (their encoder died "
            "or dropped them), encoded again by their next encoder and sent by reference again",
            registry=r,
        )
        self.named_ahead = Counter(
            "mmferry_proxy_named_ahead",
            "items named by the proxy and sent to the engine beside their encode (--name-ahead): "
            "held (the encoder held them under those names) or redone (it did not: the request "
            "went again the usual way)",
            ["outcome"],
            registry=r,
        )
        self.named_ahead.labels("held")
        self.named_ahead.labels("redone")
        self.ttft_seconds = Histogram(
            "mmferry_proxy_ttft_seconds",
            "the request read (its body in) to the engine's first chunk, as the proxy sees it",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        for url in encoders:  # every encoder shows up from the first scrape
            self.encoder_up.labels(url).set(1)
            self.items_routed.labels(url)
            self.encoder_seconds.labels(url)
