"""An upper bound on GPU memory allocated from a fixed state with a limited number of moves.

`bound.allocation_bound` lets the pods placed at a policy's first failure be re-arranged at
will: it bounds a policy with any number of moves. `planner+repack` may move only a fraction F
of the pods it has placed, so this bound keeps the state at the first failure as it was, pod
for pod, except for the pods the budget lets move:

- **nodes** are pooled into groups (the same devices, and free CPU at that state within one of
  `CPU_BINS`); a group's free CPU and memory are summed, which only relaxes;
- each **GPU** of a group and device kind is one unit of flow that enters as what it holds
  (its memory used, in units of the gcd of every size, and the pods on it). Before it joins
  the arc-flow graph of `bound.allocation_bound` at its memory used (pod arcs u -> u + s, loss
  arcs u -> u + 1, up to the device's memory) it may take **removal arcs**, each the move of
  one of its own pods away; a group has no more removals of a kind than it held such pods;
- a **moved pod** is placed again like a new one (its GPUs, CPU and memory wherever it fits)
  and its memory counts once; a moved GPU-less pod frees its CPU and memory in its group and
  takes them in another;
- **cuts** keep what pooling would split on one node: a k-GPU pod's GPUs, and a pod's cores
  and GPU (per node the fewer of its CPU slots and GPU slots, plus what moves free);
- **moves** (removed pods, GPU-less ones included) are at most F x the pods placed at the end,
  and those are at most the pods placed then, the GPU pods the LP takes, and every GPU-less
  pod that arrives later; GPU-less pods arriving later take nothing here (only relaxes).

Every end state that a policy placing those pods as they were, then moving at most that many
(a pod moved twice counts once here), can reach is a feasible point of the LP, so its optimum
(GLOP) bounds GPU memory allocated at the end. With a budget of 0 it is the most the state's
free pieces can hold; with a large one it approaches `allocation_bound` from the same first
failure.
"""

from __future__ import annotations

import time
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from functools import reduce
from math import gcd

import numpy as np
from ortools.linear_solver import pywraplp  # type: ignore[import-untyped]

from extender.arrays import DeviceArrays
from extender.demand import Demand
from extender.planner.capacity import Capacity, demand_kind, device_matches
from extender.quantity import GIB
from extender.simulate.bound import status_name
from extender.simulate.fit_rule import add_fit_rule

__all__ = ["CPU_BINS", "BudgetBound", "HeldPod", "StateSnapshot", "budget_bound", "snapshot"]

#: free-CPU bins (cores) that split nodes of the same devices into groups: nodes starved of CPU
#: are not pooled with nodes that have cores to spare
CPU_BINS = (1, 2, 4, 8, 16, 32, 64)


@dataclass(frozen=True)
class HeldPod:
    """A placed pod: its demand, node row and (device row, bytes) per GPU it holds."""

    demand: Demand
    node: int
    devices: tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class StateSnapshot:
    """A copy of what the bound reads from a replay's state: the device columns, free CPU and
    memory per node and where every pod is."""

    arrays: DeviceArrays
    cpu_free: np.ndarray
    mem_free: np.ndarray
    cpu_total: np.ndarray
    mem_total: np.ndarray
    pods: tuple[HeldPod, ...]


def snapshot(cap: Capacity, placed: Iterable[tuple[Demand, int]]) -> StateSnapshot:
    """The state of `cap` with the pods `placed` (demand, node row) on it, copied."""
    a = cap.arrays
    row_of: dict[tuple[int, str], int] = {}
    pods = []
    for d, n in placed:
        held: tuple[tuple[int, int], ...] = ()
        res = cap.ledger.reservation(d.pod.key) if d.gpu_count > 0 else None
        if res is not None:
            lo, hi = int(a.node_start[n]), int(a.node_start[n + 1])
            if (n, res.device_ids[0]) not in row_of:
                for g in range(lo, hi):
                    row_of[(n, a.devices[g].device_id)] = g
            held = tuple(
                (row_of[(n, dev)], int(b)) for dev, b in zip(res.device_ids, res.bytes_per_device)
            )
        pods.append(HeldPod(d, n, held))
    arrays = replace(a, used=a.used.copy(), used_replicas=a.used_replicas.copy(), cache=None)
    return StateSnapshot(
        arrays,
        cap.cpu_free.copy(),
        cap.mem_free.copy(),
        cap.cpu_total.copy(),
        cap.mem_total.copy(),
        tuple(pods),
    )


