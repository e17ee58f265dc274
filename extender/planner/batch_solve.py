"""Solving a batch model: exactly, over a candidate subset, or by large-neighbourhood search.

- `solve_exact`: the model's two goals as `staged` stages (pods left out; then stranded VRAM,
  GPUs opened, nodes touched), from the greedy plan as the hint. Half the time limit is kept for
  the second stage.
- `solve_small`: a few pods on a cluster of many distinct nodes: the exact model over each pod's
  best candidate nodes; the first goal's bound comes from the class relaxation of the whole cluster.
- `solve_large`: a batch too large for one exact model: rounds that free the pods planned on a
  neighbourhood of at most MAX_COPIES nodes and re-plan them exactly with everything else fixed.

Each returns a `Solved`: the plan (or None), per stage what was found and proven, and the exact
goals (`batch_goals.evaluate`) of the plan and of the greedy plan it started from.
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from extender.demand import Demand
from extender.planner import clock
from extender.planner.batch_bounds import opened_bound, relaxation_bound
from extender.planner.batch_goals import Cost, device_rows, evaluate
from extender.planner.batch_layout import MAX_COPIES, BatchLayout, layout
from extender.planner.batch_model import (
    BatchModel,
    build_model,
    decisions,
    hints,
    plan_hint,
    stranded_goal,
)
from extender.planner.batch_readback import read_back
from extender.planner.capacity import Capacity, candidates
from extender.planner.greedy import Choice, place_one
from extender.planner.staged import Settings, Stage, StageOutcome, staged_solve

__all__ = ["Solved", "neighbourhood", "solve_exact", "solve_large", "solve_small"]

_TOP_K = 6
#: the search stops early after this many rounds in a row without a better plan.
_LNS_PATIENCE = 4


@dataclass(frozen=True)
class Solved:
    """A solve's plan (None: no solution), its stages, its overall status and the exact goals of
    the plan and of the greedy plan it started from. `rounds`: candidate nodes (subset) or search
    rounds; `accepted`: rounds kept; `opened_bound`: the fewest empty GPUs a plan placing every
    pod must open, when the search proved it."""

    choices: dict[int, Choice] | None
    stages: tuple[StageOutcome, ...]
    status: str
    cost: Cost
    greedy_cost: Cost
    rounds: int = 0
    accepted: int = 0
    opened_bound: int | None = None


def solve_exact(bm: BatchModel, time_limit: float, num_workers: int) -> Solved:
    """Both goals on the built model within `time_limit`, starting from the layout's greedy plan.
    A restricted layout's first bound comes from the class relaxation of the whole cluster."""
    lay = bm.layout
    t0 = clock.now()
    start = plan_hint(bm)
    if start is not None:
        bm.model.clear_hints()
        for var, value in hints(bm, start):
            bm.model.add_hint(var, value)
    greedy_cost = evaluate(lay.cap, lay.demands, lay.greedy, lay.frag)

    def whole_cluster(bound: float) -> float:
        # the restricted model's bound says nothing about nodes left out: use the class relaxation
        relax = relaxation_bound(lay, min(0.2, max(0.02, time_limit * 0.15)), num_workers)
        return min(bound, relax) if relax is not None else float("-inf")

    result = staged_solve(
        bm.model,
        [
            Stage(
                "placed",
                bm.unplaced,
                keep=0.5 * time_limit,
                least=0.02,
                rebound=whole_cluster if lay.restricted else None,
            ),
            # keep the first goal's value, minimise stranded VRAM then GPUs opened, nodes touched
            Stage("stranded", lambda: stranded_goal(bm), least=0.02, skip_below=0.05),
        ],
        t0 + time_limit,
        variables=decisions(bm),
        settings=Settings(num_workers, light_presolve=True),
        hint=lambda values: hints(bm, values),
    )
    first = result.stages[0]
    if not first.solved or result.values is None:
        return Solved(None, (), first.status, greedy_cost, greedy_cost)
    second = result.outcome("stranded")
    proven = (
        second is not None
        and first.status == "OPTIMAL"
        and second.status == "OPTIMAL"
        and not lay.restricted
    )
    choices = read_back(bm, result.values)
    cost = evaluate(lay.cap, lay.demands, choices, lay.frag)
    stages = tuple(s for s in result.stages if s.solved)
    return Solved(choices, stages, "OPTIMAL" if proven else "FEASIBLE", cost, greedy_cost)


