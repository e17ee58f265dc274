"""Inputs of the simulator: the Alibaba GPU-sharing trace (cluster-trace-gpu-v2023) or our YAML.

Trace convention (see shared/traces/README.md): every GPU has 1000 MiB, a single-GPU task needs
`gpu_milli` MiB, a task with `num_gpu = N > 1` needs N whole GPUs on one node, `gpu_spec` lists
the allowed models. Nodes become Node objects labelled as GPU Feature Discovery would, so they go
through the same `node_inventory` as a live cluster.
"""

from __future__ import annotations

import csv
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from extender.demand import Demand, DemandError, PodRef, pod_demand
from extender.inventory import GPU_RESOURCE
from extender.quantity import MIB
from extender.source_file import read_cluster_file

__all__ = [
    "Task",
    "TRACE_GPU_MIB",
    "DEFAULT_REPLICAS",
    "read_trace_nodes",
    "read_trace_pods",
    "read_yaml",
    "read_inputs",
    "inflate",
]

TRACE_GPU_MIB = 1000
#: time-slicing replicas per trace GPU: 1000 MiB / 50 MiB (the smallest task) so that memory,
#: not the replica count, is what limits VRAM-aware policies; `spread` sees only replicas.
DEFAULT_REPLICAS = 20


@dataclass(frozen=True, slots=True)
class Task:
    """A pod to replay: its demand, when it arrives and (with churn) when it leaves."""

    demand: Demand
    arrival: float = 0.0
    departure: float | None = None

    @property
    def key(self) -> str:
        return self.demand.pod.key


def _is_trace(path: str | Path) -> bool:
    return str(path).endswith(".csv")


def read_trace_nodes(path: str | Path, *, replicas: int = DEFAULT_REPLICAS) -> list[dict[str, Any]]:
    nodes = []
    with open(path, newline="") as fh:
        for row in csv.DictReader(fh):
            gpus = int(row["gpu"])
            labels = {
                "kubernetes.io/hostname": row["sn"],
                "nvidia.com/gpu.present": "true",
                "nvidia.com/gpu.product": row["model"],
                "nvidia.com/gpu.count": str(gpus),
                "nvidia.com/gpu.memory": str(TRACE_GPU_MIB),
                "nvidia.com/gpu.replicas": str(replicas),
                "nvidia.com/gpu.sharing-strategy": "time-slicing" if replicas > 1 else "none",
            }
            alloc = {
                "cpu": f"{int(row['cpu_milli'])}m",
                "memory": f"{int(row['memory_mib'])}Mi",
                GPU_RESOURCE: str(gpus * replicas),
            }
            nodes.append(
                {
                    "kind": "Node",
                    "metadata": {"name": row["sn"], "labels": labels},
                    "status": {"allocatable": alloc, "capacity": dict(alloc)},
                }
            )
    return nodes


def read_trace_pods(path: str | Path, *, skip_cpu_only: bool = False) -> list[Task]:
    tasks = []
    with open(path, newline="") as fh:
        for row in csv.DictReader(fh):
            n = int(row["num_gpu"])
            if n == 0 and skip_cpu_only:
                continue
            milli = int(row["gpu_milli"] or 0)
            spec = row.get("gpu_spec") or ""
            per_gpu = milli * MIB if n == 1 else None
            demand = Demand(
                pod=PodRef("trace", row["name"]),
                gpu_count=n,
                bytes_per_gpu=per_gpu,
                resource=GPU_RESOURCE,
                priority=0,
                cpu_milli=int(row["cpu_milli"]),
                memory_bytes=int(row["memory_mib"]) * MIB,
                allowed_products=frozenset(s for s in spec.split("|") if s) or None,
                model_memory=per_gpu,
            )
            dep = row.get("deletion_time") or ""
            tasks.append(
                Task(demand, float(row["creation_time"] or 0), float(dep) if dep else None)
            )
    tasks.sort(key=lambda t: (t.arrival, t.demand.pod.name))
    return tasks


