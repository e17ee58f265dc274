"""Prometheus metrics. Per request: one histogram observation and one counter; the VRAM
gauges and the planner's counters are read at scrape time, so they cost nothing on the hot path.
Families too large for prometheus_client's formatter (the per-GPU gauges) are added as `streams`
of ready text, written after the registry's."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from extender.ledger import Ledger

__all__ = ["Metrics"]

# Fine buckets below 10 ms: that is where filter/prioritize live and where regressions show.
_BUCKETS = (
    0.0002,
    0.0005,
    0.001,
    0.002,
    0.003,
    0.005,
    0.0075,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
)


class _LedgerCollector(Collector):
    def __init__(self, ledger: Callable[[], Ledger]) -> None:
        self._ledger = ledger

    def collect(self) -> Iterable[GaugeMetricFamily]:
        allocated, capacity = self._ledger().totals()
        yield GaugeMetricFamily(
            "vramsched_vram_allocated_bytes",
            "VRAM reserved by pods across all GPUs",
            value=allocated,
        )
        yield GaugeMetricFamily(
            "vramsched_vram_free_bytes",
            "VRAM not reserved across all GPUs",
            value=capacity - allocated,
        )
        yield GaugeMetricFamily(
            "vramsched_vram_capacity_bytes", "VRAM of all GPUs vramsched manages", value=capacity
        )


class _PlannerCollector(Collector):
    """The background planner's counters, read at scrape time (nothing when it is off)."""

    _COUNTERS = (
        ("plans", "plans", "Background plans made"),
        ("hits", "bind_hits", "Binds handed a planned reservation"),
        (
            "refusedAtBind",
            "bind_refused",
            "Planned reservations bind did not take (no longer free, or the device plugin's bound)",
        ),
        (
            "stale",
            "stale_entries",
            "Plan entries dropped because their node changed and they no longer fit",
        ),
        ("errors", "errors", "Background plans that failed (the greedy path answered)"),
        ("aheadRounds", "ahead_rounds", "Rounds of planning ahead (serve --plan-ahead)"),
        ("aheadHits", "ahead_hits", "Binds that took a placement planned ahead"),
        (
            "aheadInline",
            "ahead_inline",
            "Placements the one-pod rule chose inline for pods no entry covered",
        ),
    )

    def __init__(self, state: Callable[[], dict[str, Any] | None]) -> None:
        self._state = state

    def collect(self) -> Iterable[GaugeMetricFamily | CounterMetricFamily]:
        s = self._state()
        if s is None:
            return
        for key, name, doc in self._COUNTERS:
            yield CounterMetricFamily(f"vramsched_planner_{name}", doc, value=s[key])
        yield GaugeMetricFamily(
            "vramsched_planner_entries", "Pending pods with a planned node", value=s["entries"]
        )
        yield GaugeMetricFamily(
            "vramsched_planner_last_plan_seconds",
            "Wall time of the last background plan",
            value=s["lastSeconds"],
        )


class Metrics:
    """A registry of its own per server, so tests can run many servers in one process."""

    def __init__(
        self,
        ledger: Callable[[], Ledger],
        planner: Callable[[], dict[str, Any] | None] = lambda: None,
    ) -> None:
        self.registry = CollectorRegistry()
        self.latency = Histogram(
            "vramsched_request_duration_seconds",
            "Extender request latency by verb",
            ["verb"],
            registry=self.registry,
            buckets=_BUCKETS,
        )
        self.requests = Counter(
            "vramsched_requests",
            "Extender requests by verb and HTTP code",
            ["verb", "code"],
            registry=self.registry,
        )
        self.errors = Counter(
            "vramsched_errors",
            "Requests answered with an error (4xx/5xx or an Error field)",
            ["verb"],
            registry=self.registry,
        )
        self.registry.register(_LedgerCollector(ledger))
        self.registry.register(_PlannerCollector(planner))
        self._children: dict[tuple[str, int], tuple[Any, Any, Any]] = {}
        #: more exposition text, in pieces (extender.observe.gpu_metrics): called once per scrape
        self.streams: list[Callable[[], Iterable[bytes]]] = []

    def request(self, verb: str, code: int, seconds: float) -> None:
        """Count one answered request. The labelled children are looked up once per (verb, code):
        `labels()` takes a lock and builds a key each time, a few microseconds per request."""
        children = self._children.get((verb, code))
        if children is None:
            children = self._children[(verb, code)] = (
                self.latency.labels(verb),
                self.requests.labels(verb, str(code)),
                self.errors.labels(verb) if code >= 400 else None,
            )
        latency, requests, errors = children
        latency.observe(seconds)
        requests.inc()
        if errors is not None:
            errors.inc()

    def pieces(self) -> Iterator[bytes]:
        """The scrape in pieces: the registry's families, then each stream's."""
        yield generate_latest(self.registry)
        for stream in self.streams:
            yield from stream()

    def render(self) -> bytes:
        return b"".join(self.pieces())
