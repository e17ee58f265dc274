"""Repacking a small cluster by counts: how many pods of each kind leave and land on each
device, not which pod goes where.

Why: on a full cluster of mixed pools the moves that unblock a pod form a cycle through full
nodes (a model leaves a time-sliced GPU for an exclusive one, whose pod takes an MPS share, whose
pod joins the blocked one), which only a model of the whole cluster finds. With one variable per
pod and device (`repack_model`, `MoveModel`) that model has about 21,000 booleans for 250
movable pods on 18 nodes, and CP-SAT needs seconds to find its plans. One-GPU pods of one kind
(same demand and priority) on one device are interchangeable, so counting them per kind and
device states the same problem for them in far fewer variables. Multi-GPU and GPU-less pods stay
where they are here; the per-pod model is the one that moves them.

Model, in the final-state sense of `MoveModel(release=True)` (every moved pod evicted before any
is placed): per kind t and device r, `out[t, r]` (0 .. pods of t on r) leave r and `into[t, r]`
land on r (only where t may run); per kind as many land as leave; the pod takes k devices of one
node (`z[r]`, `y[n]`); per device, bytes and replicas landed minus given back, plus the pod's,
fit in what is free; per node, CPU and memory likewise. Goal: fewest pods leaving, at most
`limit`. Coefficients are divided by their gcd (exact for integer plans).

Read-back: the pods of a kind leaving a device are taken in pod-key order, one that would land
back on its own device stays, the others go to the devices where their kind lands; the plan must
pass `final_state_fits`, as every plan of the search does."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from math import gcd

import numpy as np
from ortools.sat.python import cp_model

from extender.demand import Demand
from extender.planner.capacity import Capacity, demand_kind
from extender.planner.move_model import need_bytes, reservation_for
from extender.planner.repack_plan import Move, RepackPlan, by_pod, final_state_fits
from extender.planner.repack_pool import Pool
from extender.planner.staged import Settings, Stage, staged_solve

__all__ = ["solve_counts"]

Kind = tuple[object, ...]


def _eligible(cap: Capacity, d: Demand, free: np.ndarray, rep_free: np.ndarray) -> np.ndarray:
    """Device rows where one more pod of `d` could be in the final state (given what leaving
    movers give back: `free` and `rep_free` count it)."""
    a = cap.arrays
    need = need_bytes(cap, d)
    # a new array: `matches` is cached per resource and products, never to be changed in place
    ok: np.ndarray = cap.matches(d.resource, d.allowed_products) & (a.per_pod_cap >= need)
    ok &= (a.capacity >= need) & (a.replicas >= 1)
    ok &= (free >= need) & (rep_free >= 1)
    return ok


def solve_counts(
    cap: Capacity,
    pod: Demand,
    pool: Pool,
    limit: int,
    deadline: float,
    num_workers: int,
) -> tuple[RepackPlan | None, str]:
    """The fewest moves of one-GPU movable pods that make `pod` fit, over the whole cluster
    (see the module docstring): the plan (None: none found) and CP-SAT's status."""
    a = cap.arrays
    if pod.gpu_count == 0:
        return None, "NOT_APPLICABLE"
    # one-GPU movers, grouped by kind and the device they hold
    groups: dict[tuple[Kind, int], list[int]] = defaultdict(list)
    kinds: dict[Kind, Demand] = {}
    per_device = np.diff(pool.estart)
    for j in np.flatnonzero(per_device == 1).tolist():
        d = pool.demands[j]
        if d.gpu_count != 1:
            continue
        kind: Kind = (*demand_kind(d), d.priority)
        groups[kind, int(pool.erow[pool.estart[j]])].append(j)
        kinds.setdefault(kind, d)
    free = (a.capacity - a.used).astype(np.int64)
    rep_free = (a.replicas - a.used_replicas).astype(np.int64)
    back_b = free.copy()  # what a device could have free if every mover on it left
    back_n = rep_free.copy()
    for (_, r), js in groups.items():
        back_b[r] += sum(int(pool.ebytes[pool.estart[j]]) for j in js)
        back_n[r] += len(js)
    m = cp_model.CpModel()
    out: dict[tuple[Kind, int], cp_model.IntVar] = {}
    into: dict[tuple[Kind, int], cp_model.IntVar] = {}
    held: dict[tuple[Kind, int], int] = {}
    need_of: dict[Kind, np.ndarray] = {}
    count: dict[Kind, int] = defaultdict(int)
    for (kind, r), js in groups.items():
        out[kind, r] = m.new_int_var(0, len(js), f"out{len(out)}")
        held[kind, r] = int(pool.ebytes[pool.estart[js[0]]])
        count[kind] += len(js)
    for kind, d in kinds.items():
        need_of[kind] = need_bytes(cap, d)
        for r in np.flatnonzero(_eligible(cap, d, back_b, back_n)).tolist():
            ub = min(count[kind], int(a.replicas[r]))
            into[kind, r] = m.new_int_var(0, ub, f"in{len(into)}")
        leaving = [v for (t, _), v in out.items() if t == kind]
        landing = [v for (t, _), v in into.items() if t == kind]
        m.add(sum(landing) == sum(leaving))
    pod_need = need_bytes(cap, pod)
    z: dict[int, cp_model.IntVar] = {}
    y: dict[int, cp_model.IntVar] = {}
    rows_by_node: dict[int, list[int]] = defaultdict(list)
    for r in np.flatnonzero(_eligible(cap, pod, back_b, back_n)).tolist():
        rows_by_node[int(a.node_of[r])].append(r)
    for n, rows in rows_by_node.items():
        if len(rows) < pod.gpu_count:
            continue
        y[n] = m.new_bool_var(f"y{n}")
        for r in rows:
            z[r] = m.new_bool_var(f"z{r}")
        m.add(sum(z[r] for r in rows) == pod.gpu_count * y[n])
    if not y:
        return None, "INFEASIBLE"
    m.add(sum(y.values()) == 1)
    # per device: bytes and replicas
    terms_b: dict[int, list[tuple[int, cp_model.IntVar]]] = defaultdict(list)
    terms_n: dict[int, list[tuple[int, cp_model.IntVar]]] = defaultdict(list)
    for (kind, r), v in into.items():
        terms_b[r].append((int(need_of[kind][r]), v))
        terms_n[r].append((1, v))
    for (kind, r), v in out.items():
        terms_b[r].append((-held[kind, r], v))
        terms_n[r].append((-1, v))
    for r, v in z.items():
        terms_b[r].append((int(pod_need[r]), v))
        terms_n[r].append((1, v))
    g = _gcd([abs(c) for t in terms_b.values() for c, _ in t])
    for r, t in terms_b.items():
        m.add(sum((c // g) * v for c, v in t) <= int(free[r]) // g)
    for r, t in terms_n.items():
        m.add(sum(c * v for c, v in t) <= int(rep_free[r]))
    # per node: CPU and memory
    for amount, room in ((_cpu, cap.cpu_free), (_mem, cap.mem_free)):
        per_node: dict[int, list[tuple[int, cp_model.IntVar]]] = defaultdict(list)
        for (kind, r), v in into.items():
            per_node[int(a.node_of[r])].append((amount(kinds[kind]), v))
        for (kind, r), v in out.items():
            per_node[int(a.node_of[r])].append((-amount(kinds[kind]), v))
        for n, v in y.items():
            per_node[n].append((amount(pod), v))
        per_node = {n: [(c, v) for c, v in t if c] for n, t in per_node.items()}
        gn = _gcd([abs(c) for t in per_node.values() for c, _ in t])
        for n, t in per_node.items():
            if t:
                m.add(sum((c // gn) * v for c, v in t) <= int(room[n]) // gn)
    moves: cp_model.LinearExprT | int = sum(out.values()) if out else 0
    if not isinstance(moves, int):
        m.add(moves <= limit)
    variables = [*out.values(), *into.values(), *z.values()]
    result = staged_solve(
        m,
        [Stage("moves", moves, least=0.02)],
        deadline,
        variables=variables,
        settings=Settings(num_workers=num_workers, random_seed=0, light_presolve=True),
    )
    status = result.stages[0].status if result.stages else result.status
    if result.values is None:
        return None, status
    values = result.values
    rows = sorted(r for r, v in z.items() if values[v.index])
    placement = reservation_for(cap, pod, int(a.node_of[rows[0]]), rows)
    plan = RepackPlan(
        pod, placement, _moves(cap, pool, groups, out, into, values), status, False, 0
    )
    return (plan, status) if final_state_fits(cap, plan) else (None, "READBACK_INVALID")


def _moves(
    cap: Capacity,
    pool: Pool,
    groups: dict[tuple[Kind, int], list[int]],
    out: dict[tuple[Kind, int], cp_model.IntVar],
    into: dict[tuple[Kind, int], cp_model.IntVar],
    values: Mapping[int, int],
) -> tuple[Move, ...]:
    """Concrete moves from the counts: per kind, the leaving pods (pod-key order on each device)
    sent to the landing slots; a pod whose slot is its own device stays."""
    a = cap.arrays
    leaving: dict[Kind, list[tuple[int, int]]] = defaultdict(list)
    for (kind, r), v in out.items():
        js = sorted(groups[kind, r], key=lambda j: pool.demands[j].pod.key)
        leaving[kind] += [(j, r) for j in js[: values[v.index]]]
    slots: dict[Kind, list[int]] = defaultdict(list)
    for (kind, r), v in into.items():
        slots[kind] += [r] * values[v.index]
    moves: list[Move] = []
    for kind, gone in leaving.items():
        open_slots = list(slots[kind])
        going = []
        for j, r in gone:
            if r in open_slots:  # lands back where it is: it stays
                open_slots.remove(r)
            else:
                going.append(j)
        for j, r in zip(going, open_slots, strict=True):
            d = pool.demands[j]
            target = reservation_for(cap, d, int(a.node_of[r]), [r])
            moves.append(Move(d.pod, d, pool.sources[j], target))
    return tuple(sorted(moves, key=by_pod))


def _cpu(d: Demand) -> int:
    return d.cpu_milli


def _mem(d: Demand) -> int:
    return d.memory_bytes


def _gcd(values: list[int]) -> int:
    g = 0
    for v in values:
        g = gcd(g, v)
        if g == 1:
            break
    return g or 1
