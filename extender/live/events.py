"""`VramschedAssigned` Events, posted off the bind path from a bounded queue."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from extender.live.api_client import KubeApi

__all__ = ["EventRecorder", "EventCollector"]

log = logging.getLogger(__name__)


class EventRecorder:
    """Posts Events from a bounded queue, one at a time, off the bind path.

    `emit` never blocks and never raises: it queues the event (the first call starts the sender
    task on the running loop) or, when the queue is full because the API server is slow or
    away, drops it. Each post runs in a thread of its own with the client's write timeout, so a
    stuck events call never takes a bind worker. `sent`, `failed` and `dropped` count outcomes
    (exported as `vramsched_bind_events_total{outcome}` and in /readyz).
    """

    def __init__(self, api: KubeApi, *, capacity: int = 256) -> None:
        self.api = api
        self.capacity = capacity
        self.sent = 0
        self.failed = 0
        self.dropped = 0
        self._queue: asyncio.Queue[tuple[str, dict[str, Any]]] | None = None
        self._task: asyncio.Task[None] | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._closed = False

    @property
    def queued(self) -> int:
        return self._queue.qsize() if self._queue is not None else 0

    def emit(self, namespace: str, body: dict[str, Any]) -> None:
        """Queue one event; call from the event loop."""
        if self._closed:
            self.dropped += 1
            return
        if self._queue is None:
            self._queue = asyncio.Queue(self.capacity)
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="events")
            self._task = asyncio.get_running_loop().create_task(
                self._run(), name="vramsched-events"
            )
        try:
            self._queue.put_nowait((namespace, body))
        except asyncio.QueueFull:
            self.dropped += 1
            if self.dropped == 1 or self.dropped % 100 == 0:
                log.warning(
                    "event queue full, event dropped",
                    extra={"fields": {"dropped": self.dropped, "capacity": self.capacity}},
                )

    async def _run(self) -> None:
        assert self._queue is not None
        loop = asyncio.get_running_loop()
        while True:
            namespace, body = await self._queue.get()
            try:
                await loop.run_in_executor(self._pool, self.api.create_event, namespace, body)
                self.sent += 1
            except Exception as exc:  # an event is never worth more than a log line
                self.failed += 1
                log.warning(
                    "cannot create event",
                    extra={
                        "fields": {
                            "pod": f"{namespace}/{(body.get('involvedObject') or {}).get('name')}",
                            "error": str(exc)[:300],
                        }
                    },
                )
            finally:
                self._queue.task_done()

    async def drain(self) -> None:
        """Wait until every queued event was posted or failed (tests, orderly shutdown)."""
        if self._queue is not None:
            await self._queue.join()

    def close(self) -> None:
        self._closed = True
        if self._task is not None:
            self._task.cancel()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    def stats(self) -> dict[str, int]:
        return {
            "sent": self.sent,
            "failed": self.failed,
            "dropped": self.dropped,
            "queued": self.queued,
        }


class EventCollector(Collector):
    """The recorder's counters for /metrics, read at scrape time."""

    def __init__(self, recorder: EventRecorder) -> None:
        self._recorder = recorder

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        r = self._recorder
        counter = CounterMetricFamily(
            "vramsched_bind_events", "VramschedAssigned events by outcome", labels=["outcome"]
        )
        for outcome, value in (("sent", r.sent), ("failed", r.failed), ("dropped", r.dropped)):
            counter.add_metric([outcome], value)
        yield counter
        yield GaugeMetricFamily(
            "vramsched_bind_events_queued", "Events waiting to be posted", value=r.queued
        )
