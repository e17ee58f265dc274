"""Replay tasks against a cluster with one policy and measure the result.

Pods that arrive together (same arrival time) are pending together: the greedy policies place
them one by one, the planner plans them as one batch, exactly as for a burst of pending pods (a pod
alone gets the planner's plan of a batch of one: FGD's rule, `model.SEQUENTIAL_RULE`).
Every vramsched policy places through `Ledger.reserve`, so an overcommit would raise; `spread`
records what the device plugin would do, overcommit included, and the metrics count it.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from itertools import groupby
from typing import Any

import numpy as np

from extender.cluster import ClusterState
from extender.ledger import LedgerError, check_invariant
from extender.planner.capacity import Capacity, FragIndex, Workload, demand_kind
from extender.planner.greedy import choose, first_fit, place_one
from extender.simulate.trace import Task

__all__ = [
    "PolicyResult",
    "run_policy",
    "build_capacity",
    "fit_nowhere",
    "while_all_fit",
    "all_fit_line",
    "overcommit_text",
    "ALL_POLICIES",
    "VRAMSCHED_POLICIES",
]

ALL_POLICIES = ("planner", "hot-path", "best-fit", "first-fit", "spread", "fgd")
#: policies that must never overcommit (they are vramsched's own).
VRAMSCHED_POLICIES = ("planner", "hot-path", "vramsched")


@dataclass
class PolicyResult:
    policy: str
    placed: int = 0
    failed: int = 0
    allocatedMemoryBytes: int = 0
    requestedMemoryBytes: int = 0
    capacityMemoryBytes: int = 0
    gpusInUse: int = 0
    gpusFree: int = 0
    gpusTotal: int = 0
    overcommittedGpus: int = 0
    #: the most GPUs overcommitted at once after any batch (with churn, pods that overcommitted
    #: a GPU may have left by the end)
    overcommittedGpusPeak: int = 0
    overcommittedBytes: int = 0
    fragmentationBytes: float = 0.0
    fragmentationRate: float = 0.0
    failedGpuPods: int = 0
    seconds: float = 0.0
    batches: int = 0
    solverBatches: int = 0
    solverRuns: int = 0
    solverOptimal: int = 0
    solverImproved: int = 0
    invariantViolations: int = 0
    gpusFreeMean: float = 0.0
    #: fully free GPUs weighted by the share of the workload's GPU pods that could start on each
    #: now (`usable_free_gpus`), at the end of the replay
    gpusFreeUsable: float = 0.0
    gpusInUsePeak: int = 0
    #: batches placed in full before the first one in which a pod that fits the starting cluster
    #: found no place (all of them if none), and the pods that arrived in those batches: how far
    #: the replay stays in the regime where every pod fits
    allFitBatches: int = 0
    allFitArrivals: int = 0
    #: (pods arrived, GPUs fully free) after each batch; not in the JSON (one pair per batch)
    freeSeries: list[tuple[int, int]] = field(default_factory=list, repr=False)
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("policy")
        d.pop("freeSeries")
        d.update(d.pop("extra"))
        return d


def build_capacity(
    nodes: Sequence[Mapping[str, Any]], bound: Sequence[Mapping[str, Any]] = ()
) -> tuple[ClusterState, Capacity]:
    """The cluster through the server's own loader; bound pods hold their GPUs, CPU and memory
    (the CPU/memory sums the cluster keeps per node)."""
    cluster = ClusterState()
    cluster.load([*nodes, *bound])
    return cluster, Capacity.from_ledger(cluster.ledger, cluster.cpu_used, cluster.memory_used)


def run_policy(
    policy: str,
    nodes: Sequence[Mapping[str, Any]],
    tasks: Sequence[Task],
    bound: Sequence[Mapping[str, Any]] = (),
    *,
    churn: bool = False,
    workload: Workload | None = None,
    time_limit: float = 1.0,
    num_workers: int = 2,
    accept: str | None = None,
) -> PolicyResult:
    cluster, cap = build_capacity(nodes, bound)
    workload = workload or Workload.from_demands(t.demand for t in tasks)
    frag = (
        None
        if policy in ("first-fit", "best-fit", "spread", "hot-path")
        else FragIndex(cap, workload)
    )
    out = PolicyResult(policy)
    start = time.perf_counter()
    where: dict[str, int] = {}
    demands_of: dict[str, Task] = {}
    departures = sorted((t.departure, t.key) for t in tasks if churn and t.departure is not None)
    nowhere = fit_nowhere(cap, tasks)
    di = 0
    free_sum = 0
    all_fit = True
    for arrival, group in groupby(tasks, key=lambda t: t.arrival):
        batch = list(group)
        while di < len(departures) and departures[di][0] <= arrival:
            key = departures[di][1]
            di += 1
            if key in where:
                n = where.pop(key)
                cap.remove(demands_of[key].demand, n)
                if frag is not None:
                    frag.refresh([n])
        out.batches += 1
        if policy == "planner" and len(batch) > 1:
            placed = _plan_batch(cap, frag, batch, out, time_limit, num_workers, accept)
        else:
            rule = _planner_rule() if policy == "planner" else policy
            placed = []
            for t in batch:
                ch = choose(rule, cap, t.demand, frag)
                if ch is None:
                    continue
                try:
                    place_one(cap, t.demand, ch, frag)
                except LedgerError:
                    continue
                placed.append((t, ch[1]))
        for t, n in placed:
            where[t.key] = n
            demands_of[t.key] = t
        a = cap.arrays
        in_use = int((a.used_replicas > 0).sum())
        out.overcommittedGpusPeak = max(out.overcommittedGpusPeak, int(_overcommitted(a).sum()))
        free_sum += len(a.used_replicas) - in_use
        out.gpusInUsePeak = max(out.gpusInUsePeak, in_use)
        out.placed += len(placed)
        ok = {t.key for t, _ in placed}
        for t in batch:
            if t.key not in ok:
                out.failed += 1
                out.failedGpuPods += t.demand.gpu_count > 0
                all_fit = all_fit and demand_kind(t.demand) in nowhere
        arrived = (out.freeSeries[-1][0] if out.freeSeries else 0) + len(batch)
        out.freeSeries.append((arrived, len(a.used_replicas) - in_use))
        if all_fit:
            out.allFitBatches, out.allFitArrivals = out.batches, arrived
    out.seconds = time.perf_counter() - start
    out.gpusFreeMean = free_sum / max(1, out.batches)
    _measure(out, cap, workload, [demands_of[k].demand for k in where])
    if policy != "spread":
        out.invariantViolations = len(check_invariant(cap.ledger))
    return out


def fit_nowhere(cap: Capacity, tasks: Sequence[Task]) -> set[tuple]:
    """Demand kinds that fit no node of the starting cluster: every policy fails them, wherever
    the others went, so they do not end the regime in which every pod fits."""
    fits: dict[tuple, bool] = {}
    for t in tasks:
        k = demand_kind(t.demand)
        if k not in fits:
            fits[k] = first_fit(cap, t.demand) is not None
    return {k for k, ok in fits.items() if not ok}


def while_all_fit(results: Sequence[PolicyResult]) -> dict[str, Any] | None:
    """GPUs fully free per policy after the last batch that every policy placed in full (pods that
    fit nowhere aside): the comparison where every pod can fit, which a replay's end is not once
    one policy has started failing pods (the others then leave GPUs free by placing fewer pods).
    A policy that overcommitted VRAM at any point (`spread`) is left out: its free GPUs and its
    failures come from pods stacked beyond a GPU's memory."""
    fair = [r for r in results if not r.overcommittedGpusPeak]
    k = min((r.allFitBatches for r in fair), default=0)
    if k == 0:
        return None
    return {
        "batches": k,
        "arrivals": fair[0].freeSeries[k - 1][0],
        "gpusFree": {r.policy: r.freeSeries[k - 1][1] for r in fair},
    }


