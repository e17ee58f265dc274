"""An upper bound on the GPU memory any policy can allocate from a replay, moves or not.

In the fill protocol (pods arrive, stay, and a pod that finds no place is dropped) every policy,
with any number of migrations and knowing every arrival in advance, ends with some subset of the
arrived GPU pods placed at once. So no policy allocates more GPU memory than the best such
subset can hold, and a relaxation of that packing problem bounds every policy's result:

- **nodes** are grouped into classes (the same free CPU, free memory and GPUs); CPU and memory
  are summed per class, so a pod's CPU may be spread over the class's nodes;
- **GPUs** of one class and one device kind (resource, product, free memory) form an arc-flow
  graph (Valério de Carvalho's model of bin packing): each GPU is one unit of flow from state 0
  (nothing used) to state U (its memory, in units of the gcd of all sizes); a pod holding s
  units is an arc u -> u + s (a whole-device pod holds the device's per-pod cap), a unit of
  memory left free an arc u -> u + 1. Every real placement of pods on one GPU is such a path, so the per-GPU
  packing is kept whole, the one relaxation being that arcs are fractional (LP);
- a k-GPU pod takes k arcs of its class (its GPUs need not be on one node here);
- replicas are not counted (they only forbid plans);
- GPU-less pods are left out: they add no GPU memory and only take CPU and memory.

Every placement any policy can reach is a feasible point of this LP, so its optimum is an upper
bound on GPU memory allocated (solved with GLOP, OR-Tools' LP solver). With `placed`, the pods
a policy holds at the end must stay placed (the most any number of moves could add from there,
taking only pods that arrived). When a graph would have more than `max_states` states, sizes
are rounded down and free memory up, in coarser units: still a relaxation.
"""

from __future__ import annotations

import time
from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from math import gcd

import numpy as np
from ortools.linear_solver import pywraplp  # type: ignore[import-untyped]

from extender.demand import Demand
from extender.planner.capacity import Capacity, demand_kind
from extender.quantity import GIB

__all__ = ["AllocationBound", "allocation_bound", "status_name"]


@dataclass(frozen=True)
class AllocationBound:
    """`bytes`: no policy allocates more GPU memory (on top of pods bound before the replay);
    `demand_bytes`: the GPU memory all arrived GPU pods ask; `capacity_bytes`: the free GPU
    memory at the start; `status`: GLOP's (OPTIMAL, or the reason there is no bound)."""

    bytes: float
    demand_bytes: int
    capacity_bytes: int
    status: str
    seconds: float
    variables: int = 0

    def to_json(self) -> dict[str, object]:
        return {
            "boundBytes": round(self.bytes),
            "demandBytes": self.demand_bytes,
            "capacityBytes": self.capacity_bytes,
            "status": self.status,
            "seconds": round(self.seconds, 3),
            "variables": self.variables,
        }


def _gcd(values: Iterable[int]) -> int:
    g = 0
    for v in values:
        g = gcd(g, int(v))
    return g or 1