def solve_large(lay: BatchLayout, time_limit: float, num_workers: int) -> Solved:
    """A batch too large for one exact model within the time limit: large-neighbourhood search.

    Each round frees the pods planned on a neighbourhood of at most MAX_COPIES nodes (nodes where
    the plan opened GPUs, partly used nodes with room, a few idle nodes) and re-plans them exactly
    with everything else fixed; a round is kept only if the whole plan gets better. The proven
    bound comes from the class relaxation of the whole batch on the whole cluster.
    """
    cap, demands, frag = lay.cap, lay.demands, lay.frag
    t0 = clock.now()
    # the relaxation is small: give it its own short budget even when the greedy plan used the rest
    # one relaxation bounds W * unplaced + opened: pods left out, and GPUs that must be opened
    W = len(cap.arrays.capacity) + 1
    relax = relaxation_bound(lay, max(0.1, min(0.25, time_limit * 0.2)), num_workers, W)
    current = dict(lay.greedy)
    greedy_cost = evaluate(cap, demands, current, frag)
    cost = greedy_cost
    rounds = accepted = 0
    rng = np.random.default_rng(len(demands))
    idle_rounds = 0
    while clock.now() - t0 < time_limit - 0.08 and idle_rounds < _LNS_PATIENCE:
        rounds += 1
        idle_rounds += 1
        subset = neighbourhood(cap, demands, current, lay, rng)
        inside = [i for i in range(len(demands)) if i not in current or current[i][1] in subset]
        fixed = {i: ch for i, ch in current.items() if ch[1] not in subset}
        done = []
        try:
            for i, ch in fixed.items():
                place_one(cap, demands[i], ch, None)
                done.append((demands[i], ch[1]))
            sub = [demands[i] for i in inside]
            sub_greedy = {j: current[i] for j, i in enumerate(inside) if i in current}
            sub_lay = layout(cap, sub, frag, sub_greedy, node_subset=subset)
            bm = None if sub_lay.empty else build_model(sub_lay)
            left = time_limit - (clock.now() - t0) - 0.05
            res = (
                solve_exact(bm, max(0.05, min(left, time_limit / 3)), num_workers)
                if bm is not None and left > 0.05
                else None
            )
        finally:
            for d, n in reversed(done):
                cap.remove(d, n)
        if res is None or res.choices is None or not res.cost < res.greedy_cost:
            continue
        trial = dict(fixed)
        trial.update({inside[j]: ch for j, ch in res.choices.items()})
        c = evaluate(cap, demands, trial, frag)
        if c < cost:
            current, cost = trial, c
            accepted += 1
            idle_rounds = 0
    obj = cost[0]
    bound = float(max(0, math.ceil((relax - (W - 1)) / W))) if relax is not None else float("-inf")
    if obj == 0:
        bound = 0.0  # every pod placed: nothing can be better
    stage = StageOutcome(
        "placed",
        "OPTIMAL" if bound >= obj else "FEASIBLE",
        float(obj),
        float(bound),
        seconds=clock.now() - t0,
    )
    # stage 2 (stranded VRAM, nodes touched) is only improved by the search here, never proven;
    # what is proven is how many empty GPUs any plan placing these pods must open
    return Solved(
        current,
        (stage,),
        "FEASIBLE",
        cost,
        greedy_cost,
        rounds,
        accepted,
        opened_bound(relax, W) if obj == 0 else None,
    )


