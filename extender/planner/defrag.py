"""Defragmentation plan (dry run): the fewest pod moves that free the most whole GPUs.

A GPU is *freed* when every pod on it moves away and none moves onto it. Goals, lexicographic:
most GPUs freed, then fewest moves (then lowest priority moved). Safety: a move's target must
have room *now*, without counting memory that other moves would release, so the moves can be
carried out one by one in any order (evict, the pod is recreated and lands on its target) and
the ledger never overcommits in between. Disruption limits stand in for PodDisruptionBudgets:
at most N moves in total, per namespace, per node, and namespaces that must not be touched.
Only pods holding a declared share of one GPU (`vramsched.io/model-memory`, one GPU) move, and
only to a GPU of the same product; a pod holding whole devices or several GPUs stays where it is.

The variables "pod i lands on device h" and the capacity rules are `move_model.MoveModel`'s, in
its room-now sense (`release=False`), the same model `repack` builds in its final-state sense.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
from ortools.sat.python import cp_model

from extender.demand import Demand
from extender.ledger import Reservation
from extender.planner import clock
from extender.planner.capacity import Capacity
from extender.planner.move_model import MoveModel, Mover
from extender.planner.staged import Settings, Stage, staged_solve

__all__ = ["Limits", "Move", "DefragPlan", "plan_defrag"]


@dataclass(frozen=True)
class Limits:
    max_moves: int | None = None
    max_per_namespace: int | None = None
    max_per_node: int | None = None
    exclude_namespaces: frozenset[str] = frozenset()
    #: pods that must stay where they are (keys)
    exclude_pods: frozenset[str] = frozenset()


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


def _movers(
    cap: Capacity,
    demands: Mapping[str, tuple[int, int, str | None]],
    limits: Limits,
) -> tuple[list[Mover], list[Reservation], dict[int, list[str]]]:
    """The pods that may move (one declared share of one GPU, namespace not excluded) as the
    model's movers, their reservations, and per device row the pods holding it."""
    ledger, a = cap.ledger, cap.arrays
    holders: dict[int, list[str]] = defaultdict(list)
    movers: list[Mover] = []
    sources: list[Reservation] = []
    for res in ledger.reservations():
        rows = [ledger.row(res.node, d) for d in res.device_ids]
        for g in rows:
            if g is not None:
                holders[g].append(res.key)
        n = ledger.node_row(res.node)
        if (
            len(rows) != 1
            or rows[0] is None
            or n is None
            or not res.declared
            or res.pod.namespace in limits.exclude_namespaces
            or res.key in limits.exclude_pods
        ):
            continue
        g = rows[0]
        cpu, mem, resource = demands.get(res.key, (0, 0, None))
        d = Demand(
            res.pod,
            1,
            res.bytes_per_device[0],
            resource=resource or a.devices[g].resource,
            priority=res.priority,
            cpu_milli=cpu,
            memory_bytes=mem,
        )
        movers.append(Mover(d, n, (g,), res.bytes_per_device))
        sources.append(res)
    return movers, sources, holders


def plan_defrag(
    cap: Capacity,
    demands: Mapping[str, tuple[int, int, str | None]],
    limits: Limits = Limits(),
    *,
    time_limit: float = 10.0,
    num_workers: int = 2,
    node_mask: Callable[[str], np.ndarray | None] | None = None,
) -> DefragPlan:
    """`demands` maps pod key -> (cpu milli, memory bytes, resource) of every bound pod we hold.
    `node_mask(key)`: per node row, whether kube-scheduler would let that pod's new copy onto the
    node (None: every node)."""
    start = clock.now()
    a = cap.arrays
    free_before = int((a.used_replicas == 0).sum())
    movers, sources, holders = _movers(cap, demands, limits)

    def restrict(i: int, rows: np.ndarray) -> np.ndarray:
        """The same GPU product (the pod may depend on it), never the device it is on, and only
        nodes `node_mask` allows."""
        g = movers[i].rows[0]
        kept: np.ndarray = (a.product_id[rows] == a.product_id[g]) & (rows != g)
        mask = node_mask(movers[i].demand.pod.key) if node_mask is not None else None
        if mask is not None:
            kept &= mask[a.node_of[rows]]
        return kept

    mm = MoveModel(cap, range(len(a.node_names)), movers, release=False, restrict=restrict)
    m = mm.model
    moved_of = {mv.demand.pod.key: mm.placed[i] for i, mv in enumerate(movers)}
    freed: list[tuple[cp_model.IntVar, int]] = []
    for g, keys in holders.items():
        if any(k not in moved_of for k in keys):
            continue
        f = m.new_bool_var(f"free{g}")
        for k in keys:
            m.add_implication(f, moved_of[k])
        incoming = mm.incoming(g)
        if incoming:
            m.add(sum(incoming) == 0).only_enforce_if(f)
        freed.append((f, g))
    if not freed:
        return DefragPlan([], [], "NOTHING_TO_FREE", 0, clock.now() - start, free_before)
    per_ns: dict[str, list[cp_model.IntVar]] = defaultdict(list)
    per_node: dict[str, list[cp_model.IntVar]] = defaultdict(list)
    for i, res in enumerate(sources):
        per_ns[res.pod.namespace].append(mm.placed[i])
        per_node[res.node].append(mm.placed[i])
    if limits.max_moves is not None:
        m.add(sum(mm.placed) <= limits.max_moves)
    if limits.max_per_namespace is not None:
        for terms in per_ns.values():
            m.add(sum(terms) <= limits.max_per_namespace)
    if limits.max_per_node is not None:
        for terms in per_node.values():
            m.add(sum(terms) <= limits.max_per_node)
    # one goal, lexicographic by its weights: a move costs `per_move`, which outweighs the +1 of
    # every pod of the highest priority moved (there are fewer than `per_move`), and a GPU freed
    # is worth `W`, more than every move together
    max_prio = max((r.priority for r in sources), default=0)
    per_move = len(movers) + 1
    most = len(movers) * (per_move + 1)  # every pod moved, each of the highest priority
    W = most + 1
    goal = W * sum(f for f, _ in freed) - sum(
        (per_move + (1 if r.priority >= max_prio and max_prio > 0 else 0)) * mm.placed[i]
        for i, r in enumerate(sources)
    )
    result = staged_solve(
        m,
        [Stage("freed", goal, maximize=True, least=0.0)],
        clock.now() + time_limit,
        variables=[*mm.decisions(), *(f for f, _ in freed)],
        settings=Settings(num_workers),
    )
    stage = result.stages[0]
    values = result.values
    if not stage.solved or values is None:
        return DefragPlan([], [], stage.status, 0, clock.now() - start, free_before)
    moves = []
    for i, res in enumerate(sources):
        landing = mm.landing(values, i)
        if landing is None:
            continue
        g, h = movers[i].rows[0], landing[1][0]
        moves.append(
            Move(
                res.key,
                res.node,
                a.devices[g].device_id,
                a.node_names[landing[0]],
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
        int((stage.bound + most) // W),  # the moves' cost is 0 to `most`, under W
        clock.now() - start,
        free_before,
    )
