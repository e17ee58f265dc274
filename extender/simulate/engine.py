"""Replay tasks against a cluster with one policy and measure the result.

Pods that arrive together (same arrival time) are pending together: the greedy policies place
them one by one, the planner plans them as one batch, exactly as for a burst of pending pods (a pod
alone gets the planner's plan of a batch of one: its one-pod rule, `model.SEQUENTIAL_RULE`).
Every vramsched policy places through `Ledger.reserve`, so an overcommit would raise; `spread`
records what the device plugin would do, overcommit included, and the metrics count it.

`planner+repack` is the planner, and when a GPU pod then fits nowhere, repacking by migration
(`planner.repack`): the fewest moves of running pods that make it fit, applied at once, within a
budget of `move_budget` x the pods placed so far (moves spent count against it), at most
`moves_per_gpu` moves per GPU the pod asks and, when set, `moves_per_pod` in all (live mode's caps,
same defaults). In the replay
every running pod may move (the trace says nothing about which could not); the live mode's
per-minute cap and its movable label are `serve --repack`'s. Attempts that cannot succeed are
skipped (`RepackSkips`).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field, fields
from itertools import groupby
from typing import Any

import numpy as np

from extender.cluster import ClusterState
from extender.demand import Demand
from extender.ledger import LedgerError, Reservation, check_invariant
from extender.planner import clock
from extender.planner.capacity import Capacity, FragIndex, Workload, demand_kind
from extender.planner.greedy import choose, first_fit, place_one
from extender.quantity import format_bytes
from extender.repack_policy import MOVES_PER_GPU, moves_to_place
from extender.simulate.ahead_replay import place_with_ahead
from extender.simulate.budget_bound import BudgetBound, StateSnapshot, budget_bound, snapshot
from extender.simulate.profile import PROFILES, LiveProfile
from extender.simulate.trace import Task

__all__ = [
    "MOVES_PER_GPU",
    "PolicyResult",
    "RepackLimits",
    "run_policy",
    "build_capacity",
    "fit_nowhere",
    "while_all_fit",
    "all_fit_line",
    "overcommit_text",
    "allocation_bounds",
    "bound_within_budget",
    "budget_curve_point",
    "bound_line",
    "ALL_POLICIES",
    "VRAMSCHED_POLICIES",
]

ALL_POLICIES = ("planner", "planner+repack", "hot-path", "best-fit", "first-fit", "spread", "fgd")
#: policies whose one-pod rule is the planner's: they judge placements with its FragIndex
PLANNER_POLICIES = ("planner", "planner+repack", "plan-ahead")
#: policies that must never overcommit (they are vramsched's own).
VRAMSCHED_POLICIES = ("planner", "planner+repack", "plan-ahead", "hot-path", "vramsched")
#: `plan-ahead`: what `serve --plan-ahead N` does to pods placed at once (`ahead_replay`); not in
#: ALL_POLICIES: it knows only the pods seen so far, whatever `profile` says
PROFILE_OF = {"plan-ahead": "live"}
#: the pod types `plan-ahead` plans for (`serve --plan-ahead 8`)
AHEAD_TYPES = 8
#: `planner+repack`'s default move budget: moves as a fraction of the pods placed so far.
MOVE_BUDGET = 0.02
#: seconds one repack search may take (`planner.repack.search_repack`'s time limit)
REPACK_TIME_LIMIT = 1.0


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
    #: memory nobody can use at the end: on every GPU, the free memory its free replicas cannot
    #: reach, each taking at most the per-pod cap (the rest of an exclusive GPU or MIG slice in
    #: use, a time-sliced GPU's memory behind its last replica, the unused rest of MPS shares)
    strandedBytes: int = 0
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
    #: pods moved by repacking (`planner+repack`; 0 for the others), the budget they were spent
    #: from (a fraction of the pods placed), the caps per GPU and per pod placed (None: no cap
    #: beyond the one per GPU), repack searches run,
    #: pods they placed, pods that failed without a search (`RepackSkips`), searches that found
    #: no plan without proving that none exists (they stopped at their neighbourhood or time
    #: limit: a wider search might find one), and the searches' wall time
    moves: int = 0
    moveBudget: float = 0.0
    movesPerGpu: int = 0
    movesPerPod: int | None = None
    repackSearches: int = 0
    repackPlaced: int = 0
    repackSkipped: int = 0
    repackUnproven: int = 0
    repackSeconds: float = 0.0
    #: per GPU request ("1 x 810Mi", "8 x whole", `request_label`), what became of the GPU
    #: pods that found no place: `blocked` in all, `budgetSpent` (no move left to spend),
    #: `skipped` (`RepackSkips`, or it fits no node of the empty cluster), `searched`, `placed`
    #: by a plan, the `moves` those plans made
    repackByRequest: dict[str, dict[str, int]] = field(default_factory=dict)
    #: the planner's charge per idle GPU a placement opens (`--open-gpu-cost`; 0 for the others)
    openGpuCost: float = 0.0
    #: (pods arrived, GPUs fully free) after each batch; not in the JSON (one pair per batch)
    freeSeries: list[tuple[int, int]] = field(default_factory=list, repr=False)
    #: the pods placed when a GPU pod first found no place (before any repack), without churn;
    #: they stay to the end, so `bound.allocation_bound(..., placed=...)` bounds this policy's
    #: result and any policy's that agrees with it up to there (`planner+repack` at every
    #: budget agrees with `planner`). Not in the JSON.
    placedAtFirstFailure: list[Demand] | None = field(default=None, repr=False)
    #: the state then, pod for pod (`budget_bound.snapshot`): what `budget_bound` starts from.
    #: Not in the JSON.
    stateAtFirstFailure: StateSnapshot | None = field(default=None, repr=False)
    #: `bound_within_budget` of that state, by move budget, once each (the bounds' JSON and a
    #: budget curve ask for the same one). Not in the JSON.
    budgetBounds: dict[float, BudgetBound] = field(default_factory=dict, repr=False)
    #: the pods placed at the end (without churn): `allocation_bound(..., placed=...)` is then
    #: the most any number of moves could make of this end state. Not in the JSON.
    placedAtEnd: list[Demand] | None = field(default=None, repr=False)
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        skip = (
            "policy",
            "freeSeries",
            "placedAtFirstFailure",
            "stateAtFirstFailure",
            "budgetBounds",
            "placedAtEnd",
            "extra",
        )
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in skip}
        d.update(self.extra)
        return d


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
    base = "planner" if repack else policy
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
                running[t.key] = (t.demand, _held(cap, t.demand, n))
        if out.placedAtFirstFailure is None and not churn and len(placed) < len(batch):
            if any(t.demand.wants_gpu and t.key not in where for t in batch):
                out.placedAtFirstFailure = [demands_of[k].demand for k in where]
                if base == "planner":  # what `bound_within_budget` reads (planner+repack's)
                    out.stateAtFirstFailure = snapshot(
                        cap, ((demands_of[k].demand, n) for k, n in where.items())
                    )
        if repack:
            placed += _repack_failed(
                cap,
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
    if not churn:
        out.placedAtEnd = [demands_of[k].demand for k in where]
    _measure(out, cap, workload, [demands_of[k].demand for k in where])
    if policy != "spread":
        out.invariantViolations = len(check_invariant(cap.ledger))
    return out


@dataclass(frozen=True)
class RepackLimits:
    """What `planner+repack` may spend: moves as a fraction of the pods placed so far, moves
    to place one pod per GPU it asks and in all (live mode's caps: without one, a search could
    spend the whole budget on a long chain for one small pod; on the trace, searches capped at
    3 place more pods with the same budget, and per GPU, a pod that asks 8 GPUs may free 8),
    seconds per search, CP-SAT workers."""

    budget: float = MOVE_BUDGET
    per_gpu: int = MOVES_PER_GPU
    per_pod: int | None = None
    time_limit: float = REPACK_TIME_LIMIT
    num_workers: int = 2

    def allowed(self, d: Demand, placed: int, moved: int) -> int:
        """Moves the search for `d` may make, after `moved` moves and `placed` pods placed."""
        cap = moves_to_place(d.gpu_count, self.per_gpu, self.per_pod)
        return min(cap, int(self.budget * placed) - moved)


@dataclass
class RepackSkips:
    """Repack searches that cannot succeed, skipped: a demand that asks at least what a failed
    search asked (`repack.dominates`), with no more moves allowed than that search had, until the
    layout changes other than by an arrival (a pod leaves, or a plan moves pods). Sound when the
    failure was proven (a pod added only takes capacity); a cut for a search that stopped at its
    neighbourhood or time limit. The replay at inflate 1.3 fails thousands of pods; without this,
    thousands of searches."""

    failed: list[tuple[Demand, int]] = field(default_factory=list)

    def forget(self) -> None:
        """The layout changed other than by an arrival: any failed search may succeed now
        (after a plan's moves, a plan of m moves may exist where none did before)."""
        self.failed.clear()

    def skip(self, d: Demand, max_moves: int) -> bool:
        from extender.planner.repack import dominates

        return any(m >= max_moves and dominates(d, f) for f, m in self.failed)

    def add(self, d: Demand, max_moves: int) -> None:
        from extender.planner.repack import dominates

        self.failed = [(f, m) for f, m in self.failed if not (m <= max_moves and dominates(f, d))]
        self.failed.append((d, max_moves))


def _held(cap: Capacity, d: Demand, node: int) -> Reservation:
    """What a placed pod holds, as repacking reads it: its reservation, or for a GPU-less pod
    one with no devices that names its node."""
    return cap.ledger.reservation(d.pod.key) or Reservation(
        d.pod, cap.arrays.node_names[node], (), ()
    )


_TALLY = ("blocked", "budgetSpent", "skipped", "searched", "placed", "moves")


def request_label(d: Demand) -> str:
    """A GPU request as `repackByRequest` names it: GPUs x memory per GPU (whole: devices)."""
    per_gpu = "whole" if d.bytes_per_gpu is None else format_bytes(d.bytes_per_gpu)
    return f"{d.gpu_count} x {per_gpu}"


def _repack_failed(
    cap: Capacity,
    frag: FragIndex | None,
    batch: Sequence[Task],
    placed_now: int,
    running: dict[str, tuple[Demand, Reservation]],
    where: dict[str, int],
    demands_of: dict[str, Task],
    out: PolicyResult,
    skips: RepackSkips,
    nowhere: set[tuple],
    limits: RepackLimits,
) -> list[tuple[Task, int]]:
    """Repack for every GPU pod of the batch left out, in order, while the budget lasts; the
    pods it places, indexed like the others."""
    from extender.planner.repack import apply_plan, search_repack

    more: list[tuple[Task, int]] = []
    for t in batch:
        d = t.demand
        if t.key in where or not d.wants_gpu:
            continue
        allowed = limits.allowed(d, out.placed + placed_now + len(more), out.moves)
        tally = out.repackByRequest.setdefault(request_label(d), dict.fromkeys(_TALLY, 0))
        tally["blocked"] += 1
        if allowed < 1 or demand_kind(d) in nowhere or skips.skip(d, allowed):
            out.repackSkipped += 1
            tally["budgetSpent" if allowed < 1 else "skipped"] += 1
            continue
        tally["searched"] += 1
        found = search_repack(
            cap,
            d,
            list(running.values()),
            max_moves=allowed,
            time_limit=limits.time_limit,
            num_workers=limits.num_workers,
            place_rule=_planner_rule(),  # moved pods land where the planner would put them
            frag=frag,
        )
        out.repackSearches += 1
        out.repackSeconds += found.seconds
        plan = found.plan
        if plan is None:
            out.repackUnproven += not found.proven
            skips.add(d, allowed)
            continue
        try:
            apply_plan(cap, plan)
        except LedgerError:  # cannot happen for a plan read back and checked; counted as failed
            skips.add(d, allowed)
            continue
        touched = set()
        for mv in plan.moves:
            n = cap.ledger.node_row(mv.target.node)
            assert n is not None
            touched |= {where[mv.pod.key], n}
            where[mv.pod.key] = n
            running[mv.pod.key] = (mv.demand, _held(cap, mv.demand, n))
        n = cap.ledger.node_row(plan.placement.node)
        assert n is not None
        touched.add(n)
        if frag is not None:
            frag.refresh(sorted(touched))
        out.moves += len(plan.moves)
        out.repackPlaced += 1
        tally["placed"] += 1
        tally["moves"] += len(plan.moves)
        if plan.moves:
            skips.forget()
        where[t.key] = n
        demands_of[t.key] = t
        running[t.key] = (d, _held(cap, d, n))
        more.append((t, n))
    return more


def allocation_bounds(
    nodes: Sequence[Mapping[str, Any]],
    bound: Sequence[Mapping[str, Any]],
    tasks: Sequence[Task],
    results: Sequence[PolicyResult] = (),
) -> dict[str, Any]:
    """Upper bounds on GPU memory allocated at the end of a replay without churn
    (`bound.allocation_bound`), as bytes and % of GPU memory, next to the capacity and what
    the pods ask: `anyPolicy`, whatever any policy does (any moves, every arrival known);
    `fromFirstFailure`, for a policy that places what the first of `results` (planner+repack
    preferred, then planner) had placed when a GPU pod first found no place (`planner+repack`
    places like `planner` until then, at every move budget); `fromFirstFailureWithBudget`, for
    `planner+repack`, the same state kept pod for pod and at most its move budget of pods moved
    (`budget_bound.budget_bound`); `fromEnd`, per policy (fgd,
    planner+repack), the most any number of moves could make of its end state, its pods kept
    and the pods that failed free to join."""
    from extender.simulate.bound import allocation_bound

    _, cap = build_capacity(nodes, bound)
    a = cap.arrays
    total = int(a.capacity.sum())
    held = int(np.minimum(a.used, a.capacity).sum())  # pods bound before the replay
    demands = [t.demand for t in tasks]
    anyb = allocation_bound(cap, demands)

    def pct(b: float) -> float:
        return round(100 * (b + held) / total, 3) if total else 0.0

    out: dict[str, Any] = {
        "capacityBytes": total,
        "demandBytes": anyb.demand_bytes,
        "anyPolicyBytes": round(anyb.bytes + held),
        "anyPolicyPct": pct(anyb.bytes),
        "status": anyb.status,
        "seconds": round(anyb.seconds, 2),
    }
    order = {"planner+repack": 0, "planner": 1}
    ref = sorted(
        (r for r in results if r.placedAtFirstFailure is not None),
        key=lambda r: order.get(r.policy, 2),
    )
    if ref:
        r = ref[0]
        b = allocation_bound(cap, demands, placed=r.placedAtFirstFailure or ())
        out["fromFirstFailure"] = {
            "policy": r.policy,
            "placedThen": len(r.placedAtFirstFailure or ()),
            "bytes": round(b.bytes + held),
            "pct": pct(b.bytes),
            "status": b.status,
        }
        bb = bound_within_budget(r, tasks, r.moveBudget) if r.policy == "planner+repack" else None
        if bb is not None:
            out["fromFirstFailureWithBudget"] = {
                "moveBudget": r.moveBudget,
                "bytes": round(bb.bytes),
                "pct": round(100 * bb.bytes / total, 3) if total else 0.0,
                "status": bb.status,
                "seconds": round(bb.seconds, 2),
            }
    ends = {}
    for r in results:
        if r.placedAtEnd is not None and r.policy in ("fgd", "planner+repack"):
            b = allocation_bound(cap, demands, placed=r.placedAtEnd)
            ends[r.policy] = {"bytes": round(b.bytes + held), "pct": pct(b.bytes)}
    if ends:
        out["fromEnd"] = ends
    return out


def bound_within_budget(
    r: PolicyResult, tasks: Sequence[Task], fraction: float
) -> BudgetBound | None:
    """`budget_bound` from `r`'s first failure, with at most `fraction` x the pods placed
    moved (None: no GPU pod failed, or the replay had churn). Solved once per budget."""
    state = r.stateAtFirstFailure
    if state is None:
        return None
    if fraction not in r.budgetBounds:
        later = later_demands(state, tasks)
        r.budgetBounds[fraction] = budget_bound(state, later, fraction=fraction)
    return r.budgetBounds[fraction]


def later_demands(state: StateSnapshot, tasks: Sequence[Task]) -> list[Demand]:
    """The demands of `tasks` not placed in `state` (a first failure's snapshot): the pods a
    bound from that state may still take."""
    kept = {p.demand.pod.key for p in state.pods}
    return [t.demand for t in tasks if t.key not in kept]


def budget_curve_point(budget: float, r: PolicyResult, tasks: Sequence[Task]) -> dict[str, Any]:
    """One point of a budget curve: what `planner+repack` (`planner` at budget 0) reached with
    this move budget, and the bound from its first failure within the same budget
    (`boundPct`, when a GPU pod failed)."""
    point: dict[str, Any] = {
        "moveBudget": budget,
        "allocatedMemoryBytes": r.allocatedMemoryBytes,
        "allocatedPct": round(100 * r.allocatedMemoryBytes / r.capacityMemoryBytes, 3)
        if r.capacityMemoryBytes
        else 0.0,
        "placed": r.placed,
        "moves": r.moves,
        "repackPlaced": r.repackPlaced,
        "repackSearches": r.repackSearches,
        "seconds": round(r.seconds, 1),
    }
    bb = bound_within_budget(r, tasks, budget)
    if bb is not None and bb.status == "OPTIMAL" and r.capacityMemoryBytes:
        point["boundPct"] = round(100 * bb.bytes / r.capacityMemoryBytes, 3)
    return point


def bound_line(b: Mapping[str, Any]) -> str:
    """`allocation_bounds` in one line, as the simulator and the trace benchmark print it."""
    line = f"bound on GPU memory allocated: any policy {b['anyPolicyPct']:.2f}%"
    f = b.get("fromFirstFailure")
    if f:
        line += (
            f"; placing like {f['policy']} until a GPU pod first fits nowhere "
            f"({f['placedThen']} pods then): {f['pct']:.2f}%"
        )
    w = b.get("fromFirstFailureWithBudget")
    if w:
        line += f"; and then moving at most {100 * w['moveBudget']:g}% of the pods: {w['pct']:.2f}%"
    for policy, e in (b.get("fromEnd") or {}).items():
        line += f"; {policy}'s end state with any moves: {e['pct']:.2f}%"
    return line


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