def all_fit_line(fit: Mapping[str, Any]) -> str:
    """`while_all_fit`'s answer in one line, as the simulator and the trace benchmark print it."""
    return (
        f"while every pod fit (the first {fit['arrivals']} pods, {fit['batches']} batches), GPUs fully free: "
        + ", ".join(f"{p} {v}" for p, v in fit["gpusFree"].items())
    )


def overcommit_text(end: int, peak: int) -> str:
    """GPUs overcommitted at the end of a replay, with the peak where churn made them differ."""
    return f"{end}" if peak == end else f"{end} (peak {peak})"


def _planner_rule() -> str:
    from extender.planner import model

    return model.SEQUENTIAL_RULE  # a pod alone: the planner's plan of a batch of one


def _plan_batch(
    cap: Capacity,
    frag: FragIndex | None,
    batch: list[Task],
    out: PolicyResult,
    time_limit: float,
    num_workers: int,
    accept: str | None,
):
    from extender.planner.model import solve_batch

    demands = [t.demand for t in batch]
    plan = solve_batch(
        cap, demands, frag, time_limit=time_limit, num_workers=num_workers, accept=accept
    )
    out.solverBatches += 1
    out.solverRuns += (
        plan.stats.get("nodeCopies", 0) > 0
    )  # CP-SAT ran (skipped when it could not gain)
    out.solverOptimal += plan.status == "OPTIMAL"
    out.solverImproved += plan.improved
    placed = []
    for i, choice in plan.choices.items():
        try:
            place_one(cap, demands[i], choice, frag)
        except LedgerError:
            continue  # cannot happen for a valid plan; counted as failed rather than overcommitted
        placed.append((batch[i], choice[1]))
    return placed


