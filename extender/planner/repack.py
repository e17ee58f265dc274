"""Repacking by migration: the fewest moves of running pods that make a blocked pod fit.

A pod that fits nowhere only because free VRAM (or CPU, or memory) is scattered can often be
placed after a few running pods move elsewhere. This module finds the fewest such moves, every
moved pod re-placed in the same plan, and applies a plan to a `Capacity` through the ledger.

API (pure: no I/O, no await; the simulator and `vramsched serve --repack` call it):

- `plan_repack(cap, pod, running, *, movable=None, max_moves=None, time_limit=1.0,
  num_workers=2) -> RepackPlan | None`: `cap` is the cluster now, `pod` the blocked pod's
  `Demand`, `running` every running pod as `(Demand, Reservation)` (a GPU-less pod: a
  `Reservation` with no devices, naming its node). `movable(demand)` says which may move
  (default: all); a running pod the ledger does not hold exactly there never moves. At most
  `max_moves` moves (None: no cap). None when no plan was found; `search_repack` says whether
  that is proven.
- `search_repack(...)` (same arguments, plus `neighbourhood`) -> `RepackSearch`: the plan or
  None, whether the answer is proven (a plan: its move count is the fewest possible; None: no
  plan within `max_moves` exists), the reason, the lower bound on moves, and the model's size.
- `apply_plan(cap, plan)`: releases every moved pod, then reserves each at its target and the
  pod at its placement, through `Capacity.apply` (`Ledger.reserve`: atomic check-and-set) with
  a CPU/memory check; on any refusal everything is rolled back and `LedgerError` is raised.
- `RepackPlan`: `pod`, `placement` (the pod's `Reservation`), `moves` (`Move`: `pod`,
  `demand`, `source` and `target` `Reservation`s), `status` (CP-SAT's status of the moves
  goal, or FITS when the pod fits without moves), `optimal` (the move count is proven
  minimal), `seconds`.

What a plan guarantees: the *final state* (moved pods gone from their sources, placed at their
targets, the pod placed) never overcommits GPU memory, replicas, node CPU or node memory; a
multi-GPU pod takes k distinct devices of one node; every pod keeps its resource and allowed
products. Intermediate states are not checked: the executor must evict every moved pod before
placing any (the plan is verified against the ledger before it is returned, and `apply_plan`
follows that order).

How it searches (`Neighbourhood`):
1. If the pod fits now: a plan with no moves (the best fit: least memory left on its devices).
2. A lower bound per node on the moves it needs: per device, the fewest movable pods whose
   memory (largest first) frees enough and a replica; per node, the cheapest k devices (the
   k-th cheapest when a multi-GPU pod could free several at once), and the fewest movable pods
   freeing the CPU and memory short (largest first); the maximum of the three. Nodes whose bound
   exceeds `max_moves` are out; if none is left, no plan exists (proven).
3. A small cluster (up to `exact_nodes` nodes and `exact_movers` movable pods) is modelled whole
   in one CP-SAT model, so the fewest moves is exact when CP-SAT proves it. Otherwise, rounds:
   the `nodes` nodes with the lowest bound are candidates for the pod, every movable pod on
   them may move, and each may land on those nodes or on the `destinations` best-fitting nodes
   with room for its kind (least memory left first). A plan whose move count equals the lowest
   bound of any node is optimal whatever the neighbourhood.
4. CP-SAT (`staged.staged_solve`), goals in order: fewest moves; then the lowest-priority pods
   moved; then fewest moved pods landing on an idle GPU. The variables and capacity rules are
   `move_model.MoveModel`'s (final-state sense), shared with `defrag`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from ortools.sat.python import cp_model

from extender.demand import Demand, PodRef
from extender.ledger import LedgerError, Reservation
from extender.planner.capacity import Capacity, candidates, demand_kind
from extender.planner.move_model import MoveModel, Mover, need_bytes, reservation_for
from extender.planner.staged import Settings, Stage, staged_solve

__all__ = [
    "Move",
    "RepackPlan",
    "RepackSearch",
    "Neighbourhood",
    "plan_repack",
    "search_repack",
    "apply_plan",
    "move_lower_bounds",
]

#: "no plan on this node": larger than any move count
INF = 1 << 30


@dataclass(frozen=True)
class Move:
    """One running pod moved: from `source` to `target` (a GPU-less pod: reservations with no
    devices, naming the nodes)."""

    pod: PodRef
    demand: Demand
    source: Reservation
    target: Reservation


@dataclass(frozen=True)
class RepackPlan:
    pod: Demand
    placement: Reservation
    moves: tuple[Move, ...]
    status: str
    optimal: bool
    seconds: float


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

    nodes: int = 4
    rounds: int = 2
    destinations: int = 6
    max_destinations: int = 32
    exact_nodes: int = 24
    exact_movers: int = 96


Movable = Callable[[Demand], bool]


def plan_repack(
    cap: Capacity,
    pod: Demand,
    running: Sequence[tuple[Demand, Reservation]],
    *,
    movable: Movable | None = None,
    max_moves: int | None = None,
    time_limit: float = 1.0,
    num_workers: int = 2,
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
) -> RepackSearch:
    start = time.perf_counter()
    deadline = start + time_limit
    now = _fits_now(cap, pod)
    if now is not None:
        plan = RepackPlan(pod, now, (), "FITS", True, time.perf_counter() - start)
        return RepackSearch(plan, True, "FITS", "fits without moves", 0, seconds=plan.seconds)
    limit = INF if max_moves is None else max(0, max_moves)
    movers = _movers(cap, pod, running, movable)
    bounds, held = _bounds(cap, pod, movers)
    lowest = int(bounds.min(initial=INF))
    if lowest >= INF or lowest > limit:
        why = (
            "fits on no node even if every movable pod left"
            if lowest >= INF
            else f"every node needs at least {lowest} moves"
        )
        return _none(True, "INFEASIBLE", why, lowest, start)
    ranked = [int(n) for n in np.lexsort((held, bounds)) if bounds[n] <= limit]
    a = cap.arrays
    nh = neighbourhood
    exact = len(a.node_names) <= nh.exact_nodes and len(movers) <= nh.exact_movers
    rounds: list[list[int]] = (
        [ranked]
        if exact
        else [ranked[i : i + nh.nodes] for i in range(0, len(ranked), nh.nodes)][: nh.rounds]
    )
    status, n_nodes, n_movers = "UNKNOWN", 0, 0
    for done, chosen in enumerate(rounds, start=1):
        if done > 1 and time.perf_counter() >= deadline:
            break
        if exact:
            nodes = list(range(len(a.node_names)))
            active = movers
        else:
            on = set(chosen)
            active = [m for m in movers if m.node in on]
            nodes = sorted(on | _destinations(cap, active, on, nh))
        n_nodes, n_movers = len(nodes), len(active)
        found, status = _solve_round(
            cap, pod, active, nodes, chosen, bounds, limit, deadline, num_workers
        )
        if found is not None:
            optimal = len(found.moves) <= lowest or (exact and status == "OPTIMAL")
            plan = RepackPlan(
                pod,
                found.placement,
                found.moves,
                status,
                optimal,
                time.perf_counter() - start,
            )
            why = f"{len(plan.moves)} moves" + (" (fewest possible)" if optimal else "")
            return RepackSearch(
                plan, optimal, status, why, lowest, n_nodes, n_movers, done, plan.seconds
            )
        if exact and status == "INFEASIBLE":
            return _none(
                True,
                status,
                f"no plan within {max_moves} moves" if max_moves is not None else "no plan",
                lowest,
                start,
                n_nodes,
                n_movers,
                done,
            )
    return _none(
        False,
        status,
        "no plan found in the neighbourhood searched",
        lowest,
        start,
        n_nodes,
        n_movers,
        len(rounds),
    )


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
        None, proven, status, reason, lowest, nodes, movers, rounds, time.perf_counter() - start
    )


def _fits_now(cap: Capacity, pod: Demand) -> Reservation | None:
    """The pod's best fit now (least memory left on its devices, then lowest node), or None."""
    c = candidates(cap, pod, dedupe=False)
    if len(c) == 0:
        return None
    a = cap.arrays
    best = int(np.lexsort((c.node, c.leftover(a)))[0])
    return reservation_for(cap, pod, int(c.node[best]), c.devices[best].tolist())