@dataclass(frozen=True)
class BudgetBound:
    """`bytes`: no such policy ends with more GPU memory allocated (every pod counted, those
    placed before the state included); `status`: GLOP's. From the LP's optimum, which says
    where the room it finds comes from: `taken`, the later GPU pods it takes per demand kind
    (fractions: it is an LP), and `moves`, the moves it makes. Not in the JSON."""

    bytes: float
    status: str
    seconds: float
    variables: int
    groups: int
    taken: dict[Kind, float] = field(default_factory=dict, repr=False)
    moves: float = 0.0

    def to_json(self) -> dict[str, object]:
        return {
            "boundBytes": round(self.bytes),
            "status": self.status,
            "seconds": round(self.seconds, 3),
            "variables": self.variables,
            "groups": self.groups,
        }


Kind = tuple[object, ...]  # `demand_kind`
DevKind = tuple[int, int, int, int]  # resource id, product id, capacity, per-pod cap
Config = tuple[int, tuple[int, ...]]  # a GPU: units used, and the units of each pod it holds


@dataclass
class _Group:
    """Nodes pooled: how many devices of each kind one of them has, their free CPU and memory
    summed, and the most CPU and memory one of them has in all."""

    devices: dict[DevKind, int]
    cpu_free: float = 0.0
    mem_free: float = 0.0
    cpu_top: int = 0
    mem_top: int = 0


def _group_nodes(
    state: StateSnapshot, dev_kind: Sequence[DevKind], cpu_bins: Sequence[float]
) -> tuple[np.ndarray, list[_Group]]:
    """Each node's group (its devices and its free CPU's bin) and the groups."""
    a = state.arrays
    bins = np.asarray(cpu_bins, dtype=np.float64) * 1000
    group_of = np.zeros(len(a.node_names), dtype=np.int64)
    keys: dict[tuple[object, ...], int] = {}
    groups: list[_Group] = []
    for n in range(len(a.node_names)):
        lo, hi = int(a.node_start[n]), int(a.node_start[n + 1])
        devs = Counter(dev_kind[lo:hi])
        key = (tuple(sorted(devs.items())), int(np.searchsorted(bins, state.cpu_free[n], "right")))
        if key not in keys:
            keys[key] = len(groups)
            groups.append(_Group(dict(devs)))
        g = groups[keys[key]]
        group_of[n] = keys[key]
        cpu, mem = max(int(state.cpu_free[n]), 0), max(int(state.mem_free[n]), 0)
        g.cpu_free = float("inf") if cpu >= 1 << 49 else g.cpu_free + cpu
        g.mem_free = float("inf") if mem >= 1 << 59 else g.mem_free + mem
        g.cpu_top = max(g.cpu_top, int(state.cpu_total[n]))
        g.mem_top = max(g.mem_top, int(state.mem_total[n]))
    return group_of, groups


class _Lp:
    """GLOP with rows in cores and GiB and the objective in GiB (its tolerances are absolute)."""

    def __init__(self, solver: pywraplp.Solver) -> None:
        self.solver = solver
        self.inf: float = solver.infinity()
        self.objective = solver.Objective()
        self.variables = 0

    def var(self, hi: float | None = None) -> pywraplp.Variable:
        self.variables += 1
        return self.solver.NumVar(0.0, self.inf if hi is None else hi, "")

    def row(
        self, lo: float, hi: float, terms: Iterable[tuple[pywraplp.Variable, float]] = ()
    ) -> pywraplp.Constraint:
        r = self.solver.Constraint(lo, hi)
        for v, c in terms:
            r.SetCoefficient(v, c)
        return r


