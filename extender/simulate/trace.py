"""Inputs of the simulator: the Alibaba GPU-sharing trace (cluster-trace-gpu-v2023) or our YAML.

Trace convention (see shared/traces/README.md): every GPU has 1000 MiB, a single-GPU task needs
`gpu_milli` MiB, a task with `num_gpu = N > 1` needs N whole GPUs on one node, `gpu_spec` lists
the allowed models. Nodes become Node objects labelled as GPU Feature Discovery would, so they go
through the same `node_inventory` as a live cluster.
"""

from __future__ import annotations

import csv
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from extender.demand import Demand, DemandError, PodRef, pod_demand, well_formed_pod
from extender.inventory import GPU_RESOURCE, MAX_DEVICES_PER_NODE
from extender.quantity import HOST_MAX, MIB
from extender.source_file import given_twice, read_cluster_file

__all__ = [
    "Task",
    "TRACE_GPU_MIB",
    "DEFAULT_REPLICAS",
    "read_trace_nodes",
    "read_trace_pods",
    "TraceError",
    "TRACE_POD_REQUIRED",
    "TRACE_POD_DEFAULTS",
    "read_yaml",
    "read_inputs",
    "inflate",
    "QOS_PRIORITIES",
    "with_qos_priorities",
]

TRACE_GPU_MIB = 1000
#: time-slicing replicas per trace GPU: 1000 MiB / 50 MiB (the smallest task) so that memory,
#: not the replica count, is what limits VRAM-aware policies; `spread` sees only replicas.
DEFAULT_REPLICAS = 20
#: a replayed pod's annotation: seconds at which --churn deletes it
DEPARTURE = "vramsched.io/sim-departure"


@dataclass(frozen=True, slots=True)
class Task:
    """A pod to replay: its demand, when it arrives and (with churn) when it leaves."""

    demand: Demand
    arrival: float = 0.0
    departure: float | None = None
    #: the trace's `qos` column (LS, BE, Burstable, Guaranteed; empty: none), which
    #: `with_qos_priorities` turns into a pod priority
    qos: str = ""

    @property
    def key(self) -> str:
        return self.demand.pod.key


def _is_trace(path: str | Path) -> bool:
    return str(path).endswith(".csv")


def read_trace_nodes(path: str | Path, *, replicas: int = DEFAULT_REPLICAS) -> list[dict[str, Any]]:
    nodes = []
    with open(path, newline="") as fh:
        reader = csv.DictReader(fh)
        missing = [c for c in TRACE_NODE_COLUMNS if c not in (reader.fieldnames or ())]
        if missing:
            raise TraceError(
                f"{path}: not a node list: no column {', '.join(missing)} "
                f"(columns: {', '.join(reader.fieldnames or ()) or 'none'})"
            )
        seen: dict[str, int] = {}
        for line, row in enumerate(reader, start=2):
            try:
                name, gpus, cpu, mem = _trace_node(row, seen)
            except ValueError as exc:
                raise TraceError(f"{path}, line {line}: {exc}") from None
            seen[name] = line
            labels = {
                "kubernetes.io/hostname": name,
                "nvidia.com/gpu.present": "true",
                "nvidia.com/gpu.product": (row["model"] or "").strip(),
                "nvidia.com/gpu.count": str(gpus),
                "nvidia.com/gpu.memory": str(TRACE_GPU_MIB),
                "nvidia.com/gpu.replicas": str(replicas),
                "nvidia.com/gpu.sharing-strategy": "time-slicing" if replicas > 1 else "none",
            }
            alloc = {
                "cpu": f"{cpu}m",
                "memory": f"{mem}Mi",
                GPU_RESOURCE: str(gpus * replicas),
            }
            nodes.append(
                {
                    "kind": "Node",
                    "metadata": {"name": name, "labels": labels},
                    "status": {"allocatable": alloc, "capacity": dict(alloc)},
                }
            )
    return nodes


