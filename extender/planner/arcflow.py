"""The per-GPU arc-flow relaxation of a batch: a proven lower bound on the stranded VRAM any plan
placing the whole batch leaves, and the makings of a plan from its solution.

Why: when a greedy plan places every pending pod the solver does not run, so nothing says how far
that plan's stranded VRAM (FGD's measure, `FragIndex`) is from the best possible. The class
relaxation that bounds the GPUs opened merges whole nodes, which loses the per-GPU thresholds
stranded VRAM is made of. This relaxation keeps them and relaxes the node instead:

- a GPU's fragment is judged on the GPU alone. For a type t that cannot run on the node *now*
  (CPU, memory, GPU count) all the GPU's free memory counts, exactly as `FragIndex` counts it after
  any plan (placing pods only takes CPU, memory, GPU memory and replicas away, so such a t never
  becomes runnable). For a type that can run now, only the GPU's own test counts (free memory >=
  its need, a replica left, product): after a plan the node may no longer run it, and then
  `FragIndex` counts more, never less. Untouched GPUs are counted exactly, so the relaxed increase
  is never above the real one;
- a k-GPU pod becomes k single-GPU shares, each restricted to GPUs it fits on nodes that could
  host the whole pod now; node CPU and memory and "k distinct GPUs on one node" are dropped.

What remains is a bin-packing problem over *GPU classes* (same node signature for every type, same
device state, same compatible pod classes), written as an arc-flow model (Valério de Carvalho): per
class, a graph over (memory used, replicas used); each of the class's GPUs is one unit of flow from
(0, 0) along arcs that add one share, ending at the state the GPU is left in, at that state's cost.
Every relaxed plan is a flow and every flow is a relaxed plan, so CP-SAT's proven bound on it is a
lower bound for every real plan. Memory is counted in the gcd of the shares' sizes, which is exact.

The relaxed solution is also a plan in the making: `paths` cuts each class's flow into one path per
GPU, and a path says which pods that GPU gets (`model.flow_plan` places them).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping

import numpy as np
from ortools.sat.python import cp_model

from extender.planner import clock
from extender.planner.capacity import FragIndex, hash_groups, row_hashes
from extender.planner.staged import Settings, Stage, staged_solve

__all__ = ["ArcFlow", "MAX_STATES"]

#: give up (no model) when the flow graphs would have more states than this in all: fine-grained
#: sizes (a gcd of a few MiB) make one GPU thousands of memory levels.
MAX_STATES = 50_000

_State = tuple[int, int]  # (memory units used, replicas used)
#: a class's arcs: (state, pod class) -> (next state, flow variable)
_Arcs = dict[tuple[_State, int], tuple[_State, cp_model.IntVar]]


class ArcFlow:
    """The relaxation for shares of pod classes: `need[p, g]` bytes a share of class p takes on
    device g, `fit[p, g]` it may go there, `shares[p]` how many must be placed (GPU count x pods).
    `ok` is False when the graphs are too large or building ran past `deadline`."""

    def __init__(
        self,
        frag: FragIndex,
        need: np.ndarray,
        fit: np.ndarray,
        shares: np.ndarray,
        deadline: float,
    ) -> None:
        cap, a = frag.cap, frag.a
        self.ok = False
        self.values: Mapping[int, int] | None = None
        self.model = m = cp_model.CpModel()
        self.objective: cp_model.LinearExprT = 0
        self.live = [p for p in range(len(shares)) if shares[p] > 0]
        # per GPU class: its device rows, its arcs {(state, live p): (next state, var)}, its ends {state: var}
        self.classes: list[tuple[np.ndarray, _Arcs, dict[_State, cp_model.IntVar]]] = []
        if not self.live:
            self.ok = True
            return
        fit, need, shares = fit[self.live], need[self.live], np.asarray(shares)[self.live]
        rows = np.flatnonzero(fit.any(axis=0))
        if len(rows) == 0:
            return
        run = frag.runnable(cap.cpu_free, cap.mem_free, frag.okc)[a.node_of[rows]]  # (R, T) now
        key = np.column_stack(
            [
                run.astype(np.int64),
                a.resource_id[rows],
                a.product_id[rows],
                a.capacity[rows],
                a.per_pod_cap[rows],
                a.replicas[rows],
                a.used[rows],
                a.used_replicas[rows],
                fit[:, rows].T.astype(np.int64),
                need[:, rows].T,
            ]
        ).astype(np.int64)
        members, bounds = hash_groups(row_hashes(key))
        first = members[bounds[:-1]]
        unit = 0
        for v in np.unique(need[fit]).tolist():
            unit = math.gcd(unit, int(v))
        if unit <= 0:
            return
        placed: list[list[cp_model.IntVar]] = [[] for _ in self.live]
        objective: list[cp_model.LinearExprT] = []
        states_total = 0
        for c, j in enumerate(first.tolist()):
            if clock.now() > deadline:
                return
            g = int(rows[j])
            M = int(bounds[c + 1] - bounds[c])
            free0 = int(a.capacity[g] - a.used[g])
            rep0 = int(a.replicas[g] - a.used_replicas[g])
            ps = [p for p in range(len(self.live)) if fit[p, g]]
            size = {p: int(need[p, g]) // unit for p in ps}
            order = _states(ps, size, max(free0, 0) // unit, rep0, MAX_STATES - states_total)
            if order is None:
                return
            states_total += len(order)
            # cost of ending in each state: the GPU's relaxed fragment after minus before (KiB,
            # rounded down, so the bound stays below the real value)
            used = np.asarray([u for u, _ in order], np.int64) * unit
            left_rep = rep0 - np.asarray([r for _, r in order], np.int64)
            cost = _fragment(frag, g, run[j], free0 - used, left_rep)
            base = _fragment(frag, g, run[j], np.asarray([free0]), np.asarray([rep0]))[0]
            coef = np.floor((cost - base) / 1024.0).astype(np.int64)
            inflow: dict[_State, list[cp_model.IntVar]] = {s: [] for s in order}
            arcs: _Arcs = {}
            ends: dict[_State, cp_model.IntVar] = {}
            for s, cf in zip(order, coef.tolist()):
                out = []
                for p in ps:
                    t = (s[0] + size[p], s[1] + 1)
                    if t in inflow:
                        x = m.new_int_var(0, int(min(M * rep0, shares[p])), "")
                        out.append(x)
                        inflow[t].append(x)
                        placed[p].append(x)
                        arcs[s, p] = (t, x)
                end = ends[s] = m.new_int_var(0, M, "")
                m.add(sum(inflow[s]) + (M if s == (0, 0) else 0) == sum(out) + end)
                if cf:
                    objective.append(cf * end)
            self.classes.append((rows[members[bounds[c] : bounds[c + 1]]], arcs, ends))
        for p in range(len(self.live)):
            if not placed[p]:
                return
            m.add(sum(placed[p]) == int(shares[p]))
        self.objective = cp_model.LinearExpr.sum(objective)  # a constant 0 is still solved
        self.ok = True

    def solve(self, deadline: float, num_workers: int = 2, *, keep: bool = False) -> int | None:
        """The proven bound in KiB (see the module docstring), or None: no model, no time left,
        or the shares cannot all be placed even relaxed. `keep`: keep the solution for `paths`
        (reading it back costs time that a bound alone does not need)."""
        self.values = None
        if not self.ok:
            return None
        if not self.live:
            return 0
        left = deadline - clock.now()
        if left <= 0:
            return None
        variables = (
            [
                x
                for _, arcs, ends in self.classes
                for x in [*(v for _, v in arcs.values()), *ends.values()]
            ]
            if keep
            else []
        )
        result = staged_solve(
            self.model,
            [Stage("stranded", self.objective, least=0.0)],
            deadline,
            variables=variables,
            settings=Settings(num_workers),
        )
        stage = result.stages[0]
        if not stage.solved:
            return None
        self.values = result.values if keep else None
        return int(math.floor(stage.bound))

    def paths(self) -> list[tuple[np.ndarray, list[tuple[int, ...]]]]:
        """The solution cut into one path per GPU: per GPU class, its device rows and, for as many
        GPUs, the pod classes (caller's numbering) whose shares a GPU gets."""
        if self.values is None:
            return []
        values = self.values

        def value(var: cp_model.IntVar) -> int:
            return values[var.index]

        out = []
        for rows, arcs, ends in self.classes:
            flow = {k: value(x) for k, (_, x) in arcs.items()}
            stop = {s: value(e) for s, e in ends.items()}
            nxt: dict[_State, list[int]] = defaultdict(list)
            for (s, p), f in flow.items():
                if f:
                    nxt[s].append(p)
            walks = []
            for _ in range(len(rows)):
                s, walk = (0, 0), []
                while not stop.get(s):  # conservation: a state without a stop has flow going on
                    p = nxt[s][-1]
                    flow[s, p] -= 1
                    if not flow[s, p]:
                        nxt[s].pop()
                    walk.append(self.live[p])
                    s = arcs[s, p][0]
                stop[s] -= 1
                walks.append(tuple(walk))
            out.append((rows, walks))
        return out


def _states(
    ps: list[int], size: dict[int, int], levels: int, rep0: int, limit: int
) -> list[_State] | None:
    """The (units used, replicas used) states reachable by adding shares, or None past `limit`."""
    states = {(0, 0)}
    frontier = [(0, 0)]
    while frontier:
        nxt = []
        for u, r in frontier:
            for p in ps:
                s = (u + size[p], r + 1)
                if s[0] <= levels and s[1] <= rep0 and s not in states:
                    states.add(s)
                    nxt.append(s)
        frontier = nxt
        if len(states) > limit:
            return None
    return sorted(states)


def _fragment(
    frag: FragIndex, g: int, run: np.ndarray, free: np.ndarray, rep_left: np.ndarray
) -> np.ndarray:
    """Device g's expected stranded bytes for each (free, replicas left) pair, judged on the device
    alone for the types its node can run now (see the module docstring)."""
    ok = frag.usable(np.full(len(free), g), free, rep_left)
    stranded = np.where(run, ~ok, True)
    out: np.ndarray = np.maximum(free, 0) * frag.weigh(stranded) / float(frag.count_total)
    return out
