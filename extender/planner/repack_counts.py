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

import numpy as np
from ortools.sat.python import cp_model

from extender.demand import Demand
from extender.planner.capacity import Capacity, demand_kind
from extender.planner.move_model import device_fits, gcd_all, need_bytes, reservation_for
from extender.planner.repack_plan import Move, RepackPlan, by_pod, final_state_fits
from extender.planner.repack_pool import Pool
from extender.planner.staged import Settings, Stage, staged_solve

__all__ = ["CountModel", "solve_counts"]

Kind = tuple[object, ...]


def _eligible(cap: Capacity, d: Demand, free: np.ndarray, rep_free: np.ndarray) -> np.ndarray:
    """Device rows where one more pod of `d` could be in the final state (given what leaving
    movers give back: `free` and `rep_free` count it)."""
    need = need_bytes(cap, d)
    ok = device_fits(cap, d, need)
    ok &= (free >= need) & (rep_free >= 1)
    return ok


class CountModel:
    """The count model of one search (see the module docstring): built on construction, then
    `moves` (the goal), `variables()` for the solver and `read_back(values)`. `feasible` is
    False when no node could ever take the pod."""

    def __init__(self, cap: Capacity, pod: Demand, pool: Pool, limit: int) -> None:
        self.cap, self.pod, self.pool = cap, pod, pool
        self.model = cp_model.CpModel()
        a = cap.arrays
        self.free = (a.capacity - a.used).astype(np.int64)
        self.rep_free = (a.replicas - a.used_replicas).astype(np.int64)
        self._group_movers()
        self.out: dict[tuple[Kind, int], cp_model.IntVar] = {}
        self.into: dict[tuple[Kind, int], cp_model.IntVar] = {}
        self.z: dict[int, cp_model.IntVar] = {}
        self.y: dict[int, cp_model.IntVar] = {}
        self._kind_variables()
        self._pod_variables()
        self.feasible = bool(self.y)
        if not self.feasible:
            return
        self._device_constraints()
        self._node_constraints()
        self.moves: cp_model.LinearExprT | int = sum(self.out.values()) if self.out else 0
        if not isinstance(self.moves, int):
            self.model.add(self.moves <= limit)

    def _group_movers(self) -> None:
        """One-GPU movers by kind (demand and priority) and the device they hold, and what each
        device could have free if every mover on it left."""
        pool = self.pool
        self.groups: dict[tuple[Kind, int], list[int]] = defaultdict(list)
        self.kinds: dict[Kind, Demand] = {}
        for j in np.flatnonzero(np.diff(pool.estart) == 1).tolist():
            d = pool.demands[j]
            if d.gpu_count != 1:
                continue
            kind: Kind = (*demand_kind(d), d.priority)
            self.groups[kind, int(pool.erow[pool.estart[j]])].append(j)
            self.kinds.setdefault(kind, d)
        self.back_b, self.back_n = self.free.copy(), self.rep_free.copy()
        for (_, r), js in self.groups.items():
            self.back_b[r] += sum(int(pool.ebytes[pool.estart[j]]) for j in js)
            self.back_n[r] += len(js)

    def _kind_variables(self) -> None:
        """`out[t, r]`, `into[t, r]`, and per kind as many landing as leaving."""
        a, m, pool = self.cap.arrays, self.model, self.pool
        self.held: dict[tuple[Kind, int], int] = {}
        count: dict[Kind, int] = defaultdict(int)
        for (kind, r), js in self.groups.items():
            self.out[kind, r] = m.new_int_var(0, len(js), f"out{len(self.out)}")
            self.held[kind, r] = int(pool.ebytes[pool.estart[js[0]]])
            count[kind] += len(js)
        self.need_of = {kind: need_bytes(self.cap, d) for kind, d in self.kinds.items()}
        for kind, d in self.kinds.items():
            for r in np.flatnonzero(_eligible(self.cap, d, self.back_b, self.back_n)).tolist():
                ub = min(count[kind], int(a.replicas[r]))
                self.into[kind, r] = m.new_int_var(0, ub, f"in{len(self.into)}")
            leaving = [v for (t, _), v in self.out.items() if t == kind]
            landing = [v for (t, _), v in self.into.items() if t == kind]
            m.add(sum(landing) == sum(leaving))

    def _pod_variables(self) -> None:
        """`z[r]` (the pod on device r) and `y[n]` (on node n): k devices of one node."""
        a, m, pod = self.cap.arrays, self.model, self.pod
        rows_by_node: dict[int, list[int]] = defaultdict(list)
        for r in np.flatnonzero(_eligible(self.cap, pod, self.back_b, self.back_n)).tolist():
            rows_by_node[int(a.node_of[r])].append(r)
        for n, rows in rows_by_node.items():
            if len(rows) < pod.gpu_count:
                continue
            self.y[n] = m.new_bool_var(f"y{n}")
            for r in rows:
                self.z[r] = m.new_bool_var(f"z{r}")
            m.add(sum(self.z[r] for r in rows) == pod.gpu_count * self.y[n])
        if self.y:
            m.add(sum(self.y.values()) == 1)

    def _device_constraints(self) -> None:
        """Per device: bytes and replicas landed, minus given back, plus the pod's, fit."""
        terms_b: dict[int, list[tuple[int, cp_model.IntVar]]] = defaultdict(list)
        terms_n: dict[int, list[tuple[int, cp_model.IntVar]]] = defaultdict(list)
        pod_need = need_bytes(self.cap, self.pod)
        for (kind, r), v in self.into.items():
            terms_b[r].append((int(self.need_of[kind][r]), v))
            terms_n[r].append((1, v))
        for (kind, r), v in self.out.items():
            terms_b[r].append((-self.held[kind, r], v))
            terms_n[r].append((-1, v))
        for r, v in self.z.items():
            terms_b[r].append((int(pod_need[r]), v))
            terms_n[r].append((1, v))
        g = gcd_all(abs(c) for t in terms_b.values() for c, _ in t)
        for r, t in terms_b.items():
            self.model.add(sum((c // g) * v for c, v in t) <= int(self.free[r]) // g)
        for r, t in terms_n.items():
            self.model.add(sum(c * v for c, v in t) <= int(self.rep_free[r]))

    def _node_constraints(self) -> None:
        """Per node: CPU and memory landed, minus given back, plus the pod's, fit."""
        node_of = self.cap.arrays.node_of
        for amount, room in ((_cpu, self.cap.cpu_free), (_mem, self.cap.mem_free)):
            per_node: dict[int, list[tuple[int, cp_model.IntVar]]] = defaultdict(list)
            for (kind, r), v in self.into.items():
                per_node[int(node_of[r])].append((amount(self.kinds[kind]), v))
            for (kind, r), v in self.out.items():
                per_node[int(node_of[r])].append((-amount(self.kinds[kind]), v))
            for n, v in self.y.items():
                per_node[n].append((amount(self.pod), v))
            per_node = {n: [(c, v) for c, v in t if c] for n, t in per_node.items()}
            g = gcd_all(abs(c) for t in per_node.values() for c, _ in t)
            for n, t in per_node.items():
                if t:
                    self.model.add(sum((c // g) * v for c, v in t) <= int(room[n]) // g)

    def variables(self) -> list[cp_model.IntVar]:
        return [*self.out.values(), *self.into.values(), *self.z.values()]

    def read_back(self, values: Mapping[int, int], status: str) -> RepackPlan | None:
        """The plan of a solution, or None when it does not pass `final_state_fits`."""
        a, pod = self.cap.arrays, self.pod
        rows = sorted(r for r, v in self.z.items() if values[v.index])
        placement = reservation_for(self.cap, pod, int(a.node_of[rows[0]]), rows)
        moves = _moves(self.cap, self.pool, self.groups, self.out, self.into, values)
        plan = RepackPlan(pod, placement, moves, status, False, 0)
        return plan if final_state_fits(self.cap, plan) else None


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
    if pod.gpu_count == 0:
        return None, "NOT_APPLICABLE"
    cm = CountModel(cap, pod, pool, limit)
    if not cm.feasible:
        return None, "INFEASIBLE"
    result = staged_solve(
        cm.model,
        [Stage("moves", cm.moves, least=0.02)],
        deadline,
        variables=cm.variables(),
        settings=Settings(num_workers=num_workers, random_seed=0, light_presolve=True),
    )
    status = result.stages[0].status if result.stages else result.status
    if status == "CONSTANT":  # no pod to move: the one solve's own status says if it fits
        status = "OPTIMAL" if result.values is not None else result.status
    if result.values is None:
        return None, status
    plan = cm.read_back(result.values, status)
    return (plan, status) if plan is not None else (None, "READBACK_INVALID")


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
