"""The running pods a repack search may move, the lower bound per node on the moves a pod needs,
and the greedy plan (steps 2 and 3 of `repack`'s search)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import cast

import numpy as np

from extender.demand import Demand
from extender.ledger import LedgerError, Reservation
from extender.planner import clock
from extender.planner.capacity import Capacity, Kind, demand_kind
from extender.planner.move_model import Mover, device_fits, need_bytes, reservation_for
from extender.planner.repack_plan import (
    Move,
    RepackPlan,
    Rule,
    by_pod,
    final_state_fits,
    source_of,
)

__all__ = [
    "INF",
    "Movable",
    "Pool",
    "dominates",
    "cover_counts",
    "needs_gpu_movers",
    "node_bounds",
    "move_lower_bounds",
    "Greedy",
    "greedy_best",
    "CHAIN_NODES",
]

#: "no plan on this node": larger than any move count
INF = 1 << 30

Movable = Callable[[Demand], bool]


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


class Pool:
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
        node_row, dev_row = ledger.node_row, ledger.row  # the rows of `cap.arrays`
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
            n = node_row(res.node)
            if n is None:
                continue
            ids = res.device_ids
            if ids:
                held = held_by(res.pod.key)
                if held is not res and (held is None or not held.same_placement(res)):
                    continue
                found = [dev_row(res.node, i) for i in ids]
                if None in found:
                    continue
                rows = cast(list[int], found)
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
        # `dominates` reads only a pod's kind, and a few hundred kinds cover thousands of pods
        kinds: dict[Kind, int] = {}
        self._kinds: list[Demand] = []  # one pod of each kind
        of_kind: list[int] = []
        for d in self.demands:
            k = kinds.setdefault(demand_kind(d), len(self._kinds))
            if k == len(self._kinds):
                self._kinds.append(d)
            of_kind.append(k)
        self._kind = np.asarray(of_kind, np.int64)
        self._dominating: dict[Kind, np.ndarray] = {}
        self._by_node: dict[int, list[int]] | None = None
        self._movers: dict[int, Mover] = {}

    def __len__(self) -> int:
        return len(self.demands)

    def dominating(self, pod: Demand) -> np.ndarray:
        """Which pods `dominates` the pod (read-only: shared by every call for its kind)."""
        kind = demand_kind(pod)
        found = self._dominating.get(kind)
        if found is None:
            per_kind = np.fromiter((dominates(d, pod) for d in self._kinds), bool, len(self._kinds))
            found = per_kind[self._kind]
            found.flags.writeable = False
            self._dominating[kind] = found
        return found

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


def cover_counts(group: np.ndarray, value: np.ndarray, deficit: np.ndarray) -> np.ndarray:
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
    pool = Pool(cap, pod, running, movable)
    return node_bounds(cap, pod, pool, np.ones(len(pool), bool))[0]


def host_moves(cap: Capacity, pod: Demand, pool: Pool, keep: np.ndarray) -> np.ndarray:
    """Per node, the fewest pods of `keep` there (largest first) whose CPU, and whose memory,
    cover what the pod lacks of each (INF: they cannot)."""
    out: np.ndarray = np.maximum(
        cover_counts(pool.node[keep], pool.cpu[keep], pod.cpu_milli - cap.cpu_free),
        cover_counts(pool.node[keep], pool.mem[keep], pod.memory_bytes - cap.mem_free),
    )
    return out


def node_bounds(
    cap: Capacity, pod: Demand, pool: Pool, keep: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`move_lower_bounds` counting the pods of `keep` only; per node the memory held on the
    devices that bound counts (the cheapest ones: among nodes with the same bound, the one
    where less must move first); and per device the fewest pods to move off it for the pod to
    fit there (INF: never)."""
    a = cap.arrays
    n_nodes = len(a.node_names)
    host = host_moves(cap, pod, pool, keep)
    held = np.zeros(n_nodes, np.int64)
    k = pod.gpu_count
    if k == 0:
        return host, held, np.full(len(a.capacity), INF, np.int64)
    need = need_bytes(cap, pod)
    ok = device_fits(cap, pod, need)
    ekeep = keep[pool.eowner] if len(pool.eowner) else np.zeros(0, bool)
    er, eb = pool.erow[ekeep], pool.ebytes[ekeep]
    dev_bytes = cover_counts(er, eb, need - (a.capacity - a.used))
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