def _movers(
    cap: Capacity,
    pod: Demand,
    running: Sequence[tuple[Demand, Reservation]],
    movable: Movable | None,
) -> list[Mover]:
    """The running pods that may move, as the model's movers (the pod itself never; a pod whose
    reservation the ledger does not hold exactly never: moving it would give back memory that
    is not held)."""
    ledger = cap.ledger
    out: list[Mover] = []
    for d, res in running:
        if d.pod.key == pod.pod.key or (movable is not None and not movable(d)):
            continue
        n = ledger.node_row(res.node)
        if n is None:
            continue
        if res.device_ids:
            held = ledger.reservation(d.pod.key)
            if held is None or not held.same_placement(res):
                continue
            rows = [ledger.row(res.node, dev) for dev in res.device_ids]
            if any(r is None for r in rows):
                continue
            out.append(
                Mover(d, n, tuple(int(r) for r in rows if r is not None), res.bytes_per_device)
            )
        elif d.gpu_count == 0:
            out.append(Mover(d, n))
    return out


def _cover_counts(group: np.ndarray, value: np.ndarray, deficit: np.ndarray) -> np.ndarray:
    """Per group g, the fewest items of g whose values (largest first) sum to `deficit[g]`:
    0 when nothing is short, INF when all of them are not enough."""
    out = np.where(deficit <= 0, 0, INF).astype(np.int64)
    if len(group) == 0:
        return out
    order = np.lexsort((-value, group))
    g, v = group[order], value[order]
    cs = np.cumsum(v)
    starts = np.flatnonzero(np.r_[True, g[1:] != g[:-1]])
    start_of = np.repeat(starts, np.diff(np.r_[starts, len(g)]))
    within = cs - np.where(start_of > 0, cs[np.maximum(start_of - 1, 0)], 0)
    rank = np.arange(len(g)) - start_of + 1
    firsts = np.minimum.reduceat(np.where(within >= deficit[g], rank, INF), starts)
    gids = g[starts]
    out[gids] = np.where(deficit[gids] <= 0, 0, firsts)
    return out


