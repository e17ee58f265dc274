"""`planner+preempt` in the replay: when a GPU pod fits nowhere after the planner's placements,
preemption by VRAM (`placement.plan_preemption`, what `serve --preempt` plans) evicts the fewest
lowest-priority running pods of one node that make it fit, and the pod takes the freed GPUs.

A victim's controller re-creates it at once: it is offered again by the planner's one-pod rule
and, if it fits nowhere, may preempt pods of lower priority than its own in turn (priorities
fall along such a chain, so it ends). A victim that finds no place stays out: the replay counts
it as failed and no longer placed, so `placed + failed` is still the pods that arrived.

Victims must free the pod's CPU and memory as well as its VRAM (`HostRoom`). Where the pod's
VRAM is free but not the cores, the replay preempts too, which in a cluster kube-scheduler's own
preemption does (its victims vetted by the extender's preempt verb); the replay picks them as
`serve --preempt` does, among GPU pods only. The trace has no disruption budgets, so none
refuses an eviction here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from extender.demand import Demand
from extender.ledger import LedgerError, Reservation
from extender.placement.preempt import HostRoom, PreemptionPlan, plan_preemption
from extender.planner.capacity import Capacity, FragIndex, demand_kind
from extender.planner.greedy import choose, place_one
from extender.simulate.result import PolicyResult
from extender.simulate.trace import Task

__all__ = ["PriorityTally", "preempt_failed"]


@dataclass
class PriorityTally:
    """CPU, memory and count of the placed GPU pods (the only ones preemption by VRAM evicts),
    per priority and node row: which nodes could take a pod once every GPU pod of lower priority
    there were gone, without a pass over the pods."""

    nodes: int
    cpu: dict[int, np.ndarray] = field(default_factory=dict)
    mem: dict[int, np.ndarray] = field(default_factory=dict)
    gpu_pods: dict[int, np.ndarray] = field(default_factory=dict)

    def add(self, d: Demand, row: int, sign: int = 1) -> None:
        if not d.wants_gpu:
            return
        p = d.priority
        if p not in self.cpu:
            self.cpu[p] = np.zeros(self.nodes, dtype=np.int64)
            self.mem[p] = np.zeros(self.nodes, dtype=np.int64)
            self.gpu_pods[p] = np.zeros(self.nodes, dtype=np.int64)
        self.cpu[p][row] += sign * d.cpu_milli
        self.mem[p][row] += sign * d.memory_bytes
        self.gpu_pods[p][row] += sign

    def remove(self, d: Demand, row: int) -> None:
        self.add(d, row, -1)

    def candidates(self, cap: Capacity, d: Demand) -> list[int]:
        """Node rows, in node order, with a GPU pod of lower priority than `d`'s and room for
        `d`'s CPU and memory once every pod of lower priority there is gone."""
        lower = [p for p in self.cpu if p < d.priority]
        if not lower:
            return []
        pods = sum(self.gpu_pods[p] for p in lower)
        cpu = cap.cpu_free + sum(self.cpu[p] for p in lower)
        mem = cap.mem_free + sum(self.mem[p] for p in lower)
        ok = (pods > 0) & (cpu >= d.cpu_milli) & (mem >= d.memory_bytes)
        return [int(r) for r in np.flatnonzero(ok)]


def preempt_failed(
    cap: Capacity,
    place_rule: str,
    frag: FragIndex | None,
    batch: Sequence[Task],
    where: dict[str, int],
    demands_of: dict[str, Task],
    tally: PriorityTally,
    out: PolicyResult,
    nowhere: set[tuple],
) -> tuple[list[tuple[Task, int]], list[Task]]:
    """Preempt for every GPU pod of the batch left out, highest priority first; its victims are
    offered again (module docstring). Returns the batch's pods it placed and the victims that
    found no place again (the caller counts them failed)."""
    queue = sorted(
        (t for t in batch if t.key not in where and t.demand.wants_gpu),
        key=lambda t: -t.demand.priority,
    )
    waiting = list(queue)
    evicted: dict[str, Task] = {}
    stats = out.extra
    while queue:
        t = queue.pop(0)
        d = t.demand
        if t.key in where or demand_kind(d) in nowhere:
            continue
        plan = _plan(cap, d, tally, demands_of)
        if plan is None:
            continue
        row = cap.ledger.node_row(plan.node)
        assert row is not None
        victims = [demands_of[res.pod.key] for res in plan.victims]
        for v in victims:
            cap.remove(v.demand, row)
            tally.remove(v.demand, row)
            where.pop(v.key)
        try:
            cap.apply(d, plan.placement, row)
        except LedgerError:  # cannot happen for a plan made on this ledger: put them back
            for v, res in zip(victims, plan.victims, strict=True):
                cap.apply(v.demand, res, row)
                tally.add(v.demand, row)
                where[v.key] = row
            continue
        tally.add(d, row)
        where[t.key] = row
        demands_of[t.key] = t
        if frag is not None:
            frag.refresh([row])
        stats["preemptions"] = stats.get("preemptions", 0) + 1
        stats["preempted"] = stats.get("preempted", 0) + len(victims)
        for v in victims:  # re-created by their controllers: placed again if they fit
            evicted[v.key] = v
            ch = choose(place_rule, cap, v.demand, frag)
            if ch is None:
                queue.append(v)  # it may preempt pods of lower priority than its own
                continue
            place_one(cap, v.demand, ch, frag)
            tally.add(v.demand, ch[1])
            where[v.key] = ch[1]
        queue.sort(key=lambda q: -q.demand.priority)
    lost = [v for k, v in evicted.items() if k not in where]
    stats["preemptedPlacedAgain"] = stats.get("preemptedPlacedAgain", 0) + len(evicted) - len(lost)
    placed = [(t, where[t.key]) for t in waiting if t.key in where]
    return placed, lost


def _plan(
    cap: Capacity, d: Demand, tally: PriorityTally, demands_of: dict[str, Task]
) -> PreemptionPlan | None:
    """`plan_preemption` over the nodes that could take the pod once every GPU pod of lower
    priority there were gone, with the victims freeing its CPU and memory too."""
    rows = tally.candidates(cap, d)
    if not rows:
        return None
    names = cap.arrays.node_names
    free = {names[r]: (int(cap.cpu_free[r]), int(cap.mem_free[r])) for r in rows}

    def held(res: Reservation) -> tuple[int, int]:
        v = demands_of[res.key].demand
        return v.cpu_milli, v.memory_bytes

    return plan_preemption(cap.ledger, d, nodes=list(free), host=HostRoom(free, held))
