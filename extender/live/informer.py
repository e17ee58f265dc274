"""One informer per resource: list, then watch, resume, relist on 410 Gone, back off on errors.

The blocking client calls run in one daemon thread per informer; what it sees is handed to
`deliver`, which must pass it to the event loop (`extender.live.source.LiveSource` does, with
`call_soon_threadsafe`), so the cluster and its ledger keep a single owner and need no lock.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable
from typing import Any

from extender.live.api_client import ApiError, KubeApi

__all__ = ["WATCH_TIMEOUT_RANGE", "InformerStats", "Deliver", "Informer", "slim"]

log = logging.getLogger(__name__)

# Server-side watch timeouts are randomised like client-go's (5-10 min there), so that the
# informers of many replicas do not all reconnect at the same moment.
WATCH_TIMEOUT_RANGE = (240, 300)


class InformerStats:
    """What /readyz reports per resource."""

    synced: bool = False
    resource_version: str = ""
    lists: int = 0
    relists_gone: int = 0
    watch_resumes: int = 0
    errors: int = 0
    last_error: str = ""
    events: int = 0
    #: a list or watch is answering now; False from the first error until one answers again
    connected: bool = False
    down_since: float | None = None  # time.monotonic() of the first error of the current outage

    def as_dict(self) -> dict[str, Any]:
        return {
            "synced": self.synced,
            "resourceVersion": self.resource_version,
            "lists": self.lists,
            "relistsGone": self.relists_gone,
            "watchResumes": self.watch_resumes,
            "errors": self.errors,
            "lastError": self.last_error,
            "events": self.events,
            "connected": self.connected,
            "downForS": round(time.monotonic() - self.down_since, 1)
            if self.down_since is not None
            else 0.0,
        }

    def up(self) -> None:
        self.connected, self.down_since = True, None

    def down(self) -> None:
        self.connected = False
        if self.down_since is None:
            self.down_since = time.monotonic()


Deliver = Callable[[str, Any], None]


class Informer:
    """List + watch of one resource in a thread; hands `("replace", items)` and
    `(event_type, object)` to `deliver`, which must hand them to the event loop.

    The loop: list (paged) -> deliver replace -> watch from its resourceVersion; when a watch
    ends (server timeout) or breaks (connection), watch again from the last version seen;
    on 410 Gone (version compacted) list again; on any other error back off exponentially
    (with jitter, capped) and retry the same step.
    """

    def __init__(
        self,
        kind: str,
        api: KubeApi,
        deliver: Deliver,
        *,
        backoff_initial: float = 0.5,
        backoff_max: float = 30.0,
        watch_timeout: tuple[int, int] = WATCH_TIMEOUT_RANGE,
        may_start: threading.Event | None = None,
    ) -> None:
        self.kind = kind
        self.api = api
        self.deliver = deliver
        self.backoff_initial = backoff_initial
        self.backoff_max = backoff_max
        self.watch_timeout = watch_timeout
        self.may_start = may_start
        self.stats = InformerStats()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._delay = 0.0
        self._fresh = False

    def start(self) -> None:
        self._thread = threading.Thread(target=self.run, name=f"informer-{self.kind}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def join(self, timeout: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def stopped(self) -> bool:
        return self._stop.is_set()

    def run(self) -> None:
        if self.may_start is not None:
            while not self.may_start.wait(0.2):
                if self._stop.is_set():
                    return
        self.stats.resource_version = ""
        while not self._stop.is_set():
            # The version to resume from is the last one delivered, even when a watch broke mid-way.
            rv = self.stats.resource_version
            try:
                if not rv:
                    rv = self._list()
                self._watch(rv)
            except ApiError as exc:
                if exc.status == 410:
                    self.stats.relists_gone += 1
                    log.info(
                        "watch expired, relisting",
                        extra={"fields": {"kind": self.kind, "resourceVersion": rv}},
                    )
                    self.stats.resource_version = ""
                    continue
                self._failed(exc)
            except Exception as exc:  # an informer thread must never die
                self._failed(exc)

    def _failed(self, exc: BaseException) -> None:
        if self._stop.is_set():
            return  # shutting down: the aborted watch is not an error
        self.stats.errors += 1
        self.stats.last_error = str(exc)[:300]
        self.stats.down()
        self._delay = min(self.backoff_max, max(self.backoff_initial, self._delay * 2))
        delay = self._delay * random.uniform(0.8, 1.2)
        log.warning(
            "informer error, retrying",
            extra={
                "fields": {
                    "kind": self.kind,
                    "error": self.stats.last_error,
                    "retryInS": round(delay, 2),
                }
            },
        )
        self._stop.wait(delay)

    def _list(self) -> str:
        items, rv = self.api.list(self.kind)
        self.stats.up()
        for item in items:
            slim(item)
        self.stats.lists += 1
        self.deliver("replace", items)
        self.stats.resource_version = rv
        self.stats.synced = True
        self._delay = 0.0
        self._fresh = True
        return rv

    def _watch(self, rv: str) -> str:
        if not self._fresh:
            self.stats.watch_resumes += 1  # from the last version seen, not from a new list
        self._fresh = False
        timeout = random.randint(*self.watch_timeout)
        events = self.api.watch(self.kind, rv, timeout)
        self.stats.up()
        self._delay = 0.0  # the API answers again: the next outage starts its backoff afresh
        for event in events:
            if self._stop.is_set():
                break
            kind = event.get("type")
            obj = event.get("object") or {}
            if kind == "ERROR":
                code = int(obj.get("code") or 0)
                raise ApiError(
                    code or 500, str(obj.get("reason") or ""), str(obj.get("message") or "")
                )
            new_rv = str((obj.get("metadata") or {}).get("resourceVersion") or "")
            if kind != "BOOKMARK":
                self.stats.events += 1
                self.deliver(str(kind), slim(obj))
            if new_rv:
                rv = new_rv
                self.stats.resource_version = rv
            self._delay = 0.0
        return rv


def slim(obj: dict[str, Any]) -> dict[str, Any]:
    """Drop managedFields: often the largest part of an object, and nothing vramsched reads."""
    meta = obj.get("metadata")
    if isinstance(meta, dict):
        meta.pop("managedFields", None)
    return obj