def _measure(out: PolicyResult, cap: Capacity, workload: Workload, placed) -> None:
    a = cap.arrays
    used = a.used
    out.capacityMemoryBytes = int(a.capacity.sum())
    out.allocatedMemoryBytes = int(np.minimum(used, a.capacity).sum())
    out.requestedMemoryBytes = int(used.sum())
    over = _overcommitted(a)
    out.overcommittedGpus = int(over.sum())
    out.overcommittedBytes = int(np.maximum(used - a.capacity, 0).sum())
    out.gpusTotal = len(a.capacity)
    out.gpusInUse = int((a.used_replicas > 0).sum())
    out.gpusFree = int((a.used_replicas == 0).sum())
    f = FragIndex(cap, workload)
    out.fragmentationBytes = float(f.node_frag().sum())
    out.gpusFreeUsable = usable_free_gpus(f)
    free = float(np.maximum(a.capacity - used, 0).sum())
    out.fragmentationRate = out.fragmentationBytes / free if free else 0.0


def _overcommitted(a) -> np.ndarray:
    """GPUs holding more memory or more pods than they have (only `spread` can get there)."""
    return (a.used > a.capacity) | (a.used_replicas > a.replicas)


def usable_free_gpus(f: FragIndex) -> float:
    """Fully free GPUs, each counted by the share of the workload's GPU pods (FGD's task types,
    by weight) that could start on it now: its model and size fit the type, and its node has the
    CPU, memory and GPUs the type asks for. "GPUs fully free" counts a GPU on a node whose CPU is
    gone as free; a pod arriving next could not use it, and FGD's measure counts it as stranded.
    This is the same count, in FGD's terms: what a free GPU is worth to the next pods."""
    a, w = f.a, f.w
    rows = np.flatnonzero(a.used_replicas == 0)
    weight = np.where(f.gpuless, 0.0, w.weight)
    if not len(rows) or weight.sum() == 0:
        return 0.0
    ok = f.usable(rows, (a.capacity - a.used)[rows], (a.replicas - a.used_replicas)[rows])
    run = f.runnable(f.cap.cpu_free, f.cap.mem_free, f.okc)[a.node_of[rows]]
    return float(((ok & run) @ (weight / weight.sum())).sum())