def allocation_bound(
    cap: Capacity,
    demands: Iterable[Demand],
    *,
    placed: Iterable[Demand] = (),
    max_states: int = 2000,
) -> AllocationBound:
    """The bound for pods `demands` arriving on `cap` (see the module docstring)."""
    start = time.perf_counter()
    a = cap.arrays
    free_dev = np.maximum(a.capacity - a.used, 0).astype(np.int64)
    pods = [d for d in demands if d.gpu_count > 0]
    counts = Counter(demand_kind(d) for d in pods)
    must = Counter(demand_kind(d) for d in placed if d.gpu_count > 0)
    first: dict[tuple[object, ...], Demand] = {}
    for d in pods:
        first.setdefault(demand_kind(d), d)
    kinds = list(counts)
    demand_bytes = 0
    for kind in kinds:
        d = first[kind]
        per = d.bytes_per_gpu
        if per is None:  # whole devices: the largest it could take
            ok = cap.matches(d.resource, d.allowed_products)
            per = int(a.per_pod_cap[ok].max(initial=0))
        demand_bytes += counts[kind] * d.gpu_count * per
    capacity_bytes = int(free_dev.sum())
    # node classes: free CPU, free memory, and the multiset of device kinds (free memory)
    dev_kind = list(
        zip(
            a.resource_id.tolist(),
            a.product_id.tolist(),
            free_dev.tolist(),
            a.per_pod_cap.tolist(),
            (a.replicas - a.used_replicas > 0).tolist(),
        )
    )
    DevKind = tuple[int, int, int, int, bool]
    classes: dict[tuple[int, int, tuple[tuple[DevKind, int], ...]], list[int]] = defaultdict(list)
    for n in range(len(a.node_names)):
        lo, hi = int(a.node_start[n]), int(a.node_start[n + 1])
        devs = tuple(sorted(Counter(dev_kind[lo:hi]).items()))
        classes[(int(cap.cpu_free[n]), int(cap.mem_free[n]), devs)].append(n)
    sizes = [first[k].bytes_per_gpu for k in kinds if first[k].bytes_per_gpu is not None]
    unit = _gcd([*(s for s in sizes if s), *(k[2] for k in set(dev_kind) if k[2])])
    biggest = int(free_dev.max(initial=0))
    if biggest // unit > max_states:  # coarser units, sizes down and memory up: a relaxation
        unit = -(-biggest // max_states)

    solver = pywraplp.Solver.CreateSolver("GLOP")
    if solver is None:
        return AllocationBound(math_nan(), demand_bytes, capacity_bytes, "NO GLOP", 0.0)
    inf = solver.infinity()
    taken: dict[tuple[object, ...], list[pywraplp.Variable]] = defaultdict(list)
    objective = solver.Objective()
    n_vars = 0
    rid_of = a.resources
    pid_ok: dict[tuple[object, ...], set[int]] = {}
    for kind in kinds:
        d = first[kind]
        m = cap.matches(d.resource, d.allowed_products)
        pid_ok[kind] = set(a.product_id[m].tolist())
    # rows in cores and GiB, the objective in GiB: GLOP's tolerances are absolute
    for (cpu, mem, devs), members in classes.items():
        n_nodes = len(members)
        cpu_row = solver.Constraint(-inf, cpu / 1000 * n_nodes if cpu < 1 << 49 else inf)
        mem_row = solver.Constraint(-inf, mem / GIB * n_nodes if mem < 1 << 59 else inf)
        for (rid, pid, free, ppc, has_rep), per_node in devs:
            if not has_rep or free <= 0:
                continue
            gpus = per_node * n_nodes
            top = -(-free // unit)  # memory rounded up
            fits = []
            for kind in kinds:
                d = first[kind]
                if (
                    rid_of.get(d.resource) != rid
                    or pid not in pid_ok[kind]
                    or d.gpu_count > per_node
                    or d.cpu_milli > cpu
                    or d.memory_bytes > mem
                ):
                    continue
                need = ppc if d.bytes_per_gpu is None else d.bytes_per_gpu
                if need > min(ppc, free) or need <= 0:
                    continue
                fits.append((kind, d, need))
            if not fits:
                continue
            # arc-flow over states 0..top: arcs per size, and loss arcs
            arcs: dict[int, list[pywraplp.Variable]] = defaultdict(list)
            into: list[list[pywraplp.Variable]] = [[] for _ in range(top + 1)]
            out_of: list[list[pywraplp.Variable]] = [[] for _ in range(top + 1)]
            for s in sorted({max(1, need // unit) for _, _, need in fits}):
                for u in range(0, top - s + 1):
                    v = solver.NumVar(0, inf, "")
                    arcs[s].append(v)
                    out_of[u].append(v)
                    into[u + s].append(v)
                    n_vars += 1
            for u in range(top):
                v = solver.NumVar(0, inf, "")
                out_of[u].append(v)
                into[u + 1].append(v)
                n_vars += 1
            src = solver.Constraint(gpus, gpus)
            for v in out_of[0]:
                src.SetCoefficient(v, 1)
            for u in range(1, top):
                row = solver.Constraint(0, 0)
                for v in into[u]:
                    row.SetCoefficient(v, 1)
                for v in out_of[u]:
                    row.SetCoefficient(v, -1)
            by_size: dict[int, pywraplp.Constraint] = {}
            for kind, d, need in fits:
                x = solver.NumVar(0, inf, "")
                n_vars += 1
                taken[kind].append(x)
                s = max(1, need // unit)
                row = by_size.get(s)
                if row is None:  # pods of this size take no more arcs than the flow has
                    row = by_size[s] = solver.Constraint(-inf, 0)
                    for v in arcs[s]:
                        row.SetCoefficient(v, -1)
                row.SetCoefficient(x, d.gpu_count)
                cpu_row.SetCoefficient(x, d.cpu_milli / 1000)
                mem_row.SetCoefficient(x, d.memory_bytes / GIB)
                objective.SetCoefficient(x, d.gpu_count * need / GIB)
    for kind in kinds:
        row = solver.Constraint(float(must.get(kind, 0)), float(counts[kind]))
        for x in taken[kind]:
            row.SetCoefficient(x, 1)
    objective.SetMaximization()
    status = solver.Solve()
    name = status_name(status)
    value = objective.Value() * GIB if status == pywraplp.Solver.OPTIMAL else math_nan()
    return AllocationBound(
        value, demand_bytes, capacity_bytes, name, time.perf_counter() - start, n_vars
    )


def status_name(status: int) -> str:
    """GLOP's result status, as the bounds report it."""
    names = {
        pywraplp.Solver.OPTIMAL: "OPTIMAL",
        pywraplp.Solver.INFEASIBLE: "INFEASIBLE",
        pywraplp.Solver.UNBOUNDED: "UNBOUNDED",
    }
    return names.get(status, f"STATUS {status}")


def math_nan() -> float:
    return float("nan")
