"""Step 4 of `repack`'s search: the CP-SAT model of one round (the pod on one of some candidate
nodes, movable pods free to land on the round's nodes), its solve and its read-back, kept apart
as in the other planners."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
from ortools.sat.python import cp_model

from extender.demand import Demand
from extender.planner.capacity import Capacity, candidates, demand_kind
from extender.planner.move_model import MoveModel, Mover, reservation_for
from extender.planner.repack_plan import (
    Move,
    RepackPlan,
    TargetNodes,
    final_state_fits,
    source_of,
)
from extender.planner.repack_pool import INF
from extender.planner.staged import Settings, Stage, staged_solve

__all__ = ["destinations", "solve_round", "read_back"]


def destinations(
    cap: Capacity, movers: Sequence[Mover], chosen: set[int], per_kind: int, most: int
) -> set[int]:
    """Nodes outside `chosen` where the movers could land now: per kind of mover, the
    `per_kind` nodes its best fits are on (least memory left first)."""
    a = cap.arrays
    out: set[int] = set()
    seen: set[tuple[object, ...]] = set()
    for m in sorted(movers, key=lambda m: -m.demand.gpu_count):
        kind = demand_kind(m.demand)
        if kind in seen:
            continue
        seen.add(kind)
        c = candidates(cap, m.demand)
        if len(c) == 0:
            continue
        left = c.leftover(a) if m.demand.gpu_count else cap.cpu_free[c.node]
        picked = 0
        for i in np.lexsort((c.node, left)).tolist():
            n = int(c.node[i])
            if n in chosen or n in out:
                continue
            out.add(n)
            picked += 1
            if picked >= per_kind or len(out) >= most:
                break
        if len(out) >= most:
            break
    return out


def solve_round(
    cap: Capacity,
    pod: Demand,
    movers: Sequence[Mover],
    nodes: Sequence[int],
    chosen: Sequence[int],
    bounds: np.ndarray,
    limit: int,
    deadline: float,
    num_workers: int,
    target_nodes: TargetNodes | None = None,
) -> tuple[RepackPlan | None, str]:
    """One CP-SAT model: the pod on one of `chosen`, the movers anywhere in `nodes` that
    `target_nodes` allows them (their own node always: a pod that stays is no new copy)."""
    a = cap.arrays
    allowed = np.zeros(len(a.node_names), bool)
    allowed[list(chosen)] = True
    everyone = [Mover(pod, required=True), *movers]
    masks = [allowed] + [
        target_nodes(mv.demand) if target_nodes is not None else None for mv in movers
    ]

    def restrict(i: int, rows: np.ndarray) -> np.ndarray:
        mask = masks[i]
        if mask is None:
            return np.ones(len(rows), bool)
        kept: np.ndarray = mask[a.node_of[rows]]
        if i:  # a moved pod may stay where it is: that is no new copy
            kept |= np.isin(rows, everyone[i].rows)
        return kept

    mm = MoveModel(cap, nodes, everyone, release=True, restrict=restrict)
    m = mm.model
    # a GPU-less pod has no rows to restrict: keep it off the nodes it may not use (a moved
    # one may stay on its own)
    for (i, n), yv in mm.y_vars.items():
        mask = masks[i]
        if everyone[i].demand.gpu_count or mask is None or mask[n]:
            continue
        if i == 0 or n != everyone[i].node:
            m.add(yv == 0)
    moves = sum(mm.placed[1:]) if len(mm.placed) > 1 else 0
    if limit < INF:
        m.add(moves <= limit)
    # a valid cut: the pod on node n needs at least bounds[n] moves
    cut = [(int(bounds[n]), yv) for (i, n), yv in mm.y.items() if i == 0 and 0 < bounds[n] < INF]
    if cut and not isinstance(moves, int):
        m.add(sum(b * yv for b, yv in cut) <= moves)
    prios = sorted({mv.demand.priority for mv in movers})
    rank = {p: r for r, p in enumerate(prios)}
    priority: cp_model.LinearExprT | int = (
        sum(rank[mv.demand.priority] * mm.placed[i] for i, mv in enumerate(everyone) if i)
        if len(prios) > 1
        else 0
    )
    idle = a.used_replicas == 0
    opened_terms = [v for (i, r), v in mm.x.items() if idle[r]]
    opened: cp_model.LinearExprT | int = sum(opened_terms) if opened_terms else 0
    stages = [
        Stage("moves", moves, share=0.7, least=0.02),
        Stage("priority", priority, share=0.5, least=0.01, skip_below=0.01),
        Stage("opened", opened, share=1.0, least=0.01, skip_below=0.01),
    ]
    if isinstance(moves, int):
        stages[0] = Stage("moves", 0)
    result = staged_solve(
        m,
        stages,
        deadline,
        variables=mm.decisions(),
        settings=Settings(num_workers=num_workers, random_seed=0, light_presolve=True),
    )
    first = result.stages[0] if result.stages else None
    status = first.status if first is not None else result.status
    if status == "CONSTANT":
        status = "OPTIMAL" if result.values is not None else result.status
    if result.values is None:
        return None, status
    plan = read_back(cap, pod, mm, result.values)
    return plan, status if plan is not None else "READBACK_INVALID"


def read_back(
    cap: Capacity, pod: Demand, mm: MoveModel, values: Mapping[int, int]
) -> RepackPlan | None:
    landing = mm.landing(values, 0)
    if landing is None:
        return None
    placement = reservation_for(cap, pod, landing[0], landing[1])
    moves: list[Move] = []
    for i in range(1, len(mm.movers)):
        to = mm.landing(values, i)
        if to is None or mm.stays(i, to):
            continue
        mv = mm.movers[i]
        source = source_of(cap, mv)
        target = reservation_for(cap, mv.demand, to[0], to[1])
        moves.append(Move(mv.demand.pod, mv.demand, source, target))
    moves.sort(key=lambda m: m.pod.key)
    plan = RepackPlan(pod, placement, tuple(moves), "", False, 0.0)
    return plan if final_state_fits(cap, plan) else None
