"""The upper bounds a replay is compared with (`simulate.bound`, `simulate.budget_bound`), run for
its results and put in the JSON and in one line of text."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from itertools import groupby
from typing import Any

import numpy as np

from extender.demand import Demand
from extender.simulate.budget_bound import BudgetBound, StateSnapshot, budget_bound
from extender.simulate.engine import build_capacity
from extender.simulate.result import PolicyResult
from extender.simulate.trace import Task

__all__ = [
    "allocation_bounds",
    "bound_placing_fits",
    "bound_within_budget",
    "budget_curve_point",
    "bound_line",
    "later_demands",
    "later_tasks",
]


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
    (`budget_bound.budget_bound`); `fromFirstFailurePlacingFits`, the same state kept and no
    pod moved, for a policy that places every pod that fits when it arrives (`fit_rule`);
    `fromEnd`, per policy (fgd,
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

        def from_state(bb: BudgetBound) -> dict[str, Any]:  # its bytes count the pods held
            return {
                "bytes": round(bb.bytes),
                "pct": round(100 * bb.bytes / total, 3) if total else 0.0,
                "status": bb.status,
                "seconds": round(bb.seconds, 2),
            }

        fits = bound_placing_fits(r, tasks)
        if fits is not None:
            out["fromFirstFailurePlacingFits"] = from_state(fits)
        bb = bound_within_budget(r, tasks, r.moveBudget) if r.policy == "planner+repack" else None
        if bb is not None:
            out["fromFirstFailureWithBudget"] = {"moveBudget": r.moveBudget, **from_state(bb)}
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


def bound_placing_fits(r: PolicyResult, tasks: Sequence[Task]) -> BudgetBound | None:
    """`budget_bound` from `r`'s first failure without moves, every later pod that fits placed
    (`fit_rule`); None: no GPU pod failed, or the replay had churn."""
    state = r.stateAtFirstFailure
    if state is None:
        return None
    batch: dict[str, float] = {}  # the replay's batches: runs of equal arrival, in task order
    for n, (_, group) in enumerate(groupby(tasks, key=lambda t: t.arrival)):
        batch.update((t.key, float(n)) for t in group)
    later = later_tasks(state, tasks)
    return budget_bound(state, [t.demand for t in later], arrivals=[batch[t.key] for t in later])


def later_tasks(state: StateSnapshot, tasks: Sequence[Task]) -> list[Task]:
    """The tasks not placed in `state` (a first failure's snapshot), in order: the pods a bound
    from that state may still take."""
    kept = {p.demand.pod.key for p in state.pods}
    return [t for t in tasks if t.key not in kept]


def later_demands(state: StateSnapshot, tasks: Sequence[Task]) -> list[Demand]:
    """The demands of `later_tasks`."""
    return [t.demand for t in later_tasks(state, tasks)]


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
    p = b.get("fromFirstFailurePlacingFits")
    if p:
        line += f"; and then placing every pod that fits, no moves: {p['pct']:.2f}%"
    w = b.get("fromFirstFailureWithBudget")
    if w:
        line += f"; and then moving at most {100 * w['moveBudget']:g}% of the pods: {w['pct']:.2f}%"
    for policy, e in (b.get("fromEnd") or {}).items():
        line += f"; {policy}'s end state with any moves: {e['pct']:.2f}%"
    return line
