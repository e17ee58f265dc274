"""Prometheus metrics. Per request: one histogram observation and one counter; the VRAM
gauges are computed at scrape time from the ledger, so they cost nothing on the hot path."""

from __future__ import annotations

from typing import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from extender.ledger import Ledger

__all__ = ["Metrics"]

# Fine buckets below 10 ms: that is where filter/prioritize live and where regressions show.
_BUCKETS = (0.0002, 0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class _LedgerCollector(Collector):
    def __init__(self, ledger: Callable[[], Ledger]) -> None:
        self._ledger = ledger

    def collect(self) -> Iterable[GaugeMetricFamily]:
        allocated, capacity = self._ledger().totals()
        yield GaugeMetricFamily("vramsched_vram_allocated_bytes", "VRAM reserved by pods across all GPUs", value=allocated)
        yield GaugeMetricFamily("vramsched_vram_free_bytes", "VRAM not reserved across all GPUs", value=capacity - allocated)
        yield GaugeMetricFamily("vramsched_vram_capacity_bytes", "VRAM of all GPUs vramsched manages", value=capacity)


class Metrics:
    """A registry of its own per server, so tests can run many servers in one process."""

    def __init__(self, ledger: Callable[[], Ledger]) -> None:
        self.registry = CollectorRegistry()
        self.latency = Histogram(
            "vramsched_request_duration_seconds", "Extender request latency by verb", ["verb"],
            registry=self.registry, buckets=_BUCKETS,
        )
        self.requests = Counter("vramsched_requests", "Extender requests by verb and HTTP code", ["verb", "code"], registry=self.registry)
        self.errors = Counter("vramsched_errors", "Requests answered with an error (4xx/5xx or an Error field)", ["verb"], registry=self.registry)
        self.registry.register(_LedgerCollector(ledger))

    def render(self) -> bytes:
        return generate_latest(self.registry)