def solve_small(lay: BatchLayout, time_limit: float, num_workers: int) -> Solved:
    """A few pods on a cluster of many distinct nodes: the exact model over each pod's best
    `_TOP_K` candidate nodes by vramsched's rule (and their identical twins) plus the greedy plan's
    nodes. The stage 1 bound still comes from the class relaxation of the whole cluster."""
    cap, demands, frag, greedy = lay.cap, lay.demands, lay.frag, lay.greedy
    t0 = clock.now()
    a = cap.arrays
    sig = cap.signatures()
    subset = {ch[1] for ch in greedy.values()}
    by_sig: dict[int, list[int]] = defaultdict(list)
    for n in lay.cand_nodes.tolist():
        by_sig[int(sig[n])].append(n)
    for pc in lay.classes:
        c = candidates(cap, pc.demand)
        if len(c) == 0:
            continue
        d = np.round(frag.delta(c, pc.demand), 6)
        order = np.lexsort((c.node, c.opened(a), d))
        picked: list[int] = []
        for j in order.tolist():
            n = int(c.node[j])
            if n not in picked:
                picked.append(n)
            if len(picked) >= _TOP_K:
                break
        for n in picked:
            subset.update(by_sig[int(sig[n])][: len(pc.members)])
    sub_lay = layout(cap, demands, frag, greedy, node_subset=subset)
    if sub_lay.empty:
        gc = evaluate(cap, demands, greedy, frag)
        return Solved(None, (), "GREEDY", gc, gc, len(subset))
    bm = build_model(sub_lay)
    res = solve_exact(bm, max(0.05, time_limit - (clock.now() - t0) - 0.05), num_workers)
    if not res.stages:
        return dataclasses.replace(res, rounds=len(subset))
    st = res.stages[0]
    if st.objective == 0:
        bound = 0.0  # every pod placed: nothing can be better
    else:
        relax = relaxation_bound(lay, max(0.05, min(0.1, time_limit * 0.1)), num_workers)
        bound = min(st.bound, relax) if relax is not None else float("-inf")
    stages = [
        dataclasses.replace(
            st, status="OPTIMAL" if bound >= st.objective else "FEASIBLE", bound=bound
        )
    ]
    for s2 in res.stages[1:]:
        # the second goal is proven only over the candidate subset
        stages.append(
            dataclasses.replace(s2, status="OPTIMAL_IN_SUBSET") if s2.status == "OPTIMAL" else s2
        )
    return dataclasses.replace(res, stages=tuple(stages), status="FEASIBLE", rounds=len(subset))


def neighbourhood(
    cap: Capacity,
    demands: Sequence[Demand],
    plan: dict[int, Choice],
    lay: BatchLayout,
    rng: np.random.Generator,
) -> set[int]:
    """Node rows for one search round: nodes where the plan opened GPUs, partly used nodes with
    room, the plan's other nodes and a few idle ones, at most MAX_COPIES in all."""
    a = cap.arrays
    budget = MAX_COPIES
    opened_nodes: dict[int, int] = defaultdict(int)
    plan_nodes = {ch[1] for ch in plan.values()}
    for ch in plan.values():
        for g in device_rows(a, ch):
            if a.used_replicas[g] == 0:
                opened_nodes[ch[1]] += 1
    cand = set(lay.cand_nodes.tolist())
    part = [
        n
        for n in cand
        if n not in plan_nodes
        and (
            (a.used_replicas[a.node_start[n] : a.node_start[n + 1]] > 0)
            & (
                a.capacity[a.node_start[n] : a.node_start[n + 1]]
                > a.used[a.node_start[n] : a.node_start[n + 1]]
            )
        ).any()
    ]
    idle = [n for n in cand if n not in plan_nodes and n not in set(part)]
    pick: list[int] = []
    on = list(opened_nodes)
    rng.shuffle(on)
    pick += on[: budget // 2]
    rng.shuffle(part)
    pick += part[: budget // 4]
    rest = [n for n in plan_nodes if n not in set(pick)]
    rng.shuffle(rest)
    pick += rest[: max(0, budget - len(pick) - 4)]
    rng.shuffle(idle)
    pick += idle[:4]
    return set(pick[:budget])
