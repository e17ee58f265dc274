"""Pods moving to devices, in CP-SAT: the variables and the capacity constraints, once.

Two planners move running pods: `repack` (the fewest moves that make a blocked pod fit) and
`defrag` (the fewest moves that free the most whole GPUs). Both decide, for some pods
(*movers*), whether each moves and to which devices of which node, under the same capacity
rules; this module builds exactly that part, and each planner adds its own goal on top.

Variables, per mover i:
- `x[i, h]`: mover i lands on device row h (one per device it could use; a k-GPU pod takes k
  distinct devices of one node: `sum_h∈n x[i, h] == k * y[i, n]`);
- `y[i, n]`: mover i lands on node n (for a one-GPU pod, the sum of its `x` on n; for a GPU-less
  pod, a variable of its own);
- `placed[i]`: mover i is placed somewhere (`sum_n y[i, n]`): for a running pod, "it moves"; for
  the pod to place, it is fixed to 1.

Capacity, per device and per node of the model, in one of two senses:
- `release=True` (repack): the plan's *final state* must fit: a mover that moves gives back what
  it holds where it runs now, and the devices and nodes may be refilled by other movers. Valid
  when every moved pod is evicted before any is placed again (the live executor's order).
- `release=False` (defrag): every move's target must have room *now*, without counting what
  other moves give back, so the moves can run one by one in any order.

Device memory, replicas, node CPU and node memory are hard constraints; a mover only gets
variables on devices of its resource and allowed products, big enough for it (a whole-device pod
takes the device's per-pod cap, as `capacity.candidates`), on nodes whose CPU and memory could
ever hold it. Coefficients are divided by their gcd per resource (bytes, millicores), and each
right-hand side rounded down accordingly: exact for integer plans, and a tighter LP for CP-SAT.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from math import gcd

import numpy as np
from ortools.sat.python import cp_model

from extender.demand import Demand
from extender.ledger import Reservation
from extender.planner.capacity import Capacity

__all__ = [
    "Mover",
    "MoveModel",
    "Restrict",
    "device_fits",
    "gcd_all",
    "need_bytes",
    "reservation_for",
]

#: an extra filter on a mover's candidate device rows: (mover index, rows) -> mask of rows kept
Restrict = Callable[[int, np.ndarray], np.ndarray]


@dataclass(frozen=True)
class Mover:
    """A pod the model may (re)place: where it runs now (`node` None: not placed yet, the pod
    to place) and on which device rows, with the bytes it holds on each."""

    demand: Demand
    node: int | None = None
    rows: tuple[int, ...] = ()
    held: tuple[int, ...] = ()
    required: bool = False


def need_bytes(cap: Capacity, demand: Demand) -> np.ndarray:
    """Bytes the pod takes on each device row: its declared share, or the device's per-pod cap
    for a whole-device pod (as `capacity.candidates` and the ledger's reservations)."""
    a = cap.arrays
    if demand.bytes_per_gpu is None:
        return a.per_pod_cap.astype(np.int64)
    return np.full(len(a.capacity), demand.bytes_per_gpu, np.int64)


def device_fits(cap: Capacity, demand: Demand, need: np.ndarray) -> np.ndarray:
    """Device rows that could ever hold one pod of `demand` taking `need` bytes there: its
    resource and allowed products, a per-pod cap and memory that big, a replica. A new array."""
    a = cap.arrays
    ok: np.ndarray = cap.matches(demand.resource, demand.allowed_products) & (a.per_pod_cap >= need)
    ok &= (a.capacity >= need) & (a.replicas >= 1)
    return ok


def reservation_for(cap: Capacity, demand: Demand, node: int, rows: Iterable[int]) -> Reservation:
    """The reservation of `demand` on device `rows` of node row `node` (no rows: a GPU-less pod,
    a reservation that only names its node)."""
    a = cap.arrays
    ordered = sorted(int(r) for r in rows)
    need = need_bytes(cap, demand)
    return Reservation(
        pod=demand.pod,
        node=a.node_names[node],
        device_ids=tuple(a.devices[r].device_id for r in ordered),
        bytes_per_device=tuple(int(need[r]) for r in ordered),
        priority=demand.priority,
        declared=demand.bytes_per_gpu is not None,
    )


def gcd_all(values: Iterable[int]) -> int:
    """The gcd of `values` (1 when empty or all zero): the unit coefficients are divided by."""
    g = 0
    for v in values:
        g = gcd(g, int(v))
        if g == 1:
            break
    return g or 1


class MoveModel:
    """The movers' variables and capacity constraints on the node rows `nodes` (movers land only
    there; every mover's current node must be one of them). Build, then read `placed`, `x`,
    `y`, add a goal, solve with `staged.staged_solve(model.model, ..., variables=decisions())`,
    and read each mover's landing back with `landing(values, i)`."""

    def __init__(
        self,
        cap: Capacity,
        nodes: Sequence[int],
        movers: Sequence[Mover],
        *,
        release: bool = True,
        restrict: Restrict | None = None,
        model: cp_model.CpModel | None = None,
    ) -> None:
        self.cap = cap
        self.movers = list(movers)
        self.release = release
        self.model = model or cp_model.CpModel()
        a = cap.arrays
        self.nodes = np.asarray(sorted({int(n) for n in nodes}), np.int64)
        in_model = np.zeros(len(a.node_names), bool)
        in_model[self.nodes] = True
        free = (a.capacity - a.used).astype(np.int64)
        rep_free = (a.replicas - a.used_replicas).astype(np.int64)
        # what the movers give back where they run now (the final-state sense only)
        rel_b: dict[int, int] = defaultdict(int)
        rel_n: dict[int, int] = defaultdict(int)
        rel_cpu: dict[int, int] = defaultdict(int)
        rel_mem: dict[int, int] = defaultdict(int)
        self.on_device: dict[int, list[int]] = defaultdict(list)
        self.on_node: dict[int, list[int]] = defaultdict(list)
        for i, mv in enumerate(self.movers):
            if mv.node is None:
                continue
            self.on_node[mv.node].append(i)
            rel_cpu[mv.node] += mv.demand.cpu_milli
            rel_mem[mv.node] += mv.demand.memory_bytes
            for r, b in zip(mv.rows, mv.held):
                self.on_device[r].append(i)
                rel_b[r] += b
                rel_n[r] += 1
        m = self.model
        self.x: dict[tuple[int, int], cp_model.IntVar] = {}
        self.y: dict[tuple[int, int], cp_model.LinearExprT] = {}
        self.y_vars: dict[tuple[int, int], cp_model.IntVar] = {}
        self.placed: list[cp_model.IntVar] = []
        #: per device row, the movers that may land there; per node row, (mover, y) pairs
        self._by_row: dict[int, list[int]] = defaultdict(list)
        self._rows_of: dict[int, list[int]] = defaultdict(list)
        self._by_node: dict[int, list[tuple[int, cp_model.LinearExprT]]] = defaultdict(list)
        self._need: list[np.ndarray] = []
        cpu_free, mem_free = cap.cpu_free, cap.mem_free
        n_rel_cpu = np.zeros(len(a.node_names), np.int64)
        n_rel_mem = np.zeros(len(a.node_names), np.int64)
        d_rel_b = np.zeros(len(a.capacity), np.int64)
        d_rel_n = np.zeros(len(a.capacity), np.int64)
        if release:
            for n, v in rel_cpu.items():
                n_rel_cpu[n] = v
            for n, v in rel_mem.items():
                n_rel_mem[n] = v
            for r, v in rel_b.items():
                d_rel_b[r] = v
            for r, v in rel_n.items():
                d_rel_n[r] = v
        for i, mv in enumerate(self.movers):
            d = mv.demand
            k = d.gpu_count
            need = need_bytes(cap, d)
            self._need.append(need)
            host = in_model & (cpu_free + n_rel_cpu >= d.cpu_milli)
            host &= mem_free + n_rel_mem >= d.memory_bytes
            if not release and mv.node is not None:
                host &= (cpu_free >= d.cpu_milli) & (mem_free >= d.memory_bytes)
                host[mv.node] = in_model[mv.node]  # a move within its node takes nothing new
            placed = m.new_bool_var(f"placed{i}")
            self.placed.append(placed)
            terms: list[cp_model.LinearExprT] = []
            if k == 0:
                for n in np.flatnonzero(host).tolist():
                    yv0 = m.new_bool_var(f"y{i}_{n}")
                    self.y[i, n] = self.y_vars[i, n] = yv0
                    terms.append(yv0)
            else:
                ok = device_fits(cap, d, need) & host[a.node_of]
                ok &= (free + d_rel_b >= need) & (rep_free + d_rel_n >= 1)
                rows = np.flatnonzero(ok)
                if restrict is not None and len(rows):
                    rows = rows[restrict(i, rows)]
                by_node: dict[int, list[int]] = defaultdict(list)
                for r in rows.tolist():
                    by_node[int(a.node_of[r])].append(r)
                for n, rs in by_node.items():
                    if len(rs) < k:
                        continue
                    xs = []
                    for r in rs:
                        xv = m.new_bool_var(f"x{i}_{r}")
                        self.x[i, r] = xv
                        self._by_row[r].append(i)
                        self._rows_of[i].append(r)
                        xs.append(xv)
                    if k == 1:
                        self.y[i, n] = xs[0] if len(xs) == 1 else sum(xs)
                        terms.extend(xs)
                    else:
                        yv = m.new_bool_var(f"y{i}_{n}")
                        m.add(sum(xs) == k * yv)
                        self.y[i, n] = self.y_vars[i, n] = yv
                        terms.append(yv)
            m.add(sum(terms) == placed)
            if mv.required:
                m.add(placed == 1)
        for (i, n), yn in self.y.items():
            if release or self.movers[i].node != n:
                self._by_node[n].append((i, yn))
        self._device_constraints(free, rep_free)
        self._node_constraints(cpu_free, "cpu")
        self._node_constraints(mem_free, "mem")

    def _device_constraints(self, free: np.ndarray, rep_free: np.ndarray) -> None:
        m = self.model
        coeffs = [int(self._need[i][r]) for (i, r) in self.x]
        if self.release:
            coeffs += [b for mv in self.movers for b in mv.held]
        g = gcd_all(coeffs)
        for r, movers in self._by_row.items():
            terms_b: list[cp_model.LinearExprT] = [
                (int(self._need[i][r]) // g) * self.x[i, r] for i in movers
            ]
            terms_n: list[cp_model.LinearExprT] = [self.x[i, r] for i in movers]
            if self.release:
                for i in self.on_device.get(r, ()):
                    mv = self.movers[i]
                    held = mv.held[mv.rows.index(r)]
                    terms_b.append(-(held // g) * self.placed[i])
                    terms_n.append(-self.placed[i])
            m.add(sum(terms_b) <= int(free[r]) // g)
            m.add(sum(terms_n) <= int(rep_free[r]))

    def _node_constraints(self, free: np.ndarray, what: str) -> None:
        def amount(d: Demand) -> int:
            return d.cpu_milli if what == "cpu" else d.memory_bytes

        incoming = {
            n: [(amount(self.movers[i].demand), yn) for i, yn in pairs]
            for n, pairs in self._by_node.items()
        }
        incoming = {n: [(c, yn) for c, yn in t if c] for n, t in incoming.items()}
        coeffs = [c for terms in incoming.values() for c, _ in terms]
        if self.release:
            coeffs += [amount(mv.demand) for mv in self.movers if mv.node is not None]
        g = gcd_all(coeffs)
        for n, terms in incoming.items():
            if not terms:
                continue
            expr: list[cp_model.LinearExprT] = [(c // g) * yn for c, yn in terms]
            if self.release:
                for i in self.on_node.get(n, ()):
                    c = amount(self.movers[i].demand)
                    if c:
                        expr.append(-(c // g) * self.placed[i])
            self.model.add(sum(expr) <= int(free[n]) // g)

    # ----- reading ------------------------------------------------------------------------
    def decisions(self) -> list[cp_model.IntVar]:
        """Every variable a plan is read from (for `staged_solve(variables=...)`)."""
        return [*self.x.values(), *self.y_vars.values(), *self.placed]

    def incoming(self, row: int) -> list[cp_model.IntVar]:
        """The variables of movers landing on device `row`."""
        return [self.x[i, row] for i in self._by_row.get(row, ())]

    def landing(self, values: Mapping[int, int], i: int) -> tuple[int, tuple[int, ...]] | None:
        """Where mover i lands in a solution: (node row, device rows ascending), None if it is
        not placed."""
        if not values[self.placed[i].index]:
            return None
        rows = tuple(sorted(r for r in self._rows_of.get(i, ()) if values[self.x[i, r].index]))
        if rows:
            return int(self.cap.arrays.node_of[rows[0]]), rows
        for (ii, n), yv in self.y_vars.items():
            if ii == i and values[yv.index]:
                return n, ()
        return None

    def stays(self, i: int, landing: tuple[int, tuple[int, ...]] | None) -> bool:
        """Whether a landing is where mover i already runs (not a move)."""
        mv = self.movers[i]
        return (
            landing is not None and mv.node == landing[0] and tuple(sorted(mv.rows)) == landing[1]
        )
