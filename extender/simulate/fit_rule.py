"""What "a pod that fits is placed" adds to a bound without moves.

A scheduler does not turn pods away: kube-scheduler binds a pod as soon as some node has room
for it, and every replayed policy does the same. `budget_bound` lets its LP take any subset of
the later pods, so it may leave out pods that would have fitted when they came, to keep room for
larger ones that come after. Without moves and without departures no policy can: free GPU
memory, replicas, CPU and memory only shrink, so a pod that finds no place finds none later, nor
does any pod that asks at least as much in every way (`repack_pool.dominates`). Hence, for the
arrivals after a state, with y[k][m] = 1 when the m-th later pod of kind k is placed:

- y[k][m] >= y[k][m + 1]: once a kind finds no place, it never finds one again;
- y[j][i] <= y[k][m] when kind j dominates kind k and k's m-th pod is its last to arrive in a
  batch before j's i-th: had k been turned away, j would be too (written only for j's first pod
  after each of k's: y[j] falls with i);
- the GPU pods of the batch that failed at the state (the first failure) are turned away;
- sum over m of y[k][m] = the pods of kind k the LP takes.

Every run of such a policy from the state is an integer point of these rows, so the LP with
them (y relaxed to [0, 1]) is still an upper bound, and a lower one than without them. It
does not hold with moves: a move can make room where a pod found none.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from collections.abc import Mapping, Sequence

from ortools.linear_solver import pywraplp  # type: ignore[import-untyped]

from extender.demand import Demand
from extender.planner.capacity import demand_kind
from extender.planner.repack_pool import dominates

__all__ = ["add_fit_rule"]

Kind = tuple[object, ...]  # `capacity.demand_kind`


def add_fit_rule(
    solver: pywraplp.Solver,
    taken: Mapping[Kind, pywraplp.Variable],
    later: Sequence[tuple[Demand, float]],
    *,
    first_failed: bool = True,
) -> int:
    """Add the rows above to `solver`, whose `taken[kind]` counts the later GPU pods of each kind
    it places. `later`: (demand, arrival) of the pods arriving after the state, in arrival order;
    `first_failed`: whether the GPU pods of the first batch in it were turned away (a first
    failure's state). Returns the number of rows added."""
    inf = solver.infinity()
    first: dict[Kind, Demand] = {}
    when: dict[Kind, list[float]] = defaultdict(list)
    for d, arrival in later:
        if d.gpu_count > 0:
            kind: Kind = demand_kind(d)
            first.setdefault(kind, d)
            when[kind].append(arrival)
    y: dict[Kind, list[pywraplp.Variable]] = {}
    rows = 0
    for k, arrivals in when.items():
        ys = y[k] = [solver.NumVar(0.0, 1.0, "") for _ in arrivals]
        total = solver.Constraint(0.0, 0.0)
        for v in ys:
            total.SetCoefficient(v, 1.0)
        total.SetCoefficient(taken[k], -1.0)
        for a, b in zip(ys, ys[1:]):
            row = solver.Constraint(0.0, inf)
            row.SetCoefficient(a, 1.0)
            row.SetCoefficient(b, -1.0)
        rows += len(ys)
    if first_failed and when:
        t0 = min(arrivals[0] for arrivals in when.values())
        for k, arrivals in when.items():
            if arrivals[0] == t0:
                y[k][0].SetUb(0.0)
    for j, dj in first.items():
        for k, dk in first.items():
            if j == k or not dominates(dj, dk):
                continue
            k_when, last = when[k], -1
            for i, t in enumerate(when[j]):
                m = bisect.bisect_left(k_when, t) - 1  # k's last pod of an earlier batch
                if m == last:  # y[j] falls with i: the first j pod after k's m-th is enough
                    continue
                last = m
                row = solver.Constraint(-inf, 0.0)
                row.SetCoefficient(y[j][i], 1.0)
                row.SetCoefficient(y[k][m], -1.0)
                rows += 1
    return rows
