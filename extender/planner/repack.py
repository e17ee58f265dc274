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
from functools import partial

import numpy as np
from ortools.sat.python import cp_model

from extender.demand import Demand, PodRef
from extender.ledger import LedgerError, Reservation
from extender.planner.capacity import Capacity, FragIndex, candidates, demand_kind
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
    "final_state_fits",
    "move_lower_bounds",
    "dominates",
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
    #: a cluster up to this size is modelled whole
    exact_nodes: int = 24
    exact_movers: int = 96
    #: no CP-SAT round starts with less time than this left
    least_solve: float = 0.05


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
    place_rule: str | None = None,
    frag: FragIndex | None = None,
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
) -> RepackSearch:
    start = time.perf_counter()
    deadline = start + time_limit
    rule = Rule(place_rule, frag)
    now = rule.choose(cap, pod)
    if now is not None:
        plan = RepackPlan(pod, now, (), "FITS", True, time.perf_counter() - start)
        return RepackSearch(plan, True, "FITS", "fits without moves", 0, seconds=plan.seconds)
    limit = INF if max_moves is None else max(0, max_moves)
    pool = _Pool(cap, pod, running, movable)
    everyone = np.ones(len(pool), bool)
    valid = _bounds(cap, pod, pool, everyone)
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
    rank, held, cost = _bounds(cap, pod, pool, keep) if not keep.all() else valid
    ranked = [int(n) for n in np.lexsort((held, rank)) if rank[n] <= limit]
    nh = neighbourhood
    greedy_until = start + nh.greedy_share * time_limit
    best = _greedy_best(
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
    exact = len(a.node_names) <= nh.exact_nodes and len(pool) <= nh.exact_movers
    if exact:
        ranked = [int(n) for n in np.lexsort((valid[1], bounds)) if bounds[n] <= limit]
    rounds: list[list[int]] = (
        [ranked]
        if exact
        else [ranked[i : i + nh.nodes] for i in range(0, len(ranked), nh.nodes)][: nh.rounds]
    )
    # CP-SAT looks for a plan better than the greedy one (or any plan, when there is none)
    better = limit if best is None else min(limit, len(best.moves) - 1)
    status, n_nodes, n_movers = "UNKNOWN", 0, 0
    for done, chosen in enumerate(rounds, start=1):
        chosen = [n for n in chosen if bounds[n] <= better]
        if not chosen or time.perf_counter() >= deadline - nh.least_solve:
            break
        if exact:
            nodes = list(range(len(a.node_names)))
            active = [pool.mover(j) for j in range(len(pool))]
        else:
            on = set(chosen)
            active = [pool.mover(j) for n in chosen for j in pool.on_node(n, keep)]
            nodes = sorted(on | _destinations(cap, active, on, nh))
        n_nodes, n_movers = len(nodes), len(active)
        found, status = _solve_round(
            cap, pod, active, nodes, chosen, bounds, better, deadline, num_workers
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
    seconds = time.perf_counter() - start
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
        None, proven, status, reason, lowest, nodes, movers, rounds, time.perf_counter() - start
    )


@dataclass(frozen=True)
class Rule:
    """Where a pod that fits goes (the pod when it fits without moves, a moved pod at its new
    place): by default its best fit (least memory left on its devices, then lowest node; a
    GPU-less pod: least CPU left); with `name`, one of `greedy.POLICIES` (the simulator passes
    the planner's, so moved pods land where the planner would put them), on `frag` kept
    current as the search changes the capacity and undoes it."""

    name: str | None = None
    frag: FragIndex | None = None

    def choose(self, cap: Capacity, d: Demand) -> Reservation | None:
        if self.name is not None:
            from extender.planner.greedy import choose

            ch = choose(self.name, cap, d, self.frag)
            if ch is None:
                return None
            res, n, _ = ch
            return res if res is not None else reservation_for(cap, d, n, ())
        c = candidates(cap, d)
        if len(c) == 0:
            return None
        key = c.leftover(cap.arrays) if d.gpu_count else cap.cpu_free[c.node]
        i = int(np.lexsort((c.node, key))[0])
        return reservation_for(cap, d, int(c.node[i]), c.devices[i].tolist())

    def apply(self, cap: Capacity, d: Demand, res: Reservation | None, n: int) -> None:
        cap.apply(d, res, n)
        if self.frag is not None:
            self.frag.refresh([n])

    def remove(self, cap: Capacity, d: Demand, n: int) -> None:
        cap.remove(d, n)
        if self.frag is not None:
            self.frag.refresh([n])


def dominates(d: Demand, f: Demand) -> bool:
    """Whether `d` asks at least what `f` asks in every way (resource, GPUs, bytes per GPU, CPU,
    memory), on no more products: wherever `d` fits, `f` fits."""
    return (
        d.resource == f.resource
        and d.gpu_count >= f.gpu_count
        and (
            d.bytes_per_gpu is None
            or (f.bytes_per_gpu is not None and d.bytes_per_gpu >= f.bytes_per_gpu)
        )
        and d.cpu_milli >= f.cpu_milli
        and d.memory_bytes >= f.memory_bytes
        and (
            f.allowed_products is None
            or (d.allowed_products is not None and d.allowed_products <= f.allowed_products)
        )
    )


class _Pool:
    """The running pods that may move, in columns (node, CPU, memory; one entry per device held:
    row, bytes, owner), which the bounds read for every pod at once; `mover(j)` builds the
    model's `Mover` only for the pods a plan looks at. Never the pod itself; never a pod whose
    reservation the ledger does not hold exactly (moving it would give back memory that is not
    held)."""

    def __init__(
        self,
        cap: Capacity,
        pod: Demand,
        running: Sequence[tuple[Demand, Reservation]],
        movable: Movable | None,
    ) -> None:
        ledger = cap.ledger
        a = cap.arrays
        node_row = {name: i for i, name in enumerate(a.node_names)}
        dev_row = {(dv.node, dv.device_id): i for i, dv in enumerate(a.devices)}
        held_by = ledger.reservation
        me, my_name = pod.pod, pod.pod.name
        self.demands: list[Demand] = []
        self.sources: list[Reservation] = []
        nodes: list[int] = []
        erow: list[int] = []
        ebytes: list[int] = []
        estart: list[int] = []
        for d, res in running:
            if (movable is not None and not movable(d)) or (d.pod.name == my_name and d.pod == me):
                continue
            n = node_row.get(res.node)
            if n is None:
                continue
            ids = res.device_ids
            if ids:
                held = held_by(res.pod.key)
                if held is not res and (held is None or not held.same_placement(res)):
                    continue
                if len(ids) == 1:
                    rows = [dev_row.get((res.node, ids[0]), -1)]
                else:
                    rows = [dev_row.get((res.node, i), -1) for i in ids]
                if -1 in rows:
                    continue
            elif d.gpu_count:
                continue
            else:
                rows = []
            estart.append(len(erow))
            erow += rows
            ebytes += res.bytes_per_device
            self.demands.append(d)
            self.sources.append(res)
            nodes.append(n)
        estart.append(len(erow))
        self.node = np.asarray(nodes, np.int64)
        self.cpu = np.fromiter((d.cpu_milli for d in self.demands), np.int64, len(nodes))
        self.mem = np.fromiter((d.memory_bytes for d in self.demands), np.int64, len(nodes))
        self.erow = np.asarray(erow, np.int64)
        self.ebytes = np.asarray(ebytes, np.int64)
        self.estart = np.asarray(estart, np.int64)
        self.eowner = np.repeat(np.arange(len(nodes)), np.diff(self.estart))
        self._by_node: dict[int, list[int]] | None = None
        self._movers: dict[int, Mover] = {}

    def __len__(self) -> int:
        return len(self.demands)

    def dominating(self, pod: Demand) -> np.ndarray:
        """Which pods `dominates` the pod."""
        return np.fromiter((dominates(d, pod) for d in self.demands), bool, len(self.demands))

    def on_node(self, n: int, keep: np.ndarray) -> list[int]:
        """The pods running on node row n (among `keep`)."""
        if self._by_node is None:
            self._by_node = {}
            for j, m in enumerate(self.node.tolist()):
                self._by_node.setdefault(m, []).append(j)
        return [j for j in self._by_node.get(n, ()) if keep[j]]

    def mover(self, j: int) -> Mover:
        m = self._movers.get(j)
        if m is None:
            lo, hi = int(self.estart[j]), int(self.estart[j + 1])
            m = self._movers[j] = Mover(
                self.demands[j],
                int(self.node[j]),
                tuple(self.erow[lo:hi].tolist()),
                tuple(self.ebytes[lo:hi].tolist()),
            )
        return m


def _greedy_best(
    cap: Capacity,
    pod: Demand,
    pool: _Pool,
    keep: np.ndarray,
    nodes: Sequence[int],
    bounds: np.ndarray,
    cost: np.ndarray,
    limit: int,
    depth: int,
    deadline: float,
    rule: Rule,
) -> RepackPlan | None:
    """The best greedy plan (`_Greedy`) over `nodes`, in order; stops once a node's bound
    cannot beat the best plan so far, or at the deadline."""
    best: RepackPlan | None = None
    ranks: dict[tuple[object, ...], tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
    for n in nodes:
        if best is not None and bounds[n] >= len(best.moves):
            break
        if time.perf_counter() >= deadline:
            break
        cap_moves = limit if best is None else min(limit, len(best.moves) - 1)
        plan = _Greedy(cap, pool, depth, deadline, ranks, rule).plan(pod, keep, n, cost, cap_moves)
        if plan is not None and (best is None or len(plan.moves) < len(best.moves)):
            best = plan
    return best


class _Greedy:
    """A greedy plan, made on `cap` and undone: the pod on node n, on its k cheapest devices;
    from each, the movable pods holding most there are evicted until it fits, then from the
    node GPU-less pods, then others, holding most CPU, then memory, until the node has room;
    the pod is placed, then every evicted pod (most GPUs and bytes first) at its best fit. An
    evicted pod with no place anywhere, at `depth` > 0, gets the same treatment on the nodes
    where it needs fewest moves (a chain of moves), with what is left of the move cap."""

    def __init__(
        self,
        cap: Capacity,
        pool: _Pool,
        depth: int,
        deadline: float,
        ranks: dict[tuple[object, ...], tuple[np.ndarray, np.ndarray, np.ndarray]],
        rule: Rule,
    ) -> None:
        #: per kind of moved pod, its bounds on the cluster as the search began: they only
        #: order the nodes a chained move tries, each try is checked by placing it
        self.ranks = ranks
        self.rule = rule
        self.cap = cap
        self.pool = pool
        self.depth = depth
        self.deadline = deadline
        self.undo: list[Callable[[], None]] = []
        self.gone = np.zeros(len(pool), bool)
        self.moves: list[Move] = []

    def plan(
        self, pod: Demand, keep: np.ndarray, n: int, cost: np.ndarray, limit: int
    ) -> RepackPlan | None:
        try:
            placement = self._make_room(pod, keep, n, cost, limit, self.depth)
            if placement is None:
                return None
            plan = RepackPlan(pod, placement, tuple(sorted(self.moves, key=_by_pod)), "", False, 0)
        finally:
            self._rollback(0)
        return plan if final_state_fits(self.cap, plan) else None

    def _rollback(self, mark: int) -> None:
        while len(self.undo) > mark:
            self.undo.pop()()

    def _make_room(
        self, pod: Demand, keep: np.ndarray, n: int, cost: np.ndarray, limit: int, depth: int
    ) -> Reservation | None:
        """Evict on node n what the pod needs, place it, re-place the evicted pods; the pod's
        reservation, or None (with the changes it made still to undo)."""
        cap, a = self.cap, self.cap.arrays
        k = pod.gpu_count
        lo, hi = int(a.node_start[n]), int(a.node_start[n + 1])
        need = need_bytes(cap, pod)
        chosen: list[int] = []
        if k:
            order = np.lexsort((a.used[lo:hi], cost[lo:hi]))[:k] + lo
            if len(order) < k or (cost[order] >= INF).any():
                return None
            chosen = sorted(int(r) for r in order)
        here = [j for j in self.pool.on_node(n, keep) if not self.gone[j]]
        movers = [self.pool.mover(j) for j in here]
        evicted: list[int] = []
        taken: set[int] = set()
        for r in chosen:
            free = int(a.capacity[r] - a.used[r])
            rep = int(a.replicas[r] - a.used_replicas[r])
            on_r = []
            for i, m in enumerate(movers):
                if r in m.rows:
                    b = m.held[m.rows.index(r)]
                    if i in taken:
                        free, rep = free + b, rep + 1
                    else:
                        on_r.append((b, i))
            for b, i in sorted(on_r, key=lambda t: (-t[0], t[1])):
                if free >= need[r] and rep >= 1:
                    break
                taken.add(i)
                evicted.append(i)
                free, rep = free + b, rep + 1
            if free < need[r] or rep < 1:
                return None
        host: tuple[tuple[int, int, Callable[[Demand], int]], ...] = (
            (int(cap.cpu_free[n]), pod.cpu_milli, _cpu),
            (int(cap.mem_free[n]), pod.memory_bytes, _mem),
        )
        for room0, want, amount in host:
            room = room0 + sum(amount(movers[i].demand) for i in evicted)
            rest = [i for i in range(len(movers)) if i not in taken]
            # GPU-less pods first: they need CPU and memory elsewhere, not a GPU
            for i in sorted(
                rest, key=lambda i: (movers[i].demand.gpu_count > 0, -amount(movers[i].demand), i)
            ):
                if room >= want:
                    break
                taken.add(i)
                evicted.append(i)
                room += amount(movers[i].demand)
            if room < want:
                return None
        if len(evicted) > limit:
            return None
        for i in evicted:
            m = movers[i]
            assert m.node is not None
            self.rule.remove(cap, m.demand, m.node)
            self.gone[here[i]] = True
            self.undo.append(
                partial(self.rule.apply, cap, m.demand, _source(cap, m) if m.rows else None, m.node)
            )
            self.undo.append(partial(self.gone.__setitem__, here[i], False))
        placement = reservation_for(cap, pod, n, chosen)
        if not self._place(pod, placement, n):
            return None
        left = limit - len(evicted)
        for i in sorted(evicted, key=lambda i: _size_key(movers[i].demand)):
            m = movers[i]
            spent = self._relocate(m, left, depth)
            if spent is None:
                return None
            left -= spent
        return placement

    def _place(self, d: Demand, res: Reservation, n: int) -> bool:
        cap = self.cap
        if cap.cpu_free[n] < d.cpu_milli or cap.mem_free[n] < d.memory_bytes:
            return False
        try:
            self.rule.apply(cap, d, res if res.device_ids else None, n)
        except LedgerError:
            return False
        self.undo.append(partial(self.rule.remove, cap, d, n))
        return True

    def _relocate(self, m: Mover, left: int, depth: int) -> int | None:
        """Place an evicted pod: where the rule places it now, else (depth > 0) where it needs
        fewest moves; the extra moves it took (None: no place)."""
        cap = self.cap
        d = m.demand
        target = self.rule.choose(cap, d)
        if target is not None:
            to = cap.ledger.node_row(target.node)
            if to is None or not self._place(d, target, to):
                return None
            self._record(m, target, to)
            return 0
        if depth <= 0 or left <= 0 or time.perf_counter() >= self.deadline:
            return None
        kind = demand_kind(d)
        if kind not in self.ranks:
            self.ranks[kind] = _bounds(cap, d, self.pool, ~self.pool.dominating(d))
        rank, held, cost = self.ranks[kind]
        keep = ~self.pool.dominating(d) & ~self.gone
        for n in [int(x) for x in np.lexsort((held, rank))[:_CHAIN_NODES]]:
            if rank[n] > left:
                break
            mark, moves_before = len(self.undo), len(self.moves)
            made = self._make_room(d, keep, n, cost, left, depth - 1)
            if made is not None:
                self._record(m, made, n)
                return len(self.moves) - moves_before - 1
            self._rollback(mark)
            del self.moves[moves_before:]
        return None

    def _record(self, m: Mover, target: Reservation, to: int) -> None:
        if to != m.node or tuple(sorted(m.rows)) != tuple(sorted(self._rows(target))):
            self.moves.append(Move(m.demand.pod, m.demand, _source(self.cap, m), target))

    def _rows(self, res: Reservation) -> list[int]:
        ledger = self.cap.ledger
        return [r for r in (ledger.row(res.node, dev) for dev in res.device_ids) if r is not None]


#: nodes a chained move is tried on, fewest moves first
_CHAIN_NODES = 4


def _by_pod(m: Move) -> str:
    return m.pod.key


def _source(cap: Capacity, m: Mover) -> Reservation:
    """Where a mover runs now, as a reservation (a GPU-less pod: one naming its node)."""
    a = cap.arrays
    assert m.node is not None
    return Reservation(
        pod=m.demand.pod,
        node=a.node_names[m.node],
        device_ids=tuple(a.devices[r].device_id for r in m.rows),
        bytes_per_device=m.held,
        priority=m.demand.priority,
        declared=m.demand.bytes_per_gpu is not None,
    )


def _cpu(d: Demand) -> int:
    return d.cpu_milli


def _mem(d: Demand) -> int:
    return d.memory_bytes


def _size_key(d: Demand) -> tuple[int, int, int]:
    """Most GPUs, then most bytes per GPU, then most CPU first: the hardest to place first."""
    return (
        -d.gpu_count,
        -(d.bytes_per_gpu if d.bytes_per_gpu is not None else 1 << 60),
        -d.cpu_milli,
    )


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


def move_lower_bounds(
    cap: Capacity,
    pod: Demand,
    running: Sequence[tuple[Demand, Reservation]],
    movable: Movable | None = None,
) -> np.ndarray:
    """Per node row, a lower bound on the moves any plan placing `pod` there needs (INF: it
    cannot go there whatever moves); see the module docstring."""
    pool = _Pool(cap, pod, running, movable)
    return _bounds(cap, pod, pool, np.ones(len(pool), bool))[0]


def _bounds(
    cap: Capacity, pod: Demand, pool: _Pool, keep: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`move_lower_bounds` counting the pods of `keep` only; per node the memory held on the
    devices that bound counts (the cheapest ones: among nodes with the same bound, the one
    where less must move first); and per device the fewest pods to move off it for the pod to
    fit there (INF: never)."""
    a = cap.arrays
    n_nodes = len(a.node_names)
    host = np.maximum(
        _cover_counts(pool.node[keep], pool.cpu[keep], pod.cpu_milli - cap.cpu_free),
        _cover_counts(pool.node[keep], pool.mem[keep], pod.memory_bytes - cap.mem_free),
    )
    held = np.zeros(n_nodes, np.int64)
    k = pod.gpu_count
    if k == 0:
        return host, held, np.full(len(a.capacity), INF, np.int64)
    need = need_bytes(cap, pod)
    ok = cap.matches(pod.resource, pod.allowed_products)
    ok &= (a.per_pod_cap >= need) & (a.capacity >= need) & (a.replicas >= 1)
    ekeep = keep[pool.eowner] if len(pool.eowner) else np.zeros(0, bool)
    er, eb = pool.erow[ekeep], pool.ebytes[ekeep]
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
        spans = np.diff(pool.estart) > 1
        multi = set(pool.node[spans & keep].tolist())
        for n in np.flatnonzero(a.per_node_sum(cost < INF, np.int64) >= k).tolist():
            lo, hi = int(a.node_start[n]), int(a.node_start[n + 1])
            best = np.lexsort((used[lo:hi], cost[lo:hi]))[:k] + lo
            c = cost[best]
            gpu[n] = int(c[-1]) if n in multi else int(c.sum())
            held[n] = int(used[best].sum())
    out: np.ndarray = np.minimum(np.maximum(gpu, host), INF)
    return out, held, cost


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
    moves: list[Move] = []
    for i in range(1, len(mm.movers)):
        to = mm.landing(values, i)
        if to is None or mm.stays(i, to):
            continue
        mv = mm.movers[i]
        source = _source(cap, mv)
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
