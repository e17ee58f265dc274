"""Which replica leads: the one whose kube-scheduler holds the leader-election Lease.

vramsched runs as a sidecar of kube-scheduler; two replicas run and only the Lease holder's
kube-scheduler schedules (deploy/KubeSchedulerConfiguration.yaml: Lease vramsched/vramsched).
Both extenders keep the same ledger, but only the leader serves requests, so a dashboard keeps
the leader's series (`vramsched_leader == 1`). kube-scheduler names itself `<hostname>_<uuid>`
in the Lease, and both containers of the pod share its hostname: this replica leads when the
holder's identity starts with its own hostname. The Lease is read every few seconds in a thread
(RBAC: the pod's ServiceAccount already has `get` on that Lease for kube-scheduler).
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["LeaseLeader", "holds", "parse_lease_name"]

log = logging.getLogger(__name__)


def parse_lease_name(text: str) -> tuple[str, str]:
    """`NAMESPACE/NAME` -> (namespace, name); ValueError naming what is wrong."""
    namespace, sep, name = text.partition("/")
    if not sep or not namespace or not name or "/" in name:
        raise ValueError(
            f"--leader-lease {text!r}: expected NAMESPACE/NAME (e.g. vramsched/vramsched)"
        )
    return namespace, name


def holds(lease: Mapping[str, Any] | None, identity: str) -> bool:
    """Whether `identity` (a hostname) leads by this Lease object; no Lease: no election, leads."""
    if lease is None:
        return True
    holder = str(((lease.get("spec") or {}).get("holderIdentity")) or "")
    return holder == identity or holder.rpartition("_")[0] == identity


class LeaseLeader:
    """`value()` is True / False from the last Lease read (None before the first answered)."""

    def __init__(
        self,
        read_lease: Callable[[], Mapping[str, Any] | None],
        *,
        identity: str | None = None,
        interval: float = 5.0,
    ) -> None:
        self._read = read_lease
        self.identity = identity or socket.gethostname()
        self.interval = interval
        self._value: bool | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.errors = 0

    def value(self) -> bool | None:
        return self._value

    def poll(self) -> None:
        """One read; an error keeps the last answer (logged once per outage)."""
        try:
            self._value = holds(self._read(), self.identity)
        except Exception as exc:  # a probe must never stop the server
            self.errors += 1
            if self.errors == 1 or self.errors % 100 == 0:
                log.warning("cannot read the leader Lease: %s", str(exc)[:200])
            return
        self.errors = 0

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="leader-lease", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.poll()
            self._stop.wait(self.interval)


def kube_lease_reader(
    client: Any, namespace: str, name: str
) -> Callable[[], Mapping[str, Any] | None]:
    """A reader of one Lease through a `kubernetes.client.ApiClient`: its JSON, None on 404."""
    import kubernetes.client
    import orjson

    api = kubernetes.client.CoordinationV1Api(client)

    def read() -> Mapping[str, Any] | None:
        try:
            resp = api.read_namespaced_lease(
                name, namespace, _preload_content=False, _request_timeout=5
            )
        except kubernetes.client.ApiException as exc:
            if exc.status == 404:
                return None
            raise
        return orjson.loads(resp.data)  # type: ignore[attr-defined]  # raw HTTP response

    return read
