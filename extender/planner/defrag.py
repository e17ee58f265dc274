"""Defragmentation plan (dry run): the fewest pod moves that free the most whole GPUs.

A GPU is *freed* when every pod on it moves away and none moves onto it. Goals, lexicographic:
most GPUs freed, then fewest moves (then lowest priority moved). Safety: a move's target must
have room *now*, without counting memory that other moves would release, so the moves can be
carried out one by one in any order (evict, the pod is recreated and lands on its target) and
the ledger never overcommits in between. Disruption limits stand in for PodDisruptionBudgets:
at most N moves in total, per namespace, per node, and namespaces that must not be touched.
Only pods holding a declared share of one GPU (`vramsched.io/model-memory`, one GPU) move; a
pod holding whole devices or several GPUs stays where it is.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field

from ortools.sat.python import cp_model

from extender.ledger import Reservation
from extender.planner.capacity import Capacity, device_matches

__all__ = ["Limits", "Move", "DefragPlan", "plan_defrag"]


@dataclass(frozen=True)
class Limits:
    max_moves: int | None = None
    max_per_namespace: int | None = None
    max_per_node: int | None = None
    exclude_namespaces: frozenset[str] = frozenset()


@dataclass(frozen=True)
class Move:
    pod: str
    from_node: str
    from_device: str
    to_node: str
    to_device: str
    bytes: int
    priority: int


@dataclass
class DefragPlan:
    moves: list[Move] = field(default_factory=list)
    freed: list[tuple[str, str]] = field(default_factory=list)  # (node, device id)
    status: str = ""
    bound_freed: int = 0
    seconds: float = 0.0
    gpus_free_before: int = 0


def plan_defrag(
    cap: Capacity,
    demands: Mapping[str, tuple[int, int, str | None]],
    limits: Limits = Limits(),
    *,
    time_limit: float = 10.0,
    num_workers: int = 2,
) -> DefragPlan:
    """`demands` maps pod key -> (cpu milli, memory bytes, resource) of every bound pod we hold."""
    start = time.perf_counter()
    ledger = cap.ledger
    a = cap.arrays
    out = DefragPlan(gpus_free_before=int((a.used_replicas == 0).sum()))
    by_dev: dict[int, list[Reservation]] = defaultdict(list)
    movable: list[tuple[Reservation, int]] = []
    for res in ledger.reservations():
        rows = [ledger.row(res.node, d) for d in res.device_ids]
        for g in rows:
            if g is not None:
                by_dev[g].append(res)
        ns = res.pod.namespace
        if (
            len(rows) == 1
            and rows[0] is not None
            and res.declared
            and ns not in limits.exclude_namespaces
        ):
            movable.append((res, rows[0]))
    m = cp_model.CpModel()
    x: dict[tuple[int, int], cp_model.IntVar] = {}
    moved: list = []
    incoming_b: dict[int, list] = defaultdict(list)
    incoming_n: dict[int, list] = defaultdict(list)
    incoming_cpu: dict[int, list] = defaultdict(list)
    incoming_mem: dict[int, list] = defaultdict(list)
    per_ns: dict[str, list] = defaultdict(list)
    per_node: dict[str, list] = defaultdict(list)
    free = a.capacity - a.used
    rep = a.replicas - a.used_replicas
    moved_of: dict[str, cp_model.IntVar] = {}
    for i, (res, g) in enumerate(movable):
        nbytes = res.bytes_per_device[0]
        cpu, mem, resource = demands.get(res.key, (0, 0, None))
        dev = a.devices[g]
        ok = (
            device_matches(a, resource or dev.resource, None)
            & (free >= nbytes)
            & (rep > 0)
            & (a.per_pod_cap >= nbytes)
        )
        ok &= (
            a.product_id == a.product_id[g]
        )  # stay on the same GPU product (the pod may depend on it)
        targets = [int(h) for h in ok.nonzero()[0] if int(h) != g]
        if not targets:
            continue
        mv = m.NewBoolVar(f"mv{i}")
        terms = []
        for h in targets:
            n_to = int(a.node_of[h])
            if a.node_names[n_to] != res.node and (
                cap.cpu_free[n_to] < cpu or cap.mem_free[n_to] < mem
            ):
                continue
            v = m.NewBoolVar(f"x{i}_{h}")
            x[i, h] = v
            terms.append(v)
            incoming_b[h].append(nbytes * v)
            incoming_n[h].append(v)
            if a.node_names[n_to] != res.node:
                incoming_cpu[n_to].append(cpu * v)
                incoming_mem[n_to].append(mem * v)
        if not terms:
            continue
        m.Add(sum(terms) == mv)
        moved.append((mv, res))
        moved_of[res.key] = mv
        per_ns[res.pod.namespace].append(mv)
        per_node[res.node].append(mv)
    for h, terms in incoming_b.items():
        m.Add(sum(terms) <= int(free[h]))
        m.Add(sum(incoming_n[h]) <= int(rep[h]))
    for n, terms in incoming_cpu.items():
        m.Add(sum(terms) <= int(cap.cpu_free[n]))
        m.Add(sum(incoming_mem[n]) <= int(cap.mem_free[n]))
    freed = []
    for g, holders in by_dev.items():
        if any(r.key not in moved_of for r in holders):
            continue
        f = m.NewBoolVar(f"free{g}")
        for r in holders:
            m.AddImplication(f, moved_of[r.key])
        if incoming_n.get(g):
            m.Add(sum(incoming_n[g]) == 0).OnlyEnforceIf(f)
        freed.append((f, g))
    if limits.max_moves is not None:
        m.Add(sum(mv for mv, _ in moved) <= limits.max_moves)
    if limits.max_per_namespace is not None:
        for terms in per_ns.values():
            m.Add(sum(terms) <= limits.max_per_namespace)
    if limits.max_per_node is not None:
        for terms in per_node.values():
            m.Add(sum(terms) <= limits.max_per_node)
    if not freed:
        out.status = "NOTHING_TO_FREE"
        out.seconds = time.perf_counter() - start
        return out
    W = (len(moved) + 1) * 2
    max_prio = max((r.priority for _, r in moved), default=0)
    # moves cost 2, plus 1 when the pod is of the highest priority among the movable ones
    m.Maximize(
        W * sum(f for f, _ in freed)
        - sum((2 + (1 if r.priority >= max_prio and max_prio > 0 else 0)) * mv for mv, r in moved)
    )
    solver = cp_model.CpSolver()
    solver.parameters.num_workers = max(1, num_workers)
    solver.parameters.max_time_in_seconds = time_limit
    st = solver.Solve(m)
    out.status = solver.StatusName(st)
    out.bound_freed = (
        int(solver.BestObjectiveBound() // W) if st in (cp_model.OPTIMAL, cp_model.FEASIBLE) else 0
    )
    if st not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        out.seconds = time.perf_counter() - start
        return out
    for (i, h), v in x.items():
        if solver.Value(v):
            res, g = movable[i]
            out.moves.append(
                Move(
                    res.key,
                    res.node,
                    a.devices[g].device_id,
                    a.node_names[int(a.node_of[h])],
                    a.devices[h].device_id,
                    res.bytes_per_device[0],
                    res.priority,
                )
            )
    out.freed = sorted(
        (a.devices[g].node, a.devices[g].device_id) for f, g in freed if solver.Value(f)
    )
    # a moved pod whose GPU is not freed would be a wasted move; the objective never wants one
    out.moves.sort(key=lambda mv: (mv.from_node, mv.from_device, mv.pod))
    out.seconds = time.perf_counter() - start
    return out