def read_yaml(
    path: str | Path,
) -> tuple[list[Mapping[str, Any]], list[Task], list[Mapping[str, Any]]]:
    """Nodes, pods to replay (unbound pods, or all pods if none is bound... see below) and bound pods.

    A pod with `spec.nodeName` is already running and is accounted first; the others are replayed.
    Arrival is `metadata.creationTimestamp` order when present (else list order, all together);
    `metadata.annotations["vramsched.io/sim-departure"]` (seconds) is used with --churn.
    """
    objs = read_cluster_file(path)
    nodes = [o for o in objs if o.get("kind") == "Node"]
    bound, tasks = [], []
    for _i, o in enumerate(o for o in objs if o.get("kind") == "Pod"):
        if (o.get("spec") or {}).get("nodeName"):
            bound.append(o)
            continue
        try:
            d = pod_demand(o)
        except DemandError:
            continue
        meta = o.get("metadata") or {}
        ann = meta.get("annotations") or {}
        arrival = _timestamp(meta.get("creationTimestamp"))
        dep = ann.get("vramsched.io/sim-departure")
        tasks.append(Task(d, arrival, float(dep) if dep is not None else None))
    tasks.sort(key=lambda t: t.arrival)
    return nodes, tasks, bound


def _timestamp(value: Any) -> float:
    if not value:
        return 0.0
    from datetime import datetime

    try:
        return datetime.fromisoformat(str(value).replace("Z", "+00:00")).timestamp()
    except ValueError:
        return 0.0


def read_inputs(
    nodes_path: str | Path,
    pods_path: str | Path,
    *,
    replicas: int = DEFAULT_REPLICAS,
    skip_cpu_only: bool = False,
) -> tuple[list[Mapping[str, Any]], list[Task], list[Mapping[str, Any]]]:
    """(node objects, tasks in arrival order, already bound pod objects) from either format."""
    bound: list[Mapping[str, Any]] = []
    nodes: list[Mapping[str, Any]]
    if _is_trace(nodes_path):
        nodes = list(read_trace_nodes(nodes_path, replicas=replicas))
    else:
        nodes, _, bound = read_yaml(nodes_path)
    if _is_trace(pods_path):
        tasks = read_trace_pods(pods_path, skip_cpu_only=skip_cpu_only)
    else:
        _, tasks, more = read_yaml(pods_path)
        if Path(pods_path) != Path(nodes_path):
            bound += more
    return nodes, tasks, bound


def inflate(
    tasks: list[Task], gpu_capacity: float, factor: float, gpu_bytes: int = TRACE_GPU_MIB * MIB
) -> list[Task]:
    """FGD's protocol: keep drawing tasks in order (repeating the list under new names) until the
    arrived GPU demand reaches `factor` x the cluster's GPU capacity (both in GPUs)."""
    if factor <= 0 or not tasks:
        return list(tasks)
    span = max(t.arrival for t in tasks) + 1.0
    out: list[Task] = []
    demand = 0.0
    target = factor * gpu_capacity
    rnd = 0
    while demand < target:
        for t in tasks:
            if demand >= target:
                break
            d = t.demand
            if rnd:
                d = replace(d, pod=PodRef(d.pod.namespace, f"{d.pod.name}-r{rnd}"))
                t = Task(
                    d,
                    t.arrival + rnd * span,
                    None if t.departure is None else t.departure + rnd * span,
                )
            out.append(t)
            demand += gpu_units(d, gpu_bytes)
        rnd += 1
        if rnd > 1000:
            break
    return out


def gpu_units(d: Demand, gpu_bytes: int = TRACE_GPU_MIB * MIB) -> float:
    """GPUs a demand takes: whole devices count 1 each, shares count their fraction of `gpu_bytes`."""
    if d.gpu_count == 0:
        return 0.0
    if d.bytes_per_gpu is None:
        return float(d.gpu_count)
    return d.gpu_count * min(1.0, d.bytes_per_gpu / gpu_bytes)