def _configs_after_moves(configs: Iterable[Config]) -> dict[Config, int]:
    """Every config reachable from `configs` by moving pods away, numbered."""
    seen: dict[Config, int] = {}
    todo = list(configs)
    while todo:
        c = todo.pop()
        if c in seen:
            continue
        seen[c] = len(seen)
        todo += [_without(c, s) for s in set(c[1])]
    return seen


def _without(c: Config, s: int) -> Config:
    rest = list(c[1])
    rest.remove(s)
    return (max(0, c[0] - s), tuple(rest))


def _gpu_graph(
    lp: _Lp, configs: Counter[Config], top: int, sizes: Iterable[int]
) -> tuple[dict[int, list[pywraplp.Variable]], dict[int, list[pywraplp.Variable]]]:
    """The flow of a group's GPUs of one kind: each enters as the config it holds, loses
    moved pods (removal arcs, by size), enters the arc-flow graph at its units used and fills
    up to `top` with pod arcs of `sizes` and loss arcs. Returns (removal arcs, pod arcs) by
    size."""
    states = _configs_after_moves(configs)
    enter_in: list[list[pywraplp.Variable]] = [[] for _ in states]
    enter_out: list[list[pywraplp.Variable]] = [[] for _ in states]
    into: list[list[pywraplp.Variable]] = [[] for _ in range(top + 1)]
    out_of: list[list[pywraplp.Variable]] = [[] for _ in range(top + 1)]
    removal: dict[int, list[pywraplp.Variable]] = defaultdict(list)
    for c, i in states.items():
        for s in set(c[1]):
            v = lp.var()
            enter_out[i].append(v)
            enter_in[states[_without(c, s)]].append(v)
            removal[s].append(v)
        v = lp.var()  # into the graph at its units used
        enter_out[i].append(v)
        into[min(c[0], top)].append(v)
    for c, i in states.items():
        n = float(configs.get(c, 0))
        lp.row(n, n, [*((v, 1.0) for v in enter_out[i]), *((v, -1.0) for v in enter_in[i])])
    arcs: dict[int, list[pywraplp.Variable]] = defaultdict(list)
    for s in sorted(set(sizes)):
        for u in range(0, top - s + 1):
            v = lp.var()
            arcs[s].append(v)
            out_of[u].append(v)
            into[u + s].append(v)
    for u in range(top):
        v = lp.var()
        out_of[u].append(v)
        into[u + 1].append(v)
    for u in range(top):  # flow in = flow out below the top (the sink)
        lp.row(0, 0, [*((v, 1.0) for v in into[u]), *((v, -1.0) for v in out_of[u])])
    return removal, arcs