def _trace_node(
    row: Mapping[str, str | None], seen: Mapping[str, int]
) -> tuple[str, int, int, int]:
    """A node row's name, GPUs, CPU (millicores) and memory (MiB); ValueError naming the column.
    A node named twice would be read as one (the second row's), so it is refused."""
    name = (row.get("sn") or "").strip()
    if not name:
        raise ValueError("sn is empty")
    if name in seen:
        raise ValueError(f"sn {name!r} is also on line {seen[name]}")
    gpus = _int(row, "gpu", 0)
    if gpus > MAX_DEVICES_PER_NODE:
        raise ValueError(f"gpu {gpus} is more GPUs than a node may have ({MAX_DEVICES_PER_NODE})")
    if gpus and not (row.get("model") or "").strip():
        raise ValueError(f"model is empty on a node with {gpus} GPUs")
    return name, gpus, _host(row, "cpu_milli", 1), _host(row, "memory_mib", MIB)


#: columns a node list must have (the dataset's node lists have exactly these).
TRACE_NODE_COLUMNS = ("sn", "cpu_milli", "memory_mib", "gpu", "model")
#: columns a pod list must have; every other column is optional (`TRACE_POD_DEFAULTS`).
TRACE_POD_REQUIRED = ("name", "num_gpu")
#: what a missing (or empty) optional column means. The dataset's lists differ: the `multigpu`
#: lists carry only `name, cpu_milli, memory_mib, num_gpu, gpu_milli`.
TRACE_POD_DEFAULTS: dict[str, str] = {
    "cpu_milli": "0: the task asks no CPU",
    "memory_mib": "0: the task asks no host memory",
    "gpu_milli": "1000 (a whole GPU) for a single-GPU task; unused for 0 or several GPUs",
    "gpu_spec": "empty: no GPU type constraint",
    "creation_time": "file order: the n-th task arrives alone, at time n",
    "deletion_time": "empty: the task never leaves, even with churn",
    "qos": "empty: no class (priority 0 with --priorities qos)",
}

#: the pod priority `--priorities qos` gives each of the trace's `qos` classes: latency-sensitive
#: services (LS) and Guaranteed pods above Burstable ones, best-effort (BE) batch work lowest, as
#: a cluster's PriorityClasses would rank online inference above batch jobs
QOS_PRIORITIES: dict[str, int] = {"LS": 1000, "Guaranteed": 1000, "Burstable": 500, "BE": 0, "": 0}


class TraceError(ValueError):
    """A pod or node list that cannot be replayed; the message names the file, row and column."""


def read_trace_pods(path: str | Path, *, skip_cpu_only: bool = False) -> list[Task]:
    """A pod list of the dataset in arrival order (`creation_time`, ties by name; file order for a
    list without times). Missing optional columns take `TRACE_POD_DEFAULTS`."""
    tasks = []
    with open(path, newline="") as fh:
        reader = csv.DictReader(fh)
        columns = set(reader.fieldnames or ())
        missing = [c for c in TRACE_POD_REQUIRED if c not in columns]
        if missing:
            raise TraceError(
                f"{path}: not a pod list: no column {', '.join(missing)} "
                f"(columns: {', '.join(reader.fieldnames or ()) or 'none'})"
            )
        timed = "creation_time" in columns
        seen: dict[str, int] = {}
        for line, row in enumerate(reader, start=2):
            try:
                task = _trace_task(row, line - 2, timed)
                if task.demand.pod.name in seen:  # one pod key: the ledger would hold one
                    raise ValueError(
                        f"name {task.demand.pod.name!r} is also on line {seen[task.demand.pod.name]}"
                    )
            except ValueError as exc:
                raise TraceError(f"{path}, line {line}: {exc}") from None
            seen[task.demand.pod.name] = line
            if task.demand.gpu_count == 0 and skip_cpu_only:
                continue
            tasks.append(task)
    tasks.sort(key=lambda t: (t.arrival, t.demand.pod.name) if timed else t.arrival)
    return tasks


#: a whole number as the dataset writes it: ASCII digits (`int()` also takes `1_0` and every
#: script's digits), at most 18 of them so that it fits the arrays' int64
_WHOLE = re.compile(r"-?[0-9]{1,18}", re.ASCII)


def _int(row: Mapping[str, str | None], column: str, default: int) -> int:
    value = (row.get(column) or "").strip()
    if not value:
        return default
    if not _WHOLE.fullmatch(value):
        raise ValueError(f"{column} {value[:40]!r} is not a whole number")
    n = int(value)
    if n < 0:
        raise ValueError(f"{column} {value!r} is negative")
    return n


