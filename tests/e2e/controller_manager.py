"""kube-controller-manager for e2e tests whose pods have owners, and the little of a kubelet those
controllers need on the suite's API-only nodes.

- :func:`start_controllers`: kube-controller-manager (1.36; 1.20 has none here) through
  ``ControlPlane.start_controller_manager`` with Deployments, ReplicaSets, the garbage collector
  and the disruption controller. Without the last, a PodDisruptionBudget never gets a status and
  the API server refuses every eviction of a pod it covers. Still nothing that acts on nodes.
- :class:`PodLifecycle`: a thread standing in for the kubelets the fake nodes do not have. It
  marks pods bound to those nodes Running and Ready (the disruption controller counts only Ready
  pods as healthy, and the Eviction API checks budgets only for running pods), and finishes
  graceful deletions: a kubelet deletes a terminating pod with grace 0 once its containers
  stopped; with none, an evicted pod would stay Terminating, holding its GPU, forever. Before
  that it records the pod's conditions (an eviction through the API adds DisruptionTarget,
  reason EvictionByEvictionAPI; a plain DELETE adds none).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import kubernetes.client
from controlplane import DEFAULT_CONTROLLERS, ControlPlane

__all__ = ["CONTROLLERS", "PodLifecycle", "Terminated", "start_controllers"]

CONTROLLERS = (*DEFAULT_CONTROLLERS, "disruption-controller", "statefulset-controller")


def start_controllers(cp: ControlPlane) -> None:
    """kube-controller-manager with `CONTROLLERS`; the ``cluster`` fixture stops it."""
    cp.start_controller_manager(CONTROLLERS)


@dataclass(frozen=True)
class Terminated:
    """A pod the lifecycle saw terminating, as it was then."""

    name: str
    uid: str
    node: str
    #: (type, reason) of each condition
    conditions: tuple[tuple[str, str], ...]


@dataclass
class PodLifecycle:
    """Run with ``with PodLifecycle(cp, nodes, namespace):``; see the module docstring.

    ``delay``: seconds a pod stays Terminating before it is deleted (long enough for a test,
    and for vramsched, to see the graceful phase: its GPU stays held until the pod is gone)."""

    cp: ControlPlane
    nodes: Iterable[str]
    namespace: str = "default"
    delay: float = 1.0
    interval: float = 0.25
    terminated: dict[str, Terminated] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def __enter__(self) -> PodLifecycle:
        self._nodes = frozenset(self.nodes)
        self._terminating: dict[str, float] = {}
        self._thread = threading.Thread(target=self._run, name="pod-lifecycle", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def _run(self) -> None:
        with self.cp.api_client() as client:
            core = kubernetes.client.CoreV1Api(client)
            while not self._stop.is_set():
                try:
                    for pod in core.list_namespaced_pod(self.namespace).items:
                        self._tend(core, pod)
                except kubernetes.client.ApiException as exc:
                    if exc.status != 404:
                        self.errors.append(f"{exc.status} {exc.reason}")
                except Exception as exc:  # the API server restarting, a dropped connection
                    self.errors.append(repr(exc))
                self._stop.wait(self.interval)

    def _tend(self, core: kubernetes.client.CoreV1Api, pod: Any) -> None:
        name, node = pod.metadata.name, pod.spec.node_name
        if node not in self._nodes:
            return
        if pod.metadata.deletion_timestamp is not None:
            first = self._terminating.setdefault(pod.metadata.uid, time.monotonic())
            if pod.metadata.uid not in {t.uid for t in self.terminated.values()}:
                self.terminated[name] = Terminated(
                    name,
                    pod.metadata.uid,
                    node,
                    tuple((c.type, c.reason or "") for c in pod.status.conditions or ()),
                )
            if time.monotonic() - first >= self.delay:
                try:
                    # in the body: with a body the API server reads no query parameter
                    core.delete_namespaced_pod(
                        name,
                        self.namespace,
                        body={"gracePeriodSeconds": 0, "preconditions": {"uid": pod.metadata.uid}},
                    )
                except kubernetes.client.ApiException as exc:
                    if exc.status not in (404, 409):
                        raise
            return
        if pod.status.phase in ("Running", "Succeeded", "Failed"):
            return
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        ready = [
            {"type": t, "status": "True", "lastTransitionTime": now}
            for t in ("Initialized", "Ready", "ContainersReady", "PodScheduled")
        ]
        core.patch_namespaced_pod_status(
            name,
            self.namespace,
            {"status": {"phase": "Running", "startTime": now, "conditions": ready}},
        )
