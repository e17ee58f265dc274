"""kube-scheduler's verdict on probe pods, for the e2e tests that put vramsched's reading of a rule
beside a real kube-scheduler's: a probe is placed (bound to a node) or refused (PodScheduled False).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import kubernetes
from controlplane import ControlPlane

NS = "default"


def ensure_namespace(core: kubernetes.client.CoreV1Api, name: str) -> None:
    """Create namespace `name` unless an earlier test of the session did (with no
    kube-controller-manager a deleted namespace never goes)."""
    try:
        core.create_namespace({"metadata": {"name": name}})
    except kubernetes.client.ApiException as exc:
        if exc.status != 409:
            raise


def _verdict(pod: Any) -> bool | None:
    if pod.spec.node_name:
        return True
    if any(c.type == "PodScheduled" and c.status == "False" for c in pod.status.conditions or []):
        return False
    return None


def verdicts(core: kubernetes.client.CoreV1Api, names: Iterable[str]) -> dict[str, bool] | None:
    """Placed or refused, for every pod of `names` in NS; None while one has no verdict yet."""
    wanted = set(names)
    found = {}
    for p in core.list_namespaced_pod(NS).items:
        if p.metadata.name in wanted and (v := _verdict(p)) is not None:
            found[p.metadata.name] = v
    return found if len(found) == len(wanted) else None


def probe_alone(cluster: ControlPlane, pod: Mapping[str, Any]) -> tuple[bool, dict[str, Any]]:
    """Create `pod` in NS, wait for kube-scheduler's verdict, and delete it again, so that the next
    probe does not see it: (placed, the pod as the API server stored it, which is what vramsched
    reads; an older API server drops fields it does not know)."""
    core, api = cluster.core_v1(), cluster.api_client()
    name = pod["metadata"]["name"]
    core.create_namespaced_pod(NS, pod)
    placed = cluster.wait_for(
        lambda: (v := _verdict(core.read_namespaced_pod(name, NS))) is not None and (v,),
        timeout=60,
        message=f"a verdict on {name}",
    )[0]
    stored = api.sanitize_for_serialization(core.read_namespaced_pod(name, NS))
    core.delete_namespaced_pod(name, NS, grace_period_seconds=0)
    cluster.wait_for(
        lambda: all(p.metadata.name != name for p in core.list_namespaced_pod(NS).items),
        timeout=30,
        message=f"{name} gone",
    )
    return placed, stored