def move_lower_bounds(cap: Capacity, pod: Demand, movers: Sequence[Mover]) -> np.ndarray:
    """Per node row, a lower bound on the moves any plan placing `pod` there needs (INF: it
    cannot go there whatever moves); see the module docstring."""
    return _bounds(cap, pod, movers)[0]


def _bounds(cap: Capacity, pod: Demand, movers: Sequence[Mover]) -> tuple[np.ndarray, np.ndarray]:
    """`move_lower_bounds`, and per node the memory held on the devices that bound counts
    (the cheapest ones): among nodes with the same bound, the one where less must move first."""
    a = cap.arrays
    n_nodes = len(a.node_names)
    moving = [m for m in movers if m.node is not None]
    node_of_mover = np.asarray([m.node for m in moving], np.int64)
    cpu = np.asarray([m.demand.cpu_milli for m in moving], np.int64)
    mem = np.asarray([m.demand.memory_bytes for m in moving], np.int64)
    host = np.maximum(
        _cover_counts(node_of_mover, cpu, pod.cpu_milli - cap.cpu_free),
        _cover_counts(node_of_mover, mem, pod.memory_bytes - cap.mem_free),
    )
    held = np.zeros(n_nodes, np.int64)
    k = pod.gpu_count
    if k == 0:
        return host, held
    need = need_bytes(cap, pod)
    ok = cap.matches(pod.resource, pod.allowed_products)
    ok &= (a.per_pod_cap >= need) & (a.capacity >= need) & (a.replicas >= 1)
    er = np.asarray([r for m in moving for r in m.rows], np.int64)
    eb = np.asarray([b for m in moving for b in m.held], np.int64)
    dev_bytes = _cover_counts(er, eb, need - (a.capacity - a.used))
    short_rep = 1 - (a.replicas - a.used_replicas).astype(np.int64)
    n_on = np.bincount(er, minlength=len(a.capacity)).astype(np.int64)
    dev_rep = np.where(short_rep <= 0, 0, np.where(n_on >= short_rep, short_rep, INF))
    cost = np.where(ok, np.maximum(dev_bytes, dev_rep), INF)
    used = a.used.astype(np.int64)
    gpu = np.full(n_nodes, INF, np.int64)
    if k == 1:
        order = np.lexsort((used, cost, a.node_of))  # per node: cheapest, then least used
        first = order[np.flatnonzero(np.r_[True, np.diff(a.node_of[order]) != 0])]
        gpu[a.node_of[first]] = cost[first]
        held[a.node_of[first]] = used[first]
    else:
        multi = {m.node for m in moving if len(m.rows) > 1}
        for n in np.flatnonzero(a.per_node_sum(cost < INF, np.int64) >= k).tolist():
            lo, hi = int(a.node_start[n]), int(a.node_start[n + 1])
            best = np.lexsort((used[lo:hi], cost[lo:hi]))[:k] + lo
            c = cost[best]
            gpu[n] = int(c[-1]) if n in multi else int(c.sum())
            held[n] = int(used[best].sum())
    out: np.ndarray = np.minimum(np.maximum(gpu, host), INF)
    return out, held


def _destinations(
    cap: Capacity, movers: Sequence[Mover], chosen: set[int], nh: Neighbourhood
) -> set[int]:
    """Nodes outside `chosen` where the movers could land now: per kind of mover, the
    `nh.destinations` nodes its best fits are on (least memory left first)."""
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
            if picked >= nh.destinations or len(out) >= nh.max_destinations:
                break
        if len(out) >= nh.max_destinations:
            break
    return out