def needs_gpu_movers(
    cap: Capacity, pod: Demand, pool: Pool, keep: np.ndarray, bounds: np.ndarray
) -> np.ndarray:
    """Per node, whether the CPU and memory the pod lacks there cannot come from GPU-less pods
    of `keep` alone within the node's bound. Such a node needs a GPU pod to move for CPU or
    memory, and a GPU pod needs GPU room and host room on one node elsewhere, which is what
    the pod itself lacks; a GPU-less pod needs only CPU and memory. Ranks nodes of equal bound
    (on the trace at inflate 1.3, every pod that fits nowhere has GPU room on hundreds of nodes
    whose CPU is short, and the few that hold a GPU-less pod are where one move places it)."""
    gpu_less = keep & (np.diff(pool.estart) == 0)
    return np.asarray(host_moves(cap, pod, pool, gpu_less) > bounds)


def greedy_best(
    cap: Capacity,
    pod: Demand,
    pool: Pool,
    keep: np.ndarray,
    nodes: Sequence[int],
    bounds: np.ndarray,
    cost: np.ndarray,
    limit: int,
    depth: int,
    deadline: float,
    rule: Rule,
) -> RepackPlan | None:
    """The best greedy plan (`Greedy`) over `nodes`, in order; stops once a node's bound
    cannot beat the best plan so far, or at the deadline."""
    best: RepackPlan | None = None
    ranks: dict[tuple[object, ...], tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
    for n in nodes:
        if best is not None and bounds[n] >= len(best.moves):
            break
        if clock.now() >= deadline:
            break
        cap_moves = limit if best is None else min(limit, len(best.moves) - 1)
        plan = Greedy(cap, pool, depth, deadline, ranks, rule).plan(pod, keep, n, cost, cap_moves)
        if plan is not None and (best is None or len(plan.moves) < len(best.moves)):
            best = plan
    return best


class Greedy:
    """A greedy plan, made on `cap` and undone: the pod on node n, on its k cheapest devices;
    from each, the movable pods holding most there are evicted until it fits, then from the
    node GPU-less pods, then others, holding most CPU, then memory, until the node has room;
    the pod is placed, then every evicted pod (most GPUs and bytes first) at its best fit. An
    evicted pod with no place anywhere, at `depth` > 0, gets the same treatment on the nodes
    where it needs fewest moves (a chain of moves), with what is left of the move cap."""

    def __init__(
        self,
        cap: Capacity,
        pool: Pool,
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
            plan = RepackPlan(pod, placement, tuple(sorted(self.moves, key=by_pod)), "", False, 0)
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
                partial(
                    self.rule.apply, cap, m.demand, source_of(cap, m) if m.rows else None, m.node
                )
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
        if depth <= 0 or left <= 0 or clock.now() >= self.deadline:
            return None
        kind = demand_kind(d)
        if kind not in self.ranks:
            self.ranks[kind] = node_bounds(cap, d, self.pool, ~self.pool.dominating(d))
        rank, held, cost = self.ranks[kind]
        keep = ~self.pool.dominating(d) & ~self.gone
        mask = self.rule.allowed(d) if self.rule.allowed is not None else None
        for n in [int(x) for x in np.lexsort((held, rank))[:CHAIN_NODES]]:
            if rank[n] > left:
                break
            if mask is not None and not mask[n]:
                continue
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
            self.moves.append(Move(m.demand.pod, m.demand, source_of(self.cap, m), target))

    def _rows(self, res: Reservation) -> list[int]:
        ledger = self.cap.ledger
        return [r for r in (ledger.row(res.node, dev) for dev in res.device_ids) if r is not None]


#: nodes a chained move is tried on, fewest moves first
CHAIN_NODES = 4


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
