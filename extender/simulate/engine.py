"""Replay tasks against a cluster with one policy and measure the result.

Pods that arrive together (same arrival time) are pending together: the greedy policies place
them one by one, the planner plans them as one batch, exactly as for a burst of pending pods (a pod
alone gets the planner's plan of a batch of one: its one-pod rule, `model.SEQUENTIAL_RULE`).
Every vramsched policy places through `Ledger.reserve`, so an overcommit would raise; `spread`
records what the device plugin would do, overcommit included, and the metrics count it.

`planner+repack` is the planner, and when a GPU pod then fits nowhere, repacking by migration
within a move budget (`repack_replay`); `planner+preempt` is the planner, and then preemption by
VRAM (`preempt_replay`). What a replay measured is a `PolicyResult`; the bounds
it is compared with are `bound_report`'s.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Mapping, Sequence
from contextlib import nullcontext
from itertools import groupby
from typing import Any

import numpy as np

from extender.cluster import ClusterState
from extender.demand import Demand
from extender.ledger import LedgerError, Reservation, check_invariant
from extender.planner import clock
from extender.planner.capacity import Capacity, FragIndex, Workload, demand_kind
from extender.planner.greedy import choose, first_fit, place_one
from extender.repack_policy import MOVES_PER_GPU
from extender.simulate.ahead_replay import place_with_ahead
from extender.simulate.budget_bound import snapshot
from extender.simulate.preempt_replay import PriorityTally, preempt_failed
from extender.simulate.profile import PROFILES, LiveProfile
from extender.simulate.repack_replay import (
    MOVE_BUDGET,
    REPACK_TIME_LIMIT,
    RepackLimits,
    RepackSkips,
    held,
    repack_failed,
)
from extender.simulate.result import PolicyResult
from extender.simulate.trace import Task

__all__ = [
    "MOVE_BUDGET",
    "MOVES_PER_GPU",
    "REPACK_TIME_LIMIT",
    "PolicyResult",
    "replay",
    "run_policy",
    "build_capacity",
    "fit_nowhere",
    "while_all_fit",
    "all_fit_line",
    "overcommit_text",
    "usable_free_gpus",
    "ALL_POLICIES",
    "VRAMSCHED_POLICIES",
]

ALL_POLICIES = ("planner", "planner+repack", "hot-path", "best-fit", "first-fit", "spread", "fgd")
#: `planner+preempt`: what `serve --preempt` adds to the planner; not in ALL_POLICIES: it acts
#: only on pods of different priorities (`simulate --priorities qos` for the trace)
PREEMPT_POLICY = "planner+preempt"
#: policies whose one-pod rule is the planner's: they judge placements with its FragIndex
PLANNER_POLICIES = ("planner", "planner+repack", "plan-ahead", PREEMPT_POLICY)
#: policies that must never overcommit (they are vramsched's own).
VRAMSCHED_POLICIES = (
    "planner",
    "planner+repack",
    "plan-ahead",
    PREEMPT_POLICY,
    "hot-path",
    "vramsched",
)
#: `plan-ahead`: what `serve --plan-ahead N` does to pods placed at once (`ahead_replay`); not in
#: ALL_POLICIES: it knows only the pods seen so far, whatever `profile` says
PROFILE_OF = {"plan-ahead": "live"}
#: the pod types `plan-ahead` plans for (`serve --plan-ahead 8`)
AHEAD_TYPES = 8


def replay(deterministic: bool, *args: Any, **kwargs: Any) -> PolicyResult:
    """`run_policy(*args, **kwargs)`; with `deterministic`, its time limits count work, not wall
    time (`planner.clock.work_clock`), so plans the solver finds within them are the same on
    every run, however busy the machine."""
    with clock.work_clock() if deterministic else nullcontext():
        return run_policy(*args, **kwargs)


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
    move_budget: float = MOVE_BUDGET,
    repack_time_limit: float = REPACK_TIME_LIMIT,
    moves_per_gpu: int = MOVES_PER_GPU,
    moves_per_pod: int | None = None,
    count_foreign: bool | None = None,
    open_cost: float = 0.0,
    profile: str = "whole",
    ahead_types: int = AHEAD_TYPES,
) -> PolicyResult:
    """One policy over `tasks`. `count_foreign`: whether the fragmentation measure counts other
    GPU models' memory as stranded (`capacity.FragIndex`); None: as FGD does, except for the
    planner's policies. `open_cost`: the planner's charge per idle GPU a placement opens, in GPUs
    of memory (`FragIndex.open_cost`; the other policies ignore it). `profile`: the pod mix that
    measure weighs by (`simulate.profile`): `workload` throughout, or the pods arrived and not
    left, as `serve` counts them; the result's fragmentation figures use `workload` either way.
    `ahead_types`: `plan-ahead`'s pod types."""
    if profile not in PROFILES:
        raise ValueError(f"profile must be one of {', '.join(PROFILES)}, got {profile!r}")
    cluster, cap = build_capacity(nodes, bound)
    if count_foreign is None:
        count_foreign = policy not in PLANNER_POLICIES
    if policy not in PLANNER_POLICIES:
        open_cost = 0.0
    workload = workload or Workload.from_demands(t.demand for t in tasks)
    frag = (
        None
        if policy in ("first-fit", "best-fit", "spread", "hot-path")
        else FragIndex(cap, workload, count_foreign=count_foreign, open_cost=open_cost)
    )
    repack = policy == "planner+repack"
    preempt = policy == PREEMPT_POLICY
    base = "planner" if repack or preempt else policy
    out = PolicyResult(
        policy,
        moveBudget=move_budget if repack else 0.0,
        movesPerGpu=moves_per_gpu if repack else 0,
        movesPerPod=moves_per_pod if repack else None,
        openGpuCost=open_cost,
    )
    limits = RepackLimits(move_budget, moves_per_gpu, moves_per_pod, repack_time_limit, num_workers)
    live = (
        LiveProfile() if frag is not None and "live" in (profile, PROFILE_OF.get(policy)) else None
    )
    running: dict[str, tuple[Demand, Reservation]] = {}
    skips = RepackSkips()
    tally = PriorityTally(len(cap.arrays.node_names)) if preempt else None
    failed_by: Counter[int] = Counter()  # GPU pods failed, by priority
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
            if live is not None:
                live.leave(key)
            if key in where:
                n = where.pop(key)
                running.pop(key, None)
                cap.remove(demands_of[key].demand, n)
                if tally is not None:
                    tally.remove(demands_of[key].demand, n)
                skips.forget()
                if frag is not None:
                    frag.refresh([n])
        out.batches += 1
        if live is not None and policy != "plan-ahead":
            frag = _count_arrivals(live, batch, frag, cap, count_foreign, open_cost)
        if policy == "plan-ahead":
            assert frag is not None and live is not None
            placed, ahead = place_with_ahead(cap, frag, batch, live, ahead_types)
            out.extra["aheadPlaced"] = out.extra.get("aheadPlaced", 0) + ahead
            frag = _count_arrivals(live, batch, frag, cap, count_foreign, open_cost)
        elif base == "planner" and len(batch) > 1:
            placed = _plan_batch(cap, frag, batch, out, time_limit, num_workers, accept)
        else:
            rule = _planner_rule() if base == "planner" else policy
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
            if repack:
                running[t.key] = (t.demand, held(cap, t.demand, n))
            if tally is not None:
                tally.add(t.demand, n)
        if out.placedAtFirstFailure is None and not churn and len(placed) < len(batch):
            if any(t.demand.wants_gpu and t.key not in where for t in batch):
                out.placedAtFirstFailure = [demands_of[k].demand for k in where]
                if base == "planner":  # what `bound_within_budget` reads (planner+repack's)
                    out.stateAtFirstFailure = snapshot(
                        cap, ((demands_of[k].demand, n) for k, n in where.items())
                    )
        if repack:
            placed += repack_failed(
                cap,
                _planner_rule(),  # moved pods land where the planner would put them
                frag,
                batch,
                len(placed),
                running,
                where,
                demands_of,
                out,
                skips,
                nowhere,
                limits,
            )
        if tally is not None:
            more, lost = preempt_failed(
                cap, _planner_rule(), frag, batch, where, demands_of, tally, out, nowhere
            )
            placed += more
            out.placed -= len(lost)  # running pods evicted that found no place again
            out.failed += len(lost)
            out.failedGpuPods += len(lost)
            failed_by.update(t.demand.priority for t in lost)
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
                if t.demand.wants_gpu:
                    failed_by[t.demand.priority] += 1
                all_fit = all_fit and demand_kind(t.demand) in nowhere
        arrived = (out.freeSeries[-1][0] if out.freeSeries else 0) + len(batch)
        out.freeSeries.append((arrived, len(a.used_replicas) - in_use))
        if all_fit:
            out.allFitBatches, out.allFitArrivals = out.batches, arrived
    out.seconds = time.perf_counter() - start
    out.gpusFreeMean = free_sum / max(1, out.batches)
    if not churn:
        out.placedAtEnd = [demands_of[k].demand for k in where]
    by_priority = _allocated_by_priority(cap, tasks)
    if by_priority is not None:
        out.extra["allocatedByPriority"] = by_priority
        out.extra["failedGpuPodsByPriority"] = {p: failed_by[int(p)] for p in by_priority}
    _measure(out, cap, workload, [demands_of[k].demand for k in where])
    if policy != "spread":
        out.invariantViolations = len(check_invariant(cap.ledger))
    return out