def _node_slots(node_free: Iterable[list[int]], need: int, k: int) -> int:
    """How many k-GPU pods of `need` bytes per GPU the nodes (their GPUs' free bytes) hold at
    most, each on one node. A move frees at most as many GPUs as its pod holds, which adds at
    most that many: a valid cut on the pods of k GPUs the arc-flow spreads over nodes."""
    return sum(sum(1 for f in frees if f >= need) // k for frees in node_free)


def _cut_points(placed: Sequence[tuple[object, int, int]], most: int) -> list[tuple[int, int]]:
    """(bytes per GPU, millicores) pairs for the per-node cuts: each CPU request among `placed`
    alone (bytes 0), and each (bytes, CPU) pair; at most `most` of each, spread over their
    range (any subset of cuts is valid)."""

    def spread(values: list[tuple[int, int]]) -> list[tuple[int, int]]:
        if len(values) <= most:
            return values
        return [values[round(i * (len(values) - 1) / (most - 1))] for i in range(most)]

    cpus = sorted({(0, cpu) for _, cpu, _ in placed if cpu > 0})
    pairs = sorted({(need, cpu) for _, cpu, need in placed if cpu > 0 and need > 0})
    return sorted({*spread(cpus), *spread(pairs)})


def _node_slots_cpu(
    free_cpu: Sequence[int], free_gpus: Sequence[Sequence[int]], need: int, c: int
) -> tuple[int, int, int] | None:
    """Pods each asking at least `c` millicores and (if `need`) a GPU with at least `need`
    bytes free: per node its CPU slots b and GPU slots a, and it holds at most min(a, b) of
    them. Returns (the sum of min(a, b), of max(0, a - b), of max(0, b - a)); None: a node
    not limited by CPU. The pooled rows miss this: two nodes with 9 free cores each hold no
    11-core pod between them, nor does a node whose cores are free and whose GPUs are full.
    Moves raise a node's min(a, b) by at most max(0, a - b) plus the GPU slots they free, and
    by at most max(0, b - a) plus the CPU slots they free."""
    total = over_gpu = over_cpu = 0
    for cpu, gpus in zip(free_cpu, free_gpus):
        if cpu >= 1 << 49:
            return None
        b = max(cpu, 0) // c
        if not need:
            total += b
            continue
        a = sum(max(f, 0) // need for f in gpus)
        total += min(a, b)
        over_gpu += max(0, a - b)
        over_cpu += max(0, b - a)
    return total, over_gpu, over_cpu


def _slots_freed(cpu: int, gpus: int, per_gpu: int, need: int, c: int) -> tuple[int, int]:
    """The GPU slots and the CPU slots (`_node_slots_cpu`) a move of a pod frees at most: its
    `gpus` GPUs of `per_gpu` bytes each, ceil(per_gpu / need) slots per GPU, and ceil(cpu / c)."""
    gpu = gpus * -(-per_gpu // need) if need and gpus else 0
    return gpu, (-(-cpu // c) if cpu > 0 else 0)


@dataclass
class _Read:
    """What the LP reads from the state and the later pods, once."""

    dev_kind: list[DevKind]  # per device row
    group_of: np.ndarray  # per node
    groups: list[_Group]
    unit: int  # bytes per unit of the arc-flow graphs
    #: later GPU pods per kind, and every kind that may be placed (arriving, or held and moved)
    counts: Counter[Kind]
    to_place: dict[Kind, Demand]
    #: GPU pods held by (group, device kind, kind + bytes per GPU, units per GPU), one of each
    #: such kind with its bytes per GPU; GPU-less pods held by (group, CPU, memory)
    held_gpu: Counter[tuple[int, DevKind, Kind, int]]
    held_of: dict[Kind, tuple[Demand, int]]
    held_cpu: Counter[tuple[int, int, int]]
    #: the GPUs of each group and device kind, by config
    supply: dict[tuple[int, DevKind], Counter[Config]]
    #: per node of each group: its free CPU, its GPUs' free bytes, and those by device kind
    node_cpu: list[list[int]]
    node_gpus: list[list[list[int]]]
    node_free: dict[tuple[int, DevKind], list[list[int]]]


def _read(
    state: StateSnapshot, later: Sequence[Demand], cpu_bins: Sequence[float], max_states: int
) -> _Read:
    a = state.arrays
    counts: Counter[Kind] = Counter()
    to_place: dict[Kind, Demand] = {}
    for d in later:
        if d.gpu_count > 0:
            counts[demand_kind(d)] += 1
            to_place.setdefault(demand_kind(d), d)
    dev_kind: list[DevKind] = list(
        zip(
            a.resource_id.tolist(),
            a.product_id.tolist(),
            a.capacity.tolist(),
            a.per_pod_cap.tolist(),
        )
    )
    group_of, groups = _group_nodes(state, dev_kind, cpu_bins)
    unit = _unit(state, to_place.values(), dev_kind, max_states)
    on_row: dict[int, list[int]] = defaultdict(list)
    held_gpu: Counter[tuple[int, DevKind, Kind, int]] = Counter()
    held_of: dict[Kind, tuple[Demand, int]] = {}
    held_cpu: Counter[tuple[int, int, int]] = Counter()
    for p in state.pods:
        g = int(group_of[p.node])
        if not p.devices:
            held_cpu[(g, p.demand.cpu_milli, p.demand.memory_bytes)] += 1
            continue
        for row, b in p.devices:
            on_row[row].append(-(-b // unit))
        row, b = p.devices[0]
        kind: Kind = (*demand_kind(p.demand), b)
        held_of.setdefault(kind, (p.demand, b))
        to_place.setdefault(demand_kind(p.demand), p.demand)
        held_gpu[(g, dev_kind[row], kind, -(-b // unit))] += 1
    supply: dict[tuple[int, DevKind], Counter[Config]] = defaultdict(Counter)
    for row, dk in enumerate(dev_kind):
        if dk[2] > 0:
            used = int(min(a.used[row], dk[2])) // unit
            supply[(int(group_of[a.node_of[row]]), dk)][(used, tuple(sorted(on_row[row])))] += 1
    node_cpu: list[list[int]] = [[] for _ in groups]
    node_gpus: list[list[list[int]]] = [[] for _ in groups]
    node_free: dict[tuple[int, DevKind], list[list[int]]] = defaultdict(list)
    for n in range(len(a.node_names)):
        lo, hi = int(a.node_start[n]), int(a.node_start[n + 1])
        gi = int(group_of[n])
        frees = (a.capacity[lo:hi] - a.used[lo:hi]).tolist()
        node_cpu[gi].append(int(state.cpu_free[n]))
        node_gpus[gi].append(frees)
        here: dict[DevKind, list[int]] = defaultdict(list)
        for dk, f in zip(dev_kind[lo:hi], frees):
            here[dk].append(f)
        for dk, of_kind in here.items():
            node_free[(gi, dk)].append(of_kind)
    return _Read(
        dev_kind,
        group_of,
        groups,
        unit,
        counts,
        to_place,
        held_gpu,
        held_of,
        held_cpu,
        supply,
        node_cpu,
        node_gpus,
        node_free,
    )


def _unit(
    state: StateSnapshot, later: Iterable[Demand], dev_kind: Sequence[DevKind], max_states: int
) -> int:
    """The gcd of every size the graphs see (pods', devices', bytes used and held), coarsened
    to at most `max_states` units per device (then used and removals round down, free memory
    up: only relaxes)."""
    a = state.arrays
    unit = (
        reduce(
            gcd,
            [
                *(d.bytes_per_gpu for d in later if d.bytes_per_gpu),
                *(v for k in set(dev_kind) for v in k[2:] if v),
                *(int(u) for u in set(a.used.tolist()) if u > 0),
                *(b for p in state.pods for _, b in p.devices if b > 0),
            ],
            0,
        )
        or 1
    )
    biggest = int(a.capacity.max(initial=0))
    return -(-biggest // max_states) if biggest // unit > max_states else unit


class _Model:
    """The LP's variables by what they stand for, built in parts: the GPUs of each group and
    device kind (`add_gpus`), each kind's placements against its arrivals and moves
    (`add_kinds`), GPU-less pods that move (`add_gpuless_moves`), the per-node cuts on cores
    and GPU (`add_core_cuts`) and the move budget (`add_budget`)."""

    def __init__(self, lp: _Lp, r: _Read, arrays: DeviceArrays) -> None:
        self.lp, self.r, self.a = lp, r, arrays
        inf = lp.inf
        self.cpu_row = [
            lp.row(-inf, g.cpu_free / 1000 if g.cpu_free < inf else inf) for g in r.groups
        ]
        self.mem_row = [
            lp.row(-inf, g.mem_free / GIB if g.mem_free < inf else inf) for g in r.groups
        ]
        #: per kind: its pods placed (new or moved), and its held pods moved
        self.placed: dict[Kind, list[pywraplp.Variable]] = defaultdict(list)
        self.moved: dict[Kind, list[pywraplp.Variable]] = defaultdict(list)
        #: per group: GPU pods placed there (var, millicores, bytes per GPU) and pods moved out
        #: of it (var, millicores, GPUs, bytes per GPU)
        self.cores_in: list[list[tuple[pywraplp.Variable, int, int]]] = [[] for _ in r.groups]
        self.cores_out: list[list[tuple[pywraplp.Variable, int, int, int]]] = [[] for _ in r.groups]
        self.moves: list[pywraplp.Variable] = []
        self.taken: dict[Kind, pywraplp.Variable] = {}

    def add_gpus(self) -> None:
        a, r = self.a, self.r
        ok_products = {
            k: set(a.product_id[device_matches(a, d.resource, d.allowed_products)].tolist())
            for k, d in r.to_place.items()
        }
        for (gi, dk), configs in sorted(r.supply.items(), key=lambda item: item[0]):
            fits = self._fits(gi, dk, ok_products)
            removals = [(k, s, c) for (g, d, k, s), c in r.held_gpu.items() if (g, d) == (gi, dk)]
            if not fits and not removals:
                continue
            top = -(-dk[2] // r.unit)
            removal, arcs = _gpu_graph(
                self.lp, configs, top, (max(1, n // r.unit) for _, _, n in fits)
            )
            freed = self._held_moves(gi, removals, removal)
            self._new_pods(gi, dk, fits, arcs, freed)

    def _fits(
        self, gi: int, dk: DevKind, ok_products: dict[Kind, set[int]]
    ) -> list[tuple[Kind, Demand, int]]:
        """The kinds one node of group `gi` could hold on devices of kind `dk`, with the bytes
        per GPU they take there."""
        grp = self.r.groups[gi]
        rid, pid, capacity, ppc = dk
        fits = []
        for k, d in self.r.to_place.items():
            need = ppc if d.bytes_per_gpu is None else d.bytes_per_gpu
            if (
                self.a.resources.get(d.resource) == rid
                and pid in ok_products[k]
                and d.gpu_count <= grp.devices[dk]
                and d.cpu_milli <= grp.cpu_top
                and d.memory_bytes <= grp.mem_top
                and 0 < need <= min(ppc, capacity)
            ):
                fits.append((k, d, need))
        return fits

    def _held_moves(
        self,
        gi: int,
        removals: list[tuple[Kind, int, int]],
        removal: dict[int, list[pywraplp.Variable]],
    ) -> list[tuple[pywraplp.Variable, float]]:
        """A move of a held GPU pod: its removal arcs (one per GPU), its CPU and memory back,
        its memory no longer counted where it was. Returns the GPUs each move frees, at most."""
        lp = self.lp
        by_removal: dict[int, list[tuple[pywraplp.Variable, float]]] = defaultdict(list)
        freed: list[tuple[pywraplp.Variable, float]] = []
        for k, s, c in removals:
            d, b = self.r.held_of[k]
            y = lp.var(c)
            self.moves.append(y)
            freed.append((y, -d.gpu_count))
            self.moved[k[:-1]].append(y)
            by_removal[s].append((y, -d.gpu_count))
            self.cpu_row[gi].SetCoefficient(y, -d.cpu_milli / 1000)
            self.cores_out[gi].append((y, d.cpu_milli, d.gpu_count, b))
            self.mem_row[gi].SetCoefficient(y, -d.memory_bytes / GIB)
            lp.objective.SetCoefficient(y, -d.gpu_count * b / GIB)
        for s, ys in by_removal.items():
            lp.row(0, 0, [*((v, 1.0) for v in removal[s]), *ys])
        return freed

    def _new_pods(
        self,
        gi: int,
        dk: DevKind,
        fits: list[tuple[Kind, Demand, int]],
        arcs: dict[int, list[pywraplp.Variable]],
        freed: list[tuple[pywraplp.Variable, float]],
    ) -> None:
        """Pods placed on these GPUs (new or moved): no more of a size than the flow has arcs
        of it, their CPU and memory in the group's rows, and a k-GPU pod on one node."""
        lp, inf = self.lp, self.lp.inf
        by_size: dict[int, pywraplp.Constraint] = {}
        for k, d, need in fits:
            x = lp.var()
            self.placed[k].append(x)
            s = max(1, need // self.r.unit)
            if s not in by_size:
                by_size[s] = lp.row(-inf, 0, ((v, -1.0) for v in arcs[s]))
            by_size[s].SetCoefficient(x, d.gpu_count)
            self.cpu_row[gi].SetCoefficient(x, d.cpu_milli / 1000)
            self.cores_in[gi].append((x, d.cpu_milli, need))
            self.mem_row[gi].SetCoefficient(x, d.memory_bytes / GIB)
            lp.objective.SetCoefficient(x, d.gpu_count * need / GIB)
            if d.gpu_count > 1:  # its GPUs on one node: no more than the nodes have
                slots = _node_slots(self.r.node_free[(gi, dk)], need, d.gpu_count)
                lp.row(-inf, slots, [(x, 1), *freed])

    def add_kinds(self) -> None:
        """A kind's placements = its pods moved + new pods taken (at most those that arrive)."""
        for k in self.r.to_place:
            row = self.lp.row(
                0, 0, [*((x, 1.0) for x in self.placed[k]), *((y, -1.0) for y in self.moved[k])]
            )
            if self.r.counts[k]:
                self.taken[k] = self.lp.var(self.r.counts[k])
                row.SetCoefficient(self.taken[k], -1)

    def add_gpuless_moves(self) -> None:
        """GPU-less pods that move: out of their group, into any group with room for one."""
        lp, held_cpu = self.lp, self.r.held_cpu
        for cpu, mem in sorted({(c, m) for _, c, m in held_cpu}):
            row = lp.row(0, 0)
            for (gi, c, m), n in held_cpu.items():
                if (c, m) == (cpu, mem):
                    w = lp.var(n)
                    self.moves.append(w)
                    row.SetCoefficient(w, -1)
                    self.cpu_row[gi].SetCoefficient(w, -cpu / 1000)
                    self.cores_out[gi].append((w, cpu, 0, 0))
                    self.mem_row[gi].SetCoefficient(w, -mem / GIB)
            for gi, grp in enumerate(self.r.groups):
                if cpu <= grp.cpu_top and mem <= grp.mem_top:
                    q = lp.var()
                    row.SetCoefficient(q, 1)
                    self.cpu_row[gi].SetCoefficient(q, cpu / 1000)
                    self.mem_row[gi].SetCoefficient(q, mem / GIB)

    def add_core_cuts(self, cpu_cuts: int) -> None:
        """Per group, for pods of at least c cores and (if any) `need` bytes per GPU: no more
        than its nodes' slots (`_node_slots_cpu`) plus what moves add."""
        lp, inf = self.lp, self.lp.inf
        for gi, placed_here in enumerate(self.cores_in):
            for need, c in _cut_points(placed_here, cpu_cuts):
                sums = _node_slots_cpu(self.r.node_cpu[gi], self.r.node_gpus[gi], need, c)
                if sums is None:
                    continue
                slots, over_gpu, over_cpu = sums
                gain = lp.var()  # what moves add to the group's slots
                opened = [
                    (v, _slots_freed(cpu, k, b, need, c)) for v, cpu, k, b in self.cores_out[gi]
                ]
                # per node a move adds at most the larger of the two; summed, at most the
                # headroom of one side plus what the moves free of it
                lp.row(-inf, 0, [(gain, 1.0), *((v, -float(max(f))) for v, f in opened)])
                if need:
                    lp.row(-inf, over_gpu, [(gain, 1.0), *((v, -float(f[0])) for v, f in opened)])
                lp.row(-inf, over_cpu, [(gain, 1.0), *((v, -float(f[1])) for v, f in opened)])
                lp.row(
                    -inf,
                    slots,
                    [
                        (gain, -1.0),
                        *((x, 1.0) for x, cpu, n in placed_here if cpu >= c and n >= need),
                    ],
                )

    def add_budget(
        self, held: int, later_gpuless: int, fraction: float | None, max_moves: float | None
    ) -> None:
        """Moves at most `max_moves`, and at most `fraction` x the pods placed at the end
        (held + GPU pods taken + later GPU-less pods); both None: no moves."""
        lp, inf = self.lp, self.lp.inf
        if fraction is None and max_moves is None:
            max_moves = 0
        if max_moves is not None:
            lp.row(-inf, float(max_moves), ((v, 1.0) for v in self.moves))
        if fraction is not None:
            lp.row(
                -inf,
                fraction * (held + later_gpuless),
                [*((v, 1.0) for v in self.moves), *((t, -fraction) for t in self.taken.values())],
            )


def budget_bound(
    state: StateSnapshot,
    later: Iterable[Demand],
    *,
    fraction: float | None = None,
    max_moves: float | None = None,
    later_gpuless: int | None = None,
    max_states: int = 2000,
    cpu_bins: Sequence[float] = CPU_BINS,
    cpu_cuts: int = 16,
    arrivals: Sequence[float] | None = None,
    first_failed: bool = True,
) -> BudgetBound:
    """The bound for the GPU pods `later` arriving on `state`, moves limited to `fraction` x
    the pods placed at the end and to `max_moves` (None: not limited that way; both None:
    no moves). `later_gpuless`: GPU-less pods arriving later (default: those in `later`), which
    count as placed for the budget. `arrivals`: when each of `later` arrives (its batch), not
    decreasing; given, a pod that fits is placed (`fit_rule`; it holds only without moves), and
    with `first_failed` the GPU pods of the first batch found no place at `state`."""
    start = time.perf_counter()
    later = list(later)
    if arrivals is not None:
        if fraction or max_moves:
            raise ValueError("a bound that places every pod that fits allows no moves")
        if len(arrivals) != len(later):
            raise ValueError(f"{len(arrivals)} arrivals for {len(later)} pods")
        if any(b < a for a, b in zip(arrivals, arrivals[1:])):
            raise ValueError("arrivals must not decrease: the pods come in arrival order")
    if later_gpuless is None:
        later_gpuless = sum(1 for d in later if d.gpu_count == 0)
    r = _read(state, later, cpu_bins, max_states)
    solver = pywraplp.Solver.CreateSolver("GLOP")
    if solver is None:
        return BudgetBound(float("nan"), "NO GLOP", 0.0, 0, len(r.groups))
    lp = _Lp(solver)
    m = _Model(lp, r, state.arrays)
    m.add_gpus()
    m.add_kinds()
    m.add_gpuless_moves()
    m.add_core_cuts(cpu_cuts)
    m.add_budget(len(state.pods), later_gpuless, fraction, max_moves)
    if arrivals is not None:
        add_fit_rule(solver, m.taken, list(zip(later, arrivals)), first_failed=first_failed)
    lp.objective.SetMaximization()
    status = solver.Solve()
    seconds = time.perf_counter() - start
    if status != pywraplp.Solver.OPTIMAL:
        return BudgetBound(float("nan"), status_name(status), seconds, lp.variables, len(r.groups))
    a = state.arrays
    return BudgetBound(
        int(np.minimum(a.used, a.capacity).sum()) + lp.objective.Value() * GIB,
        status_name(status),
        seconds,
        lp.variables,
        len(r.groups),
        {k: t.solution_value() for k, t in m.taken.items()},
        sum(v.solution_value() for v in m.moves),
    )