def _solve_round(
    cap: Capacity,
    pod: Demand,
    movers: Sequence[Mover],
    nodes: Sequence[int],
    chosen: Sequence[int],
    bounds: np.ndarray,
    limit: int,
    deadline: float,
    num_workers: int,
) -> tuple[RepackPlan | None, str]:
    """One CP-SAT model: the pod on one of `chosen`, the movers anywhere in `nodes`."""
    a = cap.arrays
    allowed = np.zeros(len(a.node_names), bool)
    allowed[list(chosen)] = True
    everyone = [Mover(pod, required=True), *movers]

    def restrict(i: int, rows: np.ndarray) -> np.ndarray:
        if i:
            return np.ones(len(rows), bool)
        kept: np.ndarray = allowed[a.node_of[rows]]
        return kept

    mm = MoveModel(cap, nodes, everyone, release=True, restrict=restrict)
    m = mm.model
    if pod.gpu_count == 0:  # no rows to restrict: keep the pod off the nodes not chosen
        for (i, n), yv in mm.y_vars.items():
            if i == 0 and not allowed[n]:
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
    plan = _read_back(cap, pod, mm, result.values)
    return plan, status if plan is not None else "READBACK_INVALID"


def _read_back(
    cap: Capacity, pod: Demand, mm: MoveModel, values: Mapping[int, int]
) -> RepackPlan | None:
    landing = mm.landing(values, 0)
    if landing is None:
        return None
    placement = reservation_for(cap, pod, landing[0], landing[1])
    a = cap.arrays
    moves: list[Move] = []
    for i in range(1, len(mm.movers)):
        to = mm.landing(values, i)
        if to is None or mm.stays(i, to):
            continue
        mv = mm.movers[i]
        assert mv.node is not None
        source = Reservation(
            pod=mv.demand.pod,
            node=a.node_names[mv.node],
            device_ids=tuple(a.devices[r].device_id for r in mv.rows),
            bytes_per_device=mv.held,
            priority=mv.demand.priority,
            declared=mv.demand.bytes_per_gpu is not None,
        )
        target = reservation_for(cap, mv.demand, to[0], to[1])
        moves.append(Move(mv.demand.pod, mv.demand, source, target))
    moves.sort(key=lambda m: m.pod.key)
    plan = RepackPlan(pod, placement, tuple(moves), "", False, 0.0)
    return plan if final_state_fits(cap, plan) else None


def final_state_fits(cap: Capacity, plan: RepackPlan) -> bool:
    """Whether the plan's final state holds on `cap` (every moved pod gone from its source, at
    its target, the pod placed): memory and replicas of every device, CPU and memory of every
    node. The check `_read_back` makes before a plan leaves this module."""
    ledger, a = cap.ledger, cap.arrays
    used = a.used.astype(np.int64).copy()
    reps = a.used_replicas.astype(np.int64).copy()
    cpu, mem = cap.cpu_free.copy(), cap.mem_free.copy()
    touched_rows: set[int] = set()
    touched_nodes: set[int] = set()

    def shift(d: Demand, res: Reservation, sign: int) -> bool:
        n = ledger.node_row(res.node)
        if n is None:
            return False
        cpu[n] -= sign * d.cpu_milli
        mem[n] -= sign * d.memory_bytes
        if sign > 0:
            touched_nodes.add(n)
        for dev, b in zip(res.device_ids, res.bytes_per_device):
            r = ledger.row(res.node, dev)
            if r is None or (sign > 0 and b > a.per_pod_cap[r]):
                return False
            used[r] += sign * b
            reps[r] += sign
            if sign > 0:
                touched_rows.add(r)
        return True

    for mv in plan.moves:
        if not shift(mv.demand, mv.source, -1):
            return False
    for mv in plan.moves:
        if not shift(mv.demand, mv.target, +1):
            return False
    if not shift(plan.pod, plan.placement, +1):
        return False
    rows = np.asarray(sorted(touched_rows), np.int64)
    nodes = np.asarray(sorted(touched_nodes), np.int64)
    for d, res in [*((mv.demand, mv.target) for mv in plan.moves), (plan.pod, plan.placement)]:
        if len(set(res.device_ids)) != d.gpu_count:
            return False
    return bool(
        (used[rows] <= a.capacity[rows]).all()
        and (reps[rows] <= a.replicas[rows]).all()
        and (cpu[nodes] >= 0).all()
        and (mem[nodes] >= 0).all()
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