def _allocated_by_priority(cap: Capacity, tasks: Sequence[Task]) -> dict[str, int] | None:
    """VRAM the pods hold at the end per priority (as text, highest first), where the replayed
    pods have more than one: what preemption trades."""
    priorities = {t.demand.priority for t in tasks}
    if len(priorities) < 2:
        return None
    held = dict.fromkeys(sorted(priorities, reverse=True), 0)
    for res in cap.ledger.reservations():
        held[res.priority] = held.get(res.priority, 0) + res.total_bytes
    return {str(p): b for p, b in held.items()}


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


def _count_arrivals(
    live: LiveProfile,
    batch: list[Task],
    frag: FragIndex | None,
    cap: Capacity,
    count_foreign: bool,
    open_cost: float,
) -> FragIndex | None:
    """Count `batch` in the live profile: `frag`, or the measure rebuilt from the profile when it
    has drifted."""
    for t in batch:
        live.arrive(t.key, t.demand)
    if not live.stale():
        return frag
    return FragIndex(cap, live.workload(), count_foreign=count_foreign, open_cost=open_cost)


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
    left = np.maximum(a.replicas - a.used_replicas, 0).astype(np.int64)
    out.strandedBytes = int(np.maximum(a.capacity - used - left * a.per_pod_cap, 0).sum())


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
