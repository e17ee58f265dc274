"""A repack plan and what it guarantees: the moves, the pod's placement, the final-state check,
and where a pod that fits goes (`Rule`). Shared by the search steps of `repack`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from extender.demand import Demand, PodRef
from extender.ledger import Reservation
from extender.planner.capacity import Capacity, FragIndex, candidates
from extender.planner.move_model import Mover, reservation_for

__all__ = ["Move", "RepackPlan", "Rule", "TargetNodes", "final_state_fits", "source_of", "by_pod"]

#: per pod, the node rows it may be placed on (None: every node): what kube-scheduler's labels,
#: taints and cordon allow its new copy
TargetNodes = Callable[[Demand], "np.ndarray | None"]


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
class Rule:
    """Where a pod that fits goes (the pod when it fits without moves, a moved pod at its new
    place): by default its best fit (least memory left on its devices, then lowest node; a
    GPU-less pod: least CPU left); with `name`, one of `greedy.POLICIES` (the simulator passes
    the planner's, so moved pods land where the planner would put them), on `frag` kept
    current as the search changes the capacity and undoes it. With `allowed`, a pod whose rule's
    choice is a node it may not use takes its best fit among the nodes it may."""

    name: str | None = None
    frag: FragIndex | None = None
    allowed: TargetNodes | None = None

    def choose(self, cap: Capacity, d: Demand) -> Reservation | None:
        res = self._choose(cap, d)
        mask = self.allowed(d) if self.allowed is not None and res is not None else None
        if res is None or mask is None:
            return res
        row = cap.ledger.node_row(res.node)
        if row is not None and mask[row]:
            return res
        return _best_fit(cap, d, mask)

    def _choose(self, cap: Capacity, d: Demand) -> Reservation | None:
        if self.name is not None:
            from extender.planner.greedy import choose

            ch = choose(self.name, cap, d, self.frag)
            if ch is None:
                return None
            res, n, _ = ch
            return res if res is not None else reservation_for(cap, d, n, ())
        return _best_fit(cap, d)

    def apply(self, cap: Capacity, d: Demand, res: Reservation | None, n: int) -> None:
        cap.apply(d, res, n)
        if self.frag is not None:
            self.frag.refresh([n])

    def remove(self, cap: Capacity, d: Demand, n: int) -> None:
        cap.remove(d, n)
        if self.frag is not None:
            self.frag.refresh([n])


def _best_fit(cap: Capacity, d: Demand, mask: np.ndarray | None = None) -> Reservation | None:
    """Least memory left on its devices, then lowest node (a GPU-less pod: least CPU left),
    among the nodes `mask` allows."""
    c = candidates(cap, d)
    if mask is not None and len(c):
        c = c.take(np.flatnonzero(mask[c.node]))
    if len(c) == 0:
        return None
    key = c.leftover(cap.arrays) if d.gpu_count else cap.cpu_free[c.node]
    i = int(np.lexsort((c.node, key))[0])
    return reservation_for(cap, d, int(c.node[i]), c.devices[i].tolist())


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


def source_of(cap: Capacity, m: Mover) -> Reservation:
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


def by_pod(m: Move) -> str:
    return m.pod.key