def _host(row: Mapping[str, str | None], column: str, unit: int) -> int:
    """A CPU or memory column, at most what the arrays hold (as a pod's request is read)."""
    n = _int(row, column, 0)
    if n * unit > HOST_MAX:
        raise ValueError(f"{column} {n} is more than any node has")
    return n


def _time(row: Mapping[str, str | None], column: str) -> float | None:
    value = (row.get(column) or "").strip()
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        raise ValueError(f"{column} {value!r} is not a number of seconds") from None
    if not math.isfinite(seconds):
        raise ValueError(f"{column} {value!r} is not a finite number of seconds")
    return seconds


def _trace_task(row: Mapping[str, str | None], index: int, timed: bool) -> Task:
    name = (row.get("name") or "").strip()
    if not name:
        raise ValueError("name is empty")
    n = _int(row, "num_gpu", 0)
    if n > 64:
        raise ValueError(f"num_gpu {n} is more GPUs than any node has")
    milli = _int(row, "gpu_milli", TRACE_GPU_MIB if n == 1 else 0)
    if n == 1 and not 0 < milli <= TRACE_GPU_MIB:
        raise ValueError(f"gpu_milli {milli} is not a share of one GPU (1..{TRACE_GPU_MIB})")
    spec = row.get("gpu_spec") or ""
    per_gpu = milli * MIB if n == 1 else None
    demand = Demand(
        pod=PodRef("trace", name),
        gpu_count=n,
        bytes_per_gpu=per_gpu,
        resource=GPU_RESOURCE,
        priority=0,
        cpu_milli=_host(row, "cpu_milli", 1),
        memory_bytes=_host(row, "memory_mib", MIB) * MIB,
        allowed_products=frozenset(s.strip() for s in spec.split("|") if s.strip()) or None,
        model_memory=per_gpu,
    )
    created = _time(row, "creation_time") if timed else None
    # A list without times arrives in file order, one task at a time; a blank time in a timed
    # list counts as the trace's start, as before.
    arrival = float(index) if not timed else (created or 0.0)
    deleted = _time(row, "deletion_time")
    if timed and deleted is not None and deleted < arrival:
        raise ValueError(f"deletion_time {deleted:g} is before creation_time {arrival:g}")
    qos = (row.get("qos") or "").strip()
    if qos not in QOS_PRIORITIES:
        known = ", ".join(q for q in QOS_PRIORITIES if q)
        raise ValueError(f"qos {qos[:40]!r} is not one of {known} (or empty)")
    return Task(demand, arrival, deleted, qos)


def with_qos_priorities(tasks: Sequence[Task]) -> list[Task]:
    """`tasks` with each trace pod's priority taken from its `qos` class (`QOS_PRIORITIES`).
    Without it every trace pod has priority 0, so nobody may preempt anybody; pods without a
    class (a YAML pod's priority is its own, `spec.priority`) are left as they are."""
    return [
        replace(t, demand=replace(t.demand, priority=QOS_PRIORITIES[t.qos])) if t.qos else t
        for t in tasks
    ]


def read_yaml(
    path: str | Path,
) -> tuple[list[Mapping[str, Any]], list[Task], list[Mapping[str, Any]]]:
    """Nodes, pods to replay (unbound pods, or all pods if none is bound... see below) and bound pods.

    A pod with `spec.nodeName` is already running and is accounted first; the others are replayed.
    Arrival is `metadata.creationTimestamp` order when present (else list order, all together);
    `metadata.annotations[DEPARTURE]` (seconds) is used with --churn.
    """
    objs = read_cluster_file(path)
    nodes = [o for o in objs if o.get("kind") == "Node"]
    bound, tasks = [], []
    for o in (o for o in objs if o.get("kind") == "Pod"):
        if not well_formed_pod(o):
            continue
        if (o.get("spec") or {}).get("nodeName"):
            bound.append(o)
            continue
        try:
            d = pod_demand(o)
        except DemandError as exc:  # left out, the replay would hold fewer pods than the file
            raise TraceError(f"{path}: {exc}") from None
        meta = o.get("metadata") or {}
        ann = meta.get("annotations") or {}
        arrival = _timestamp(meta.get("creationTimestamp"), d.pod)
        tasks.append(Task(d, arrival, _departure(ann.get(DEPARTURE), d.pod)))
    tasks.sort(key=lambda t: t.arrival)
    return nodes, tasks, bound


