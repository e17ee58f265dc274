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
from dataclasses import dataclass

from ortools.sat.python import cp_model

from extender.ledger import Reservation
from extender.planner.capacity import Capacity, device_matches
from extender.planner.staged import Settings, Stage, staged_solve

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


@dataclass(frozen=True)
class DefragPlan:
    moves: list[Move]
    freed: list[tuple[str, str]]  # (node, device id)
    status: str
    bound_freed: int
    seconds: float
    gpus_free_before: int


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
    free_before = int((a.used_replicas == 0).sum())
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
    moved: list[tuple[cp_model.IntVar, Reservation]] = []
    incoming_b: dict[int, list[cp_model.LinearExprT]] = defaultdict(list)
    incoming_n: dict[int, list[cp_model.IntVar]] = defaultdict(list)
    incoming_cpu: dict[int, list[cp_model.LinearExprT]] = defaultdict(list)
    incoming_mem: dict[int, list[cp_model.LinearExprT]] = defaultdict(list)
    per_ns: dict[str, list[cp_model.IntVar]] = defaultdict(list)
    per_node: dict[str, list[cp_model.IntVar]] = defaultdict(list)
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
        mv = m.new_bool_var(f"mv{i}")
        terms = []
        for h in targets:
            n_to = int(a.node_of[h])
            if a.node_names[n_to] != res.node and (
                cap.cpu_free[n_to] < cpu or cap.mem_free[n_to] < mem
            ):
                continue
            v = m.new_bool_var(f"x{i}_{h}")
            x[i, h] = v
            terms.append(v)
            incoming_b[h].append(nbytes * v)
            incoming_n[h].append(v)
            if a.node_names[n_to] != res.node:
                incoming_cpu[n_to].append(cpu * v)
                incoming_mem[n_to].append(mem * v)
        if not terms:
            continue
        m.add(sum(terms) == mv)
        moved.append((mv, res))
        moved_of[res.key] = mv
        per_ns[res.pod.namespace].append(mv)
        per_node[res.node].append(mv)
    for h, bytes_in in incoming_b.items():
        m.add(sum(bytes_in) <= int(free[h]))
        m.add(sum(incoming_n[h]) <= int(rep[h]))
    for n, cpu_in in incoming_cpu.items():
        m.add(sum(cpu_in) <= int(cap.cpu_free[n]))
        m.add(sum(incoming_mem[n]) <= int(cap.mem_free[n]))
    freed = []
    for g, holders in by_dev.items():
        if any(r.key not in moved_of for r in holders):
            continue
        f = m.new_bool_var(f"free{g}")
        for r in holders:
            m.add_implication(f, moved_of[r.key])
        if incoming_n.get(g):
            m.add(sum(incoming_n[g]) == 0).only_enforce_if(f)
        freed.append((f, g))
    if limits.max_moves is not None:
        m.add(sum(mv for mv, _ in moved) <= limits.max_moves)
    if limits.max_per_namespace is not None:
        for terms in per_ns.values():
            m.add(sum(terms) <= limits.max_per_namespace)
    if limits.max_per_node is not None:
        for terms in per_node.values():
            m.add(sum(terms) <= limits.max_per_node)
    if not freed:
        return DefragPlan([], [], "NOTHING_TO_FREE", 0, time.perf_counter() - start, free_before)
    W = (len(moved) + 1) * 2
    max_prio = max((r.priority for _, r in moved), default=0)
    # one goal: GPUs freed weigh more than all moves together; moves cost 2, plus 1 when the pod
    # is of the highest priority among the movable ones
    goal = W * sum(f for f, _ in freed) - sum(
        (2 + (1 if r.priority >= max_prio and max_prio > 0 else 0)) * mv for mv, r in moved
    )
    result = staged_solve(
        m,
        [Stage("freed", goal, maximize=True, least=0.0)],
        time.perf_counter() + time_limit,
        variables=[*x.values(), *(f for f, _ in freed)],
        settings=Settings(num_workers),
    )
    stage = result.stages[0]
    values = result.values
    if not stage.solved or values is None:
        return DefragPlan([], [], stage.status, 0, time.perf_counter() - start, free_before)
    moves = []
    for (i, h), v in x.items():
        if values[v.index]:
            res, g = movable[i]
            moves.append(
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
    # a moved pod whose GPU is not freed would be a wasted move; the objective never wants one
    moves.sort(key=lambda mv: (mv.from_node, mv.from_device, mv.pod))
    return DefragPlan(
        moves,
        sorted((a.devices[g].node, a.devices[g].device_id) for f, g in freed if values[f.index]),
        stage.status,
        int(stage.bound // W),
        time.perf_counter() - start,
        free_before,
    )
