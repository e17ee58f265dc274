"""Repacking by migration: the fewest moves of running pods that make a blocked pod fit.

A pod that fits nowhere only because free VRAM (or CPU, or memory) is scattered can often be
placed after a few running pods move elsewhere. This module finds the fewest such moves, every
moved pod re-placed in the same plan, and applies a plan to a `Capacity` through the ledger.

API (pure: no I/O, no await; the simulator and `vramsched serve --repack` call it):

- `plan_repack(cap, pod, running, *, movable=None, max_moves=None, time_limit=1.0,
  num_workers=2, place_rule=None, frag=None) -> RepackPlan | None`: `cap` is the cluster now,
  `pod` the blocked pod's `Demand`, `running` every running pod as `(Demand, Reservation)` (a
  GPU-less pod: a `Reservation` with no devices, naming its node). `movable(demand)` says which
  may move (default: all); a running pod the ledger does not hold exactly there never moves.
  At most `max_moves` moves (None: no cap). `place_rule` (one of `greedy.POLICIES`, with the
  `frag` it reads) is where a moved pod lands and where the pod goes when it fits without
  moves (default: best fit, `Rule`). None when no plan was found; `search_repack` says whether
  that is proven. `cap` is changed during the search and restored before it returns.
- `search_repack(...)` (same arguments, plus `neighbourhood`) -> `RepackSearch`: the plan or
  None, whether the answer is proven (a plan: its move count is the fewest possible; None: no
  plan within `max_moves` exists), the reason, the lower bound on moves, and the model's size.
- `apply_plan(cap, plan)`: releases every moved pod, then reserves each at its target and the
  pod at its placement, through `Capacity.apply` (`Ledger.reserve`: atomic check-and-set) with
  a CPU/memory check; on any refusal everything is rolled back and `LedgerError` is raised.
- `RepackPlan`: `pod`, `placement` (the pod's `Reservation`), `moves` (`Move`: `pod`,
  `demand`, `source` and `target` `Reservation`s), `status` (FITS: no move needed; GREEDY: the
  greedy plan; else CP-SAT's status of the moves goal), `optimal` (the move count is proven
  minimal), `seconds`.
- `final_state_fits(cap, plan)`: the check every plan passes before it is returned.

What a plan guarantees: the *final state* (moved pods gone from their sources, placed at their
targets, the pod placed) never overcommits GPU memory, replicas, node CPU or node memory; a
multi-GPU pod takes k distinct devices of one node; every pod keeps its resource and allowed
products. Intermediate states are not checked: the executor must evict every moved pod before
placing any (`apply_plan` follows that order).

How it searches (`Neighbourhood` holds the sizes):
1. If the pod fits now: a plan with no moves, placed by the rule.
2. A lower bound per node on the moves it needs: per device, the fewest movable pods whose
   memory (largest first) frees enough and a replica; per node, the cheapest k devices (the
   k-th cheapest when a multi-GPU pod could free several at once), and the fewest movable pods
   freeing the CPU and memory short (largest first); the maximum of the three. Nodes whose bound
   exceeds `max_moves` are out; if none is left, no plan exists (proven).
3. A greedy plan (`_Greedy`) on the `greedy_nodes` nodes of lowest bound: evict what the pod
   needs there, place it, re-place every evicted pod by the rule; an evicted pod with no place
   may push one more pod out of its way (`chain`). A plan whose move count equals the lowest
   bound of any node is optimal whatever the neighbourhood, and is returned. Pods that
   `dominates` the pod are left out of this step (moving one only to put the pod in its place
   is a swap), not out of the bound nor the exact model.
4. CP-SAT (`staged.staged_solve`) for fewer moves than the greedy plan: a small cluster (up to
   `exact_nodes` nodes, and movable pods up to `exact_movers_per_second` per second of the time
   limit: `Neighbourhood.whole`) is modelled whole, so the fewest moves is exact when CP-SAT
   proves it; otherwise rounds of `nodes` candidate nodes for the pod, every movable pod on them
   free to land on those nodes or on the `destinations` best-fitting nodes with room for its
   kind. Only the whole model finds plans whose moves form a cycle through nodes where no mover
   fits now, which is what a full cluster of mixed pools needs (on `make bench-llm-mixed`: a
   28 GiB model leaves a time-sliced A100 for an exclusive H100, the whole-GPU pod there takes
   an MPS share, and the 9 GiB model in that share takes the time-sliced GPU beside the blocked
   pod). A small cluster with more movers than `whole` allows is first modelled whole by counts
   of one-GPU pods per kind and device (`repack_counts`, `counts_share` of the time left), before
   the neighbourhood rounds. Goals in order: fewest moves; then the lowest-priority pods moved;
   then fewest moved pods landing on an idle GPU. The variables and capacity rules are
   `move_model.MoveModel`'s (final-state sense), shared with `defrag`.

The steps live in `repack_pool` (the running pods, the bounds, the greedy plan), `repack_model`
(the CP-SAT round: model, solve, read-back), `repack_counts` (the same by counts, for a small
cluster) and `repack_plan` (the plan, its check, the rule);
this module holds the API and the search that runs them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from extender.demand import Demand
from extender.ledger import LedgerError, Reservation
from extender.planner import clock
from extender.planner.capacity import Capacity, FragIndex
from extender.planner.repack_counts import solve_counts
from extender.planner.repack_model import destinations, solve_round
from extender.planner.repack_plan import Move, RepackPlan, Rule, TargetNodes, final_state_fits
from extender.planner.repack_pool import (
    INF,
    Movable,
    Pool,
    dominates,
    greedy_best,
    move_lower_bounds,
    needs_gpu_movers,
    node_bounds,
)

__all__ = [
    "Move",
    "RepackPlan",
    "RepackSearch",
    "Neighbourhood",
    "Rule",
    "plan_repack",
    "search_repack",
    "apply_plan",
    "final_state_fits",
    "move_lower_bounds",
    "dominates",
]


@dataclass(frozen=True)
class RepackSearch:
    """What `search_repack` found: the plan (None: none found) and whether that is proven."""

    plan: RepackPlan | None
    proven: bool
    status: str
    reason: str
    #: fewest moves any plan needs (the lowest per-node bound); INF when no node could ever hold it
    lower_bound: int
    nodes: int = 0
    movers: int = 0
    rounds: int = 0
    seconds: float = 0.0


@dataclass(frozen=True)
class Neighbourhood:
    """How much of the cluster one search models (see the module docstring)."""

    #: nodes the greedy plan is tried on, lowest bound first, and how long a chain of moves it
    #: may make to re-place a pod it moved (1: a moved pod may move one more)
    greedy_nodes: int = 32
    chain: int = 1
    #: the greedy plans stop at this share of the time limit (CP-SAT gets the rest)
    greedy_share: float = 0.6
    #: candidate nodes for the pod per CP-SAT round, and rounds
    nodes: int = 4
    rounds: int = 2
    #: destination nodes per kind of mover, and in all
    destinations: int = 6
    max_destinations: int = 32
    #: a cluster up to this size is modelled whole (`whole`)
    exact_nodes: int = 24
    exact_movers_per_second: int = 96
    #: no CP-SAT round starts with less time than this left
    least_solve: float = 0.05
    #: a small cluster with too many movers for `whole`: the share of the time left given to
    #: the model by counts (`repack_counts`) before the neighbourhood rounds
    counts_share: float = 0.7

    def whole(self, nodes: int, movers: int, time_limit: float) -> bool:
        """Model the whole cluster? Up to `exact_nodes` nodes, and a number of movable pods that
        grows with the time limit. Why: the whole model's size is movers x devices; on 18 nodes of
        mixed pools (`make bench-llm-mixed`) it took 0.6 s to build for 250 movers, and CP-SAT
        about 3 s more to find its 2-4-move plans, so a search of 1 s cannot use it there while
        one of 5 s can."""
        return nodes <= self.exact_nodes and movers <= self.exact_movers_per_second * time_limit


def plan_repack(
    cap: Capacity,
    pod: Demand,
    running: Sequence[tuple[Demand, Reservation]],
    *,
    movable: Movable | None = None,
    max_moves: int | None = None,
    time_limit: float = 1.0,
    num_workers: int = 2,
    place_rule: str | None = None,
    frag: FragIndex | None = None,
    pod_nodes: np.ndarray | None = None,
    target_nodes: TargetNodes | None = None,
) -> RepackPlan | None:
    """The fewest moves that make `pod` fit (see the module docstring), or None."""
    return search_repack(
        cap,
        pod,
        running,
        movable=movable,
        max_moves=max_moves,
        time_limit=time_limit,
        num_workers=num_workers,
        place_rule=place_rule,
        frag=frag,
        pod_nodes=pod_nodes,
        target_nodes=target_nodes,
    ).plan


def search_repack(
    cap: Capacity,
    pod: Demand,
    running: Sequence[tuple[Demand, Reservation]],
    *,
    movable: Movable | None = None,
    max_moves: int | None = None,
    time_limit: float = 1.0,
    num_workers: int = 2,
    neighbourhood: Neighbourhood = Neighbourhood(),
    place_rule: str | None = None,
    frag: FragIndex | None = None,
    pod_nodes: np.ndarray | None = None,
    target_nodes: TargetNodes | None = None,
) -> RepackSearch:
    """`pod_nodes`: per node row, whether the pod may go there (None: every node).
    `target_nodes(demand)`: the same for each moved pod's new place (a pod that stays keeps its
    node)."""
    start = clock.now()
    deadline = start + time_limit
    rule = Rule(place_rule, frag, target_nodes)
    now = rule.choose(cap, pod)
    if now is not None and (pod_nodes is None or _allows(cap, pod_nodes, now.node)):
        plan = RepackPlan(pod, now, (), "FITS", True, clock.now() - start)
        return RepackSearch(plan, True, "FITS", "fits without moves", 0, seconds=plan.seconds)
    # below INF even without a cap: a node the pod may not use (`pod_nodes`) is ranked INF
    limit = INF - 1 if max_moves is None else max(0, max_moves)
    pool = Pool(cap, pod, running, movable)
    everyone = np.ones(len(pool), bool)
    valid = node_bounds(cap, pod, pool, everyone)
    if pod_nodes is not None:
        valid = (np.where(pod_nodes, valid[0], INF), valid[1], valid[2])
    bounds = valid[0]
    lowest = int(bounds.min(initial=INF))
    if lowest >= INF or lowest > limit:
        why = (
            "fits on no node even if every movable pod left"
            if lowest >= INF
            else f"every node needs at least {lowest} moves"
        )
        return _none(True, "INFEASIBLE", why, lowest, start)
    # pods asking at least what the pod asks are left out of the ranking, the greedy plans and
    # the neighbourhoods (moving one only to put the pod in its place is a pointless swap), but
    # not out of the bound nor the exact model: with other moves around, such a move can count
    keep = ~pool.dominating(pod)
    rank, held, cost = node_bounds(cap, pod, pool, keep) if not keep.all() else valid
    if pod_nodes is not None:
        rank = np.where(pod_nodes, rank, INF)
    hard = needs_gpu_movers(cap, pod, pool, keep, rank)
    ranked = [int(n) for n in np.lexsort((held, hard, rank)) if rank[n] <= limit]
    nh = neighbourhood
    greedy_until = start + nh.greedy_share * time_limit
    best = greedy_best(
        cap,
        pod,
        pool,
        keep,
        ranked[: nh.greedy_nodes],
        rank,
        cost,
        limit,
        nh.chain,
        greedy_until,
        rule,
    )
    if best is not None and len(best.moves) <= lowest:
        return _found(best, "GREEDY", True, lowest, start, 0, 0, 0)
    a = cap.arrays
    exact = nh.whole(len(a.node_names), len(pool), time_limit)
    if exact:
        hard = needs_gpu_movers(cap, pod, pool, everyone, bounds)
        ranked = [int(n) for n in np.lexsort((valid[1], hard, bounds)) if bounds[n] <= limit]
    rounds: list[list[int]] = (
        [ranked]
        if exact
        else [ranked[i : i + nh.nodes] for i in range(0, len(ranked), nh.nodes)][: nh.rounds]
    )
    # CP-SAT looks for a plan better than the greedy one (or any plan, when there is none)
    better = limit if best is None else min(limit, len(best.moves) - 1)
    if not exact and len(a.node_names) <= nh.exact_nodes and better >= 1:
        # too many movers for the whole per-pod model in time: the whole cluster by counts
        t = clock.now()
        until = t + nh.counts_share * (deadline - t)
        counted, status = solve_counts(cap, pod, pool, better, until, num_workers)
        if counted is not None and _keeps_to(cap, counted, pod_nodes, target_nodes):
            optimal = len(counted.moves) <= lowest
            return _found(counted, status, optimal, lowest, start, len(a.node_names), len(pool), 1)
    status, n_nodes, n_movers = "UNKNOWN", 0, 0
    for done, chosen in enumerate(rounds, start=1):
        chosen = [n for n in chosen if bounds[n] <= better]
        if not chosen or clock.now() >= deadline - nh.least_solve:
            break
        if exact:
            nodes = list(range(len(a.node_names)))
            active = [pool.mover(j) for j in range(len(pool))]
        else:
            on = set(chosen)
            active = [pool.mover(j) for n in chosen for j in pool.on_node(n, keep)]
            nodes = sorted(on | destinations(cap, active, on, nh.destinations, nh.max_destinations))
        n_nodes, n_movers = len(nodes), len(active)
        found, status = solve_round(
            cap, pod, active, nodes, chosen, bounds, better, deadline, num_workers, target_nodes
        )
        if found is not None:
            optimal = len(found.moves) <= lowest or (exact and status == "OPTIMAL")
            return _found(found, status, optimal, lowest, start, n_nodes, n_movers, done)
        if exact and status == "INFEASIBLE":
            if best is not None:  # nothing better than the greedy plan exists: it is optimal
                return _found(best, "GREEDY", True, lowest, start, n_nodes, n_movers, done)
            why = f"no plan within {max_moves} moves" if max_moves is not None else "no plan"
            return _none(True, status, why, lowest, start, n_nodes, n_movers, done)
    if best is not None:
        return _found(best, "GREEDY", False, lowest, start, n_nodes, n_movers, len(rounds))
    why = "no plan found in the neighbourhood searched"
    return _none(False, status, why, lowest, start, n_nodes, n_movers, len(rounds))


def _allows(cap: Capacity, pod_nodes: np.ndarray, node: str) -> bool:
    row = cap.ledger.node_row(node)
    return row is not None and bool(pod_nodes[row])


def _keeps_to(
    cap: Capacity,
    plan: RepackPlan,
    pod_nodes: np.ndarray | None,
    target_nodes: TargetNodes | None,
) -> bool:
    """Whether the plan puts the pod and every moved pod only where they may go (the count
    model knows pods by kind, not which nodes each may use: its plan is checked after)."""
    if pod_nodes is not None and not _allows(cap, pod_nodes, plan.placement.node):
        return False
    if target_nodes is None:
        return True
    for m in plan.moves:
        mask = target_nodes(m.demand)
        if mask is not None and not _allows(cap, mask, m.target.node):
            return False
    return True


def _found(
    plan: RepackPlan,
    status: str,
    optimal: bool,
    lowest: int,
    start: float,
    nodes: int,
    movers: int,
    rounds: int,
) -> RepackSearch:
    seconds = clock.now() - start
    plan = RepackPlan(plan.pod, plan.placement, plan.moves, status, optimal, seconds)
    why = f"{len(plan.moves)} moves" + (" (fewest possible)" if optimal else "")
    return RepackSearch(plan, optimal, status, why, lowest, nodes, movers, rounds, seconds)


def _none(
    proven: bool,
    status: str,
    reason: str,
    lowest: int,
    start: float,
    nodes: int = 0,
    movers: int = 0,
    rounds: int = 0,
) -> RepackSearch:
    return RepackSearch(
        None, proven, status, reason, lowest, nodes, movers, rounds, clock.now() - start
    )


def apply_plan(cap: Capacity, plan: RepackPlan) -> None:
    """Carry the plan out on `cap`: release every moved pod, then reserve each at its target and
    the pod at its placement (`Ledger.reserve`, plus a CPU/memory check per node). All or
    nothing: on a refusal the capacity is restored and `LedgerError` says why."""
    ledger = cap.ledger

    def row_of(res: Reservation) -> int:
        n = ledger.node_row(res.node)
        if n is None:
            raise LedgerError(f"node {res.node} is not known")
        return n

    for mv in plan.moves:
        held = ledger.reservation(mv.pod.key)
        if mv.source.device_ids and (held is None or not held.same_placement(mv.source)):
            raise LedgerError(f"pod {mv.pod.key} no longer holds {mv.source.node} as planned")
        row_of(mv.source)
        row_of(mv.target)
    row_of(plan.placement)
    removed: list[Move] = []
    placed: list[tuple[Demand, int]] = []
    try:
        for mv in plan.moves:
            cap.remove(mv.demand, row_of(mv.source))
            removed.append(mv)
        for d, res in [*((mv.demand, mv.target) for mv in plan.moves), (plan.pod, plan.placement)]:
            n = row_of(res)
            if cap.cpu_free[n] < d.cpu_milli or cap.mem_free[n] < d.memory_bytes:
                raise LedgerError(f"node {res.node} has not enough CPU or memory for {d.pod.key}")
            cap.apply(d, res if res.device_ids else None, n)
            placed.append((d, n))
    except LedgerError:
        for d, n in reversed(placed):
            cap.remove(d, n)
        for mv in reversed(removed):
            cap.apply(mv.demand, mv.source if mv.source.device_ids else None, row_of(mv.source))
        raise