def _timestamp(value: Any, pod: PodRef) -> float:
    if not value:
        return 0.0
    from datetime import datetime

    try:
        return datetime.fromisoformat(str(value).replace("Z", "+00:00")).timestamp()
    except ValueError:
        raise ValueError(
            f"pod {pod.namespace}/{pod.name}: creationTimestamp {value!r} is not an RFC 3339 time"
        ) from None


def _departure(value: Any, pod: PodRef) -> float | None:
    """`DEPARTURE`'s seconds, which --churn replays as the pod's deletion."""
    if value is None:
        return None
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        seconds = math.nan
    if not math.isfinite(seconds):
        raise ValueError(
            f"pod {pod.namespace}/{pod.name}: {DEPARTURE} {value!r} is not a number of seconds"
        )
    return seconds


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
    _refuse_twice(tasks, bound)
    return nodes, tasks, bound


def _refuse_twice(tasks: Sequence[Task], bound: Sequence[Mapping[str, Any]]) -> None:
    """TraceError for a pod given in both files (each file alone is checked as it is read):
    the cluster keeps one object per name, so the replay would silently drop one of them."""
    pending = (
        {
            "kind": "Pod",
            "metadata": {"namespace": t.demand.pod.namespace, "name": t.demand.pod.name},
        }
        for t in tasks
    )
    if twice := given_twice([*bound, *pending]):
        raise TraceError(f"{twice} is given more than once")


def inflate(
    tasks: list[Task], gpu_capacity: float, factor: float, gpu_bytes: int = TRACE_GPU_MIB * MIB
) -> list[Task]:
    """FGD's protocol: keep drawing tasks in order (repeating the list under new names) until the
    arrived GPU demand reaches `factor` x the cluster's GPU capacity (both in GPUs). ValueError
    where that takes more than `MAX_COPIES` copies of the list (a list of GPU-less pods never
    gets there, and was repeated a thousand times), or the cluster has no GPUs."""
    if factor <= 0 or not tasks:
        return list(tasks)
    target = factor * gpu_capacity
    per_copy = sum(gpu_units(t.demand, gpu_bytes) for t in tasks)
    if target <= 0:
        raise ValueError("the cluster has no GPUs to inflate the pod list against")
    if per_copy * MAX_COPIES < target:
        raise ValueError(
            f"the pod list asks {per_copy:.4g} GPUs; reaching {factor:g} x the cluster's "
            f"{gpu_capacity:g} GPUs would take more than {MAX_COPIES:,} copies of it"
        )
    span = max(t.arrival for t in tasks) + 1.0
    out: list[Task] = []
    demand = 0.0
    taken = {t.key for t in tasks}
    rnd = 0
    while demand < target:
        for t in tasks:
            if demand >= target:
                break
            d = t.demand
            if rnd:
                name = f"{d.pod.name}-r{rnd}"
                while PodRef(d.pod.namespace, name).key in taken:  # a list may hold `a-r1` too
                    name += f"-r{rnd}"
                d = replace(d, pod=PodRef(d.pod.namespace, name))
                taken.add(d.pod.key)
                t = replace(
                    t,
                    demand=d,
                    arrival=t.arrival + rnd * span,
                    departure=None if t.departure is None else t.departure + rnd * span,
                )
            out.append(t)
            demand += gpu_units(d, gpu_bytes)
        rnd += 1
    return out


#: `inflate`'s most copies of a pod list
MAX_COPIES = 1000


def gpu_units(d: Demand, gpu_bytes: int = TRACE_GPU_MIB * MIB) -> float:
    """GPUs a demand takes: whole devices count 1 each, shares count their fraction of `gpu_bytes`."""
    if d.gpu_count == 0:
        return 0.0
    if d.bytes_per_gpu is None:
        return float(d.gpu_count)
    return d.gpu_count * min(1.0, d.bytes_per_gpu / gpu_bytes)
