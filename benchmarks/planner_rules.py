"""The planner's one-pod rule against its alternatives: variants of the rule, and portfolios
that pick FGD or `fgd-packed` online. Each is measured beside the shipped rule and FGD in the
same run.

    .venv/bin/python benchmarks/planner_rules.py variants     # 12 lists x 3 node orders + llm-mixed
    .venv/bin/python benchmarks/planner_rules.py models       # lists with model-limited pods
    .venv/bin/python benchmarks/planner_rules.py whole-nodes --lists gpushare40 cpu050
    .venv/bin/python benchmarks/planner_rules.py profile --lists gpushare40 cpu050
    .venv/bin/python benchmarks/planner_rules.py open-cost    # every list, both inflations
    .venv/bin/python benchmarks/planner_rules.py portfolio    # 12 lists, inflate 1.3, file order
    .venv/bin/python benchmarks/planner_rules.py portfolio --lists default gpuspec05 --shuffle-nodes 1
    .venv/bin/python benchmarks/planner_rules.py idle-nodes --lists gpushare40 --inflate 0

**variants** (`VARIANTS`): the planner (batches and all) with its one-pod rule replaced, on every
trace list at inflate 1.3 in the file's node order and `--shuffle-orders` shuffled ones, and on
the heterogeneous LLM scenario (benchmarks/llm_mixed.py), next to the shipped planner and the
baselines it must not trail (FGD, first-fit, best-fit, the hot path); the table gives each rule's
memory allocated minus the best baseline's.

**models** (`MODEL_VARIANTS`): on every list whose pods are partly limited to GPU models, at
inflate 1.3 and without inflation, in the file's node order and `--shuffle-orders` shuffled ones,
the planner with other ways of treating GPU models (`planner.pressure`), next to the shipped
planner and the same baselines.

**whole-nodes** (`WHOLE_NODE_VARIANTS`): on the lists given, at inflate 1.3 and without
inflation, in the file's node order and `--shuffle-orders` shuffled ones, the planner whose GPU
pods leave alone the last nodes where the workload's largest multi-GPU pods still fit (FGD's
workload profile keeps the most common pod types only, and those pods are rarely among them):
always (`WHOLE_NODE_VARIANTS`, idle GPUs counted), or only among placements near FGD's best
(`HOST_VARIANTS`, the node's cores and memory counted too), next to the shipped planner and the
same baselines.

**profile** (`PROFILE_VARIANTS`): on the lists given, at inflate 1.3 and without inflation, in
the file's node order and `--shuffle-orders` shuffled ones, the planner whose workload profile
(FGD's most common pod types, weighted by pods) also holds multi-GPU pod types weighted by the
GPUs they ask: those of the list's largest pods, or all of them; or holds every pod type of the
list, weighted by pods. Next to the shipped planner and the same baselines, which keep FGD's
profile.

**open-cost** (`OPEN_COSTS`): on the lists given, at inflate 1.3 and without inflation, in the
file's node order and `--shuffle-orders` shuffled ones, the planner with `--open-gpu-cost` (a
charge per idle GPU a placement opens, `FragIndex.open_cost`), next to the shipped planner and
the same baselines: what the option costs where the cluster is overloaded.

**portfolio**: FGD and `fgd-packed` (the planner's rule) each run as a one-pod policy; a
scheduler that could tell which of them wins on the list it is on would never be behind either
(with an earlier rule each won on some lists; docs/benchmarks/packing-experiments.md). Two ways
to tell, with the information a live planner has (the pods seen so far), against both rules in
the same run:

- **rollout**: at checkpoints of allocated memory (`--checkpoints`, fractions of capacity), replay
  the pods seen so far, in order and repeated until they ask `--depth` x the free GPUs, from the
  current state under each rule, and follow the rule that allocated more until the next checkpoint
  (the rollout is undone: `greedy_batch` without `apply`).
- **prefix**: replay the first `--prefix` share of the list, inflated as the run is, on the empty
  cluster under each rule, and report which rule wins there next to which wins on the whole list:
  whether an early choice would be right.

**idle-nodes**: why a list's largest multi-GPU pods find no node. Each of `IDLE_POLICIES` replays
the list (`--inflate`, `--shuffle-nodes`); at every arrival of a pod asking the list's largest GPU
count K, the nodes that still have K idle GPUs are counted, and those of them that also have the
pod's cores and host memory free, beside whether the pod was placed.

Results go to benchmarks/results/planner_rules_<mode>.json and a table is printed. Why none of
them is the planner's rule: docs/benchmarks/packing-experiments.md (open-cost: docs/packing.md).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import TypeVar

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import trace_packing as tp

from extender.commands.argtypes import number, output_file, whole
from extender.commands.simulate import MAX_INFLATE
from extender.demand import Demand, PodRef
from extender.planner.capacity import (
    MAX_TYPES,
    Candidates,
    Capacity,
    FragIndex,
    Workload,
    candidates,
    demand_kind,
)
from extender.planner.greedy import (
    FGD_TOLERANCE,
    GPULESS_TOLERANCE,
    POLICIES,
    PRESSURE_SLACK,
    PRESSURE_TIE,
    Choice,
    _pick,
    by_pressure,
    fgd,
    greedy_batch,
    packed_pick,
)
from extender.simulate.engine import run_policy
from extender.simulate.trace import gpu_units, inflate, read_inputs

T = TypeVar("T")
RULES = ("fgd-packed", "fgd")
CHECKPOINTS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
RESULTS = ROOT / "benchmarks" / "results"


@dataclass
class RolloutPortfolio:
    """A one-pod rule that follows whichever of `rules` did best in a rollout of the pods seen so
    far from the current state, re-decided at each checkpoint of allocated memory."""

    rules: Sequence[str] = RULES
    checkpoints: Sequence[float] = CHECKPOINTS
    depth: float = 1.3
    rule: str = RULES[0]
    seen: list[Demand] = field(default_factory=list)
    decisions: list[dict] = field(default_factory=list)
    _next: int = 0

    def rollout_stream(self, cap: Capacity) -> list[Demand]:
        """The pods seen so far, repeated under new names until they ask `depth` x the free GPUs."""
        a = cap.arrays
        mean = float(a.capacity.mean())
        target = self.depth * float(np.maximum(a.capacity - a.used, 0).sum()) / mean
        out: list[Demand] = []
        asked = 0.0
        while self.seen and asked < target:
            for d in self.seen:
                if asked >= target:
                    break
                out.append(replace(d, pod=PodRef("rollout", f"r{len(out)}")))
                asked += gpu_units(d, int(mean))
        return out

    def decide(self, cap: Capacity, frag: FragIndex, at: float) -> None:
        start = time.perf_counter()
        stream = self.rollout_stream(cap)
        allocated = {}
        for r in self.rules:
            placed = greedy_batch(cap, stream, frag, order="given", rule=r)
            allocated[r] = sum(sum(res.bytes_per_device) for res, _, _ in placed.values() if res)
        # a tie keeps the current rule
        self.rule = max(self.rules, key=lambda r: (allocated[r], r == self.rule))
        self.decisions.append(
            {
                "allocatedShare": round(at, 3),
                "rule": self.rule,
                "rolloutGpus": {r: round(b / tp.GPU_MIB, 2) for r, b in allocated.items()},
                "seconds": round(time.perf_counter() - start, 2),
            }
        )

    def __call__(self, cap: Capacity, demand: Demand, frag: FragIndex | None) -> Choice | None:
        assert frag is not None, "the portfolio's rules need a workload profile"
        self.seen.append(demand)
        if self._next < len(self.checkpoints):
            a = cap.arrays
            at = float(np.minimum(a.used, a.capacity).sum()) / float(a.capacity.sum())
            if at >= self.checkpoints[self._next]:
                self.decide(cap, frag, at)
                while self._next < len(self.checkpoints) and at >= self.checkpoints[self._next]:
                    self._next += 1
        return POLICIES[self.rule](cap, demand, frag)


def prefix_winner(pod_list: str, share: float, factor: float, shuffle: int | None) -> dict:
    """Each rule on the first `share` of the list, inflated to `factor` x the GPUs, from empty."""
    nodes, tasks, bound, gpus, _ = tp.load(pod_list, 0, shuffle)
    head = tasks[: max(1, int(len(tasks) * share))]
    workload = Workload.from_demands(t.demand for t in head)
    stream = inflate(head, gpus, factor)
    got = {
        r: run_policy(r, nodes, stream, bound, workload=workload).allocatedMemoryBytes / tp.GPU_MIB
        for r in RULES
    }
    return {
        "share": share,
        "allocatedGpus": {r: round(v, 2) for r, v in got.items()},
        "winner": max(RULES, key=lambda r: got[r]),
    }


def one_list(
    args: tuple[str, float, int | None, tuple[float, ...], tuple[float, ...], float],
) -> dict:
    pod_list, factor, shuffle, checkpoints, prefixes, depth = args
    nodes, tasks, bound, _, workload = tp.load(pod_list, factor, shuffle)
    out: dict = {
        "podList": pod_list,
        "inflate": factor,
        "shuffleNodes": shuffle,
        "allocatedGpus": {},
    }
    for r in RULES:
        res = run_policy(r, nodes, tasks, bound, workload=workload)
        out["allocatedGpus"][r] = round(res.allocatedMemoryBytes / tp.GPU_MIB, 2)
    portfolio = RolloutPortfolio(checkpoints=checkpoints, depth=depth)
    POLICIES["rollout"] = portfolio  # this process's copy of the table; run_policy looks it up
    start = time.perf_counter()
    res = run_policy("rollout", nodes, tasks, bound, workload=workload)
    out["allocatedGpus"]["rollout"] = round(res.allocatedMemoryBytes / tp.GPU_MIB, 2)
    out["rolloutSeconds"] = round(time.perf_counter() - start, 1)
    out["decisions"] = portfolio.decisions
    out["winner"] = max(RULES, key=lambda r: out["allocatedGpus"][r])
    out["prefix"] = [prefix_winner(pod_list, s, factor, shuffle) for s in prefixes]
    return out


def table(runs: list[dict]) -> str:
    head = "pod list      fgd-packed      fgd  rollout  rollout-best  rules followed   prefix picks (winner)"
    lines = [head]
    for r in runs:
        g = r["allocatedGpus"]
        best = max(g[x] for x in RULES)
        rules = "".join("P" if d["rule"] == "fgd-packed" else "F" for d in r["decisions"])
        picks = " ".join(
            f"{p['share']:g}:{'P' if p['winner'] == 'fgd-packed' else 'F'}" for p in r["prefix"]
        )
        lines.append(
            f"{r['podList']:12s} {g['fgd-packed']:10.2f} {g['fgd']:8.2f} {g['rollout']:8.2f}"
            f" {g['rollout'] - best:+13.2f}  {rules:15s}  {picks} ({'P' if r['winner'] == 'fgd-packed' else 'F'})"
        )
    lines.append(
        "GPUs (1000 MiB) of memory allocated at the end; rollout-best: the rollout portfolio "
        "minus the better rule; P fgd-packed, F FGD"
    )
    return "\n".join(lines)


def _near_ties(
    cap: Capacity, demand: Demand, frag: FragIndex | None, tolerance: float
) -> tuple[Candidates, np.ndarray, np.ndarray] | None:
    """`fgd-packed`'s first step: the placements, FGD's measure of each, and which are within
    `tolerance` of a GPU's memory (the cluster's mean) of the least."""
    assert frag is not None
    c = candidates(cap, demand)
    if len(c) == 0:
        return None
    d = np.round(frag.delta(c, demand), 6)
    return c, d, d <= d.min() + tolerance * float(cap.arrays.capacity.mean())


def packed(tolerance: float, gpuless_to_taken_gpus: bool):
    """`fgd-packed` with another band for GPU pods, and GPU-less pods sent either to the node with
    the least free GPU memory among their near-ties (the shipped rule) or to the lowest node."""

    def rule(cap: Capacity, demand: Demand, frag: FragIndex | None = None) -> Choice | None:
        if demand.gpu_count == 0 and gpuless_to_taken_gpus:
            return SHIPPED(cap, demand, frag)
        tol = GPULESS_TOLERANCE if demand.gpu_count == 0 else tolerance
        ties = _near_ties(cap, demand, frag, tol)
        if ties is None:
            return None
        c, d, near = ties
        return _pick(c, [~near, c.node, d], demand, cap)

    return rule


#: the planner's one-pod rule before GPU-less pods were sent where the GPUs are taken: a 5% band
#: for every pod, then the lowest node
PREVIOUS = packed(0.05, gpuless_to_taken_gpus=False)


def in_use_band(tolerance: float):
    """The previous rule whose band holds only nodes already in use; when no near-best placement
    is on one, FGD's own choice opens a node (which idle node to open by the measure, not the
    index)."""

    def rule(cap: Capacity, demand: Demand, frag: FragIndex | None = None) -> Choice | None:
        ties = _near_ties(cap, demand, frag, tolerance)
        if ties is None:
            return None
        c, d, near = ties
        band = near & (cap.arrays.node_used_replicas[c.node] > 0)
        if not band.any():
            return _pick(c, [d, c.node], demand, cap)
        return _pick(c, [~band, c.node, d], demand, cap)

    return rule


def constrained_by_fgd(
    cap: Capacity, demand: Demand, frag: FragIndex | None = None
) -> Choice | None:
    """FGD's own choice for a pod limited to some GPU models, the previous rule for the others: a
    rule that knows the type constraints (the constrained pods are where FGD's fine ranking of
    the models' nodes should matter)."""
    if demand.allowed_products is None:
        return PREVIOUS(cap, demand, frag)
    return fgd(cap, demand, frag)


def best_fit_band(cap: Capacity, demand: Demand, frag: FragIndex | None = None) -> Choice | None:
    """The previous rule whose near-ties go to the node with the least free GPU memory (best fit)
    instead of the lowest node, for every pod: packing by how full a node is, not by where it is
    listed."""
    ties = _near_ties(cap, demand, frag, 0.05)
    if ties is None:
        return None
    c, d, near = ties
    a = cap.arrays
    node_free = a.per_node_sum(a.free)
    return _pick(c, [~near, node_free[c.node], c.node, d], demand, cap)


def pressured(slack: float | None, tie: float | None, full: float | None = None):
    """The shipped rule with other pressure settings for GPU pods (`planner.pressure`): drop the
    models pressed more than `slack` above the least pressed one (None: none), or pressed `full`
    or more (None: none), when another fits; then near-ties toward the models within `tie` of the
    least pressed (None: the lowest node alone decides)."""

    def rule(cap: Capacity, demand: Demand, frag: FragIndex | None = None) -> Choice | None:
        if demand.gpu_count == 0:
            return SHIPPED(cap, demand, frag)
        assert frag is not None
        c = candidates(cap, demand)
        if len(c) == 0:
            return None
        c, pressed = by_pressure(c, cap, frag, slack=slack, tie=tie, full=full)
        return packed_pick(c, pressed, cap, demand, frag)

    return rule


SHIPPED = POLICIES["fgd-packed"]

#: a one-pod rule, as `greedy.POLICIES` holds them
RuleFn = Callable[[Capacity, Demand, FragIndex | None], Choice | None]

#: the planner's rule with other ways to treat GPU models: (one-pod rule, whether its measure
#: counts other models' memory as stranded, as FGD's does). `before`: the rule before it knew GPU
#: models; `tie`: near-ties toward the least pressed model only; `own`: the planner's own count;
#: `full`: leave out models at pressure 1 or more; `0.25`, `slack-0.5`: leave out models pressed
#: that much above the least pressed (the shipped rule: own count, tie and slack 0.5)
MODEL_VARIANTS = {
    "before": (pressured(None, None), True),
    "tie": (pressured(None, PRESSURE_TIE), True),
    "own+tie": (pressured(None, PRESSURE_TIE), False),
    "own+tie+full": (pressured(None, PRESSURE_TIE, full=1.0), False),
    "own+tie+0.25": (pressured(0.25, PRESSURE_TIE), False),
    "slack-0.5": (pressured(PRESSURE_SLACK, None), True),
}

#: one-pod rules measured in the planner's place
VARIANTS = {
    "previous": PREVIOUS,
    "band-5": packed(0.05, gpuless_to_taken_gpus=True),
    "band-0": packed(0.0, gpuless_to_taken_gpus=True),
    "gpuless-lowest": packed(FGD_TOLERANCE, gpuless_to_taken_gpus=False),
    "in-use-band": in_use_band(0.05),
    "in-use-band-10": in_use_band(0.10),
    "constrained-by-fgd": constrained_by_fgd,
    "best-fit-band": best_fit_band,
}


def largest_pods(demands: Sequence[Demand]) -> tuple[int, float] | None:
    """The most GPUs one pod asks (2 or more) and the share of all GPUs asked that such pods ask."""
    counts = [d.gpu_count for d in demands if d.gpu_count > 0]
    k = max(counts, default=0)
    return (k, k * counts.count(k) / sum(counts)) if k >= 2 else None


def idle_gpus(cap: Capacity) -> tuple[np.ndarray, np.ndarray]:
    """Which devices hold no pod, and how many such devices each node has."""
    idle = cap.arrays.used_replicas == 0
    return idle, cap.arrays.per_node_sum(idle.astype(np.int64))


def whole_nodes(reserve: str, largest: tuple[int, float] | None) -> RuleFn:
    """The shipped rule, except that a GPU pod smaller than the list's largest (`largest`: K GPUs
    and their share, `largest_pods`) does not take a node's last K idle GPUs while few nodes
    have them, when it fits elsewhere. `reserve` "one": keep one such node; "one-open": the same
    until a GPU pod first fits nowhere (the cluster is full: a node kept whole from then on only
    turns pods away); "share": keep as many as the largest pods' share of the GPUs asked, applied
    to the idle GPUs, would fill. The rule is made for one replay: "one-open" remembers."""
    failed = False

    def rule(cap: Capacity, demand: Demand, frag: FragIndex | None = None) -> Choice | None:
        nonlocal failed
        done = failed and reserve == "one-open"
        if demand.gpu_count == 0 or largest is None or demand.gpu_count >= largest[0] or done:
            got = SHIPPED(cap, demand, frag)
            failed = failed or (got is None and demand.gpu_count > 0)
            return got
        assert frag is not None
        k, share = largest
        c = candidates(cap, demand)
        if len(c) == 0:
            failed = True
            return None
        c, pressed = by_pressure(c, cap, frag, slack=PRESSURE_SLACK, tie=PRESSURE_TIE)
        idle, per_node = idle_gpus(cap)
        keep = share * float(idle.sum()) / k if reserve == "share" else 1.0
        if (per_node >= k).sum() - 1 < keep:
            left = per_node[c.node] - idle[c.devices].sum(axis=1)
            breaks = (per_node[c.node] >= k) & (left < k)
            if breaks.any() and not breaks.all():
                c = c.take(np.flatnonzero(~breaks))
                pressed = by_pressure(c, cap, frag, slack=None, tie=PRESSURE_TIE)[1]
        return packed_pick(c, pressed, cap, demand, frag)

    return rule


def largest_host(demands: Sequence[Demand]) -> tuple[int, int, int] | None:
    """The most GPUs one pod asks (2 or more), and the least cores and host memory a pod of that
    size asks: what a node must keep free to host one."""
    largest = largest_pods(demands)
    if largest is None:
        return None
    big = [d for d in demands if d.gpu_count == largest[0]]
    return largest[0], min(d.cpu_milli for d in big), min(d.memory_bytes for d in big)


def keep_host_near(band: float, host: tuple[int, int, int] | None) -> RuleFn:
    """The shipped rule, except that while one node is left that can host the list's largest pod
    (K idle GPUs and its cores and memory free), a smaller GPU pod whose placements within `band`
    of a GPU's memory of FGD's least increase include some that leave that node able to host it
    takes the best of those. Unlike `whole_nodes` it never gives up more than `band` of FGD's
    measure to keep the node, and it counts the node's CPU and memory, which the largest pods
    need as much as its GPUs."""

    def rule(cap: Capacity, demand: Demand, frag: FragIndex | None = None) -> Choice | None:
        if demand.gpu_count == 0 or host is None or demand.gpu_count >= host[0]:
            return SHIPPED(cap, demand, frag)
        assert frag is not None
        k, cpu, mem = host
        c = candidates(cap, demand)
        if len(c) == 0:
            return None
        c, pressed = by_pressure(c, cap, frag, slack=PRESSURE_SLACK, tie=PRESSURE_TIE)
        a = cap.arrays
        idle, per_node = idle_gpus(cap)
        hosts = (per_node >= k) & (cap.cpu_free >= cpu) & (cap.mem_free >= mem)
        if int(hosts.sum()) == 1:
            n = c.node
            breaks = hosts[n] & (
                (per_node[n] - idle[c.devices].sum(axis=1) < k)
                | (cap.cpu_free[n] - demand.cpu_milli < cpu)
                | (cap.mem_free[n] - demand.memory_bytes < mem)
            )
            d = np.round(frag.delta(c, demand), 6)
            near = d <= d.min() + band * float(a.capacity.mean())
            ok = near & ~breaks
            if (near & breaks).any() and ok.any():
                keep = np.flatnonzero(ok)
                c, pressed = c.take(keep), pressed[keep]
        return packed_pick(c, pressed, cap, demand, frag)

    return rule


#: `keep_host_near` variants: name -> band (fraction of a GPU's memory)
HOST_VARIANTS = {"host-25": 0.25, "host-any": float("inf")}


#: the planner's rule keeping whole nodes for the largest multi-GPU pods: name -> `reserve` of
#: `whole_nodes`
WHOLE_NODE_VARIANTS = {"keep-one": "one", "keep-one-open": "one-open", "keep-share": "share"}

#: multi-GPU pod types added to the planner's workload profile, weighted by GPUs asked, or every
#: type of the list weighted by pods: name -> which (`by_gpus`)
PROFILE_VARIANTS = {"largest-by-gpus": "largest", "multi-by-gpus": "multi", "all-types": "all"}


def by_gpus(demands: Sequence[Demand], which: str) -> Workload:
    """FGD's profile (the most common types, weighted by pods) plus the multi-GPU types, each
    counted as pods x GPUs: of the largest pods (`which` "largest") or of every multi-GPU pod
    ("multi"); or every type of the list, weighted by pods (`which` "all"). FGD's profile rarely
    holds a multi-GPU type, so its measure keeps no node whole for them."""
    counts = Counter(demand_kind(d) for d in demands)
    if which == "all":
        return Workload.from_counts(counts, max_types=len(counts))
    top = dict(counts.most_common(MAX_TYPES))
    largest = largest_pods(demands)
    for kind, n in counts.items():
        gpus = kind[0]
        if gpus >= 2 and (which == "multi" or (largest is not None and gpus == largest[0])):
            top[kind] = n * gpus
    return Workload.from_counts(top, max_types=len(top))


#: the baselines the planner must not trail
BASELINES = ("fgd", "first-fit", "best-fit", "hot-path")


def _with_rule(rule: str | RuleFn, run: Callable[[], T]) -> T:
    """`run()` with the planner's one-pod rule (its single pods, reference plans and repack
    placements all look up "fgd-packed") replaced by `rule`: a name in `VARIANTS`, "shipped" or
    a rule."""
    if callable(rule):
        POLICIES["fgd-packed"] = rule
    else:
        POLICIES["fgd-packed"] = SHIPPED if rule == "shipped" else VARIANTS[rule]
    try:
        return run()
    finally:
        POLICIES["fgd-packed"] = SHIPPED


def _allocated(
    loaded: tuple,
    policy: str,
    rule: str | RuleFn = "shipped",
    count_foreign: bool | None = None,
    open_cost: float = 0.0,
) -> float:
    """GPUs (1000 MiB) of memory `policy` allocates on a list `tp.load` returned, with the
    planner's one-pod rule replaced by `rule` (`_with_rule`) and its `open_cost`."""
    nodes, tasks, bound, _, workload = loaded
    r = _with_rule(
        rule,
        lambda: run_policy(
            policy,
            nodes,
            tasks,
            bound,
            workload=workload,
            time_limit=0.25,
            count_foreign=count_foreign,
            open_cost=open_cost,
        ),
    )
    return round(r.allocatedMemoryBytes / tp.GPU_MIB, 2)


def variants_on_list(job: tuple[str, int | None]) -> dict:
    pod_list, shuffle = job
    loaded = tp.load(pod_list, 1.3, shuffle)
    got = {b: _allocated(loaded, b) for b in BASELINES}
    got["planner"] = _allocated(loaded, "planner")
    for v in VARIANTS:
        got[f"planner/{v}"] = _allocated(loaded, "planner", v)
    return {"podList": pod_list, "shuffleNodes": shuffle, "allocatedGpus": got}


def models_on_list(job: tuple[str, float, int | None]) -> dict:
    """Baselines, the shipped planner and `MODEL_VARIANTS` on one list, inflation and node order."""
    pod_list, factor, shuffle = job
    loaded = tp.load(pod_list, factor, shuffle)
    got = {b: _allocated(loaded, b) for b in BASELINES}
    got["planner"] = _allocated(loaded, "planner")
    for name, (rule, counts_foreign) in MODEL_VARIANTS.items():
        got[f"planner/{name}"] = _allocated(loaded, "planner", rule, counts_foreign)
    return {"podList": pod_list, "inflate": factor, "shuffleNodes": shuffle, "allocatedGpus": got}


def whole_nodes_on_list(job: tuple[str, float, int | None]) -> dict:
    """Baselines, the shipped planner and `WHOLE_NODE_VARIANTS` on one list, inflation and node
    order."""
    pod_list, factor, shuffle = job
    loaded = tp.load(pod_list, factor, shuffle)
    largest = largest_pods([t.demand for t in loaded[1]])
    got = {b: _allocated(loaded, b) for b in BASELINES}
    got["planner"] = _allocated(loaded, "planner")
    for name, reserve in WHOLE_NODE_VARIANTS.items():
        got[f"planner/{name}"] = _allocated(loaded, "planner", whole_nodes(reserve, largest))
    host = largest_host([t.demand for t in loaded[1]])
    for name, band in HOST_VARIANTS.items():
        got[f"planner/{name}"] = _allocated(loaded, "planner", keep_host_near(band, host))
    return {
        "podList": pod_list,
        "inflate": factor,
        "shuffleNodes": shuffle,
        "largestPod": largest,
        "allocatedGpus": got,
    }


def profile_on_list(job: tuple[str, float, int | None]) -> dict:
    """Baselines, the shipped planner and `PROFILE_VARIANTS` on one list, inflation and node
    order; the profiles count the list's pods before inflation, as FGD's does."""
    pod_list, factor, shuffle = job
    loaded = tp.load(pod_list, factor, shuffle)
    _, listed, _ = read_inputs(
        tp.TRACES / tp.NODE_LIST, tp.TRACES / f"openb_pod_list_{pod_list}.csv"
    )
    demands = [t.demand for t in listed]
    got = {b: _allocated(loaded, b) for b in BASELINES}
    got["planner"] = _allocated(loaded, "planner")
    for name, which in PROFILE_VARIANTS.items():
        profile = by_gpus(demands, which)
        got[f"planner/{name}"] = _allocated((*loaded[:4], profile), "planner")
    return {"podList": pod_list, "inflate": factor, "shuffleNodes": shuffle, "allocatedGpus": got}


def models_table(runs: list[dict], variants: Sequence[str] = tuple(MODEL_VARIANTS)) -> str:
    rules = ["planner", *[f"planner/{v}" for v in variants]]
    lines = [
        "GPUs (1000 MiB) of memory allocated minus the best of " + ", ".join(BASELINES),
        f"{'pod list':12s} {'inflate':>7s} {'order':>5s} {'best':>8s} "
        + " ".join(f"{r.removeprefix('planner/')[-12:]:>12s}" for r in rules),
    ]
    for factor in sorted({r["inflate"] for r in runs}, reverse=True):
        these = [r for r in runs if r["inflate"] == factor]
        margins: dict[str, list[float]] = {r: [] for r in rules}
        for run in these:
            g = run["allocatedGpus"]
            best = max(g[b] for b in BASELINES)
            order = "file" if run["shuffleNodes"] is None else str(run["shuffleNodes"])
            for r in rules:
                margins[r].append(g[r] - best)
            lines.append(
                f"{run['podList']:12s} {factor:7.1f} {order:>5s} {best:8.2f} "
                + " ".join(f"{g[r] - best:+12.2f}" for r in rules)
            )
        label = f"inflate {factor}:"
        lines.append(
            f"{label + ' behind in':36s}"
            + " ".join(f"{sum(m < 0 for m in margins[r]):12d}" for r in rules)
        )
        lines.append(f"{'worst':36s}" + " ".join(f"{min(margins[r]):+12.2f}" for r in rules))
        lines.append(f"{'sum':36s}" + " ".join(f"{sum(margins[r]):+12.2f}" for r in rules))
    lines.append("(column X: the planner with variant X, its name's last 12 characters)")
    return "\n".join(lines)


#: the planner's `--open-gpu-cost` values the open-cost mode measures
OPEN_COSTS = (0.2,)


def open_cost_on_list(job: tuple[str, float, int | None]) -> dict:
    """Baselines, the shipped planner and the planner with each of `OPEN_COSTS` on one list,
    inflation and node order."""
    pod_list, factor, shuffle = job
    loaded = tp.load(pod_list, factor, shuffle)
    got = {b: _allocated(loaded, b) for b in BASELINES}
    got["planner"] = _allocated(loaded, "planner")
    for cost in OPEN_COSTS:
        got[f"planner/open-{cost:g}"] = _allocated(loaded, "planner", open_cost=cost)
    return {"podList": pod_list, "inflate": factor, "shuffleNodes": shuffle, "allocatedGpus": got}


def limited_lists(lists: Sequence[str]) -> list[str]:
    """The lists with pods limited to some GPU models (the only ones `MODEL_VARIANTS` change)."""
    out = []
    for x in lists:
        _, tasks, _, _, workload = tp.load(x, 0.0)
        if workload.limited:
            out.append(x)
    return out


def variants_llm_mixed(_: object = None) -> dict:
    import llm_mixed

    out: dict = {"scenario": "llm-mixed", "placed": {}, "allocatedGiB": {}}
    nodes, tasks, bound = read_inputs(llm_mixed.SCENARIO, llm_mixed.SCENARIO)
    workload = Workload.from_demands(t.demand for t in tasks)
    for label, policy, rule in [
        *[(b, b, "shipped") for b in BASELINES],
        ("planner", "planner", "shipped"),
        *[(f"planner/{v}", "planner", v) for v in VARIANTS],
    ]:
        r = _with_rule(
            rule, partial(llm_mixed.run_labelled, policy, nodes, tasks, bound, workload, 0.25)
        )
        out["placed"][label] = r.placed
        out["allocatedGiB"][label] = round(r.allocatedMemoryBytes / 2**30, 1)
    return out


def variants_table(runs: list[dict], llm: dict) -> str:
    rules = ["planner", *[f"planner/{v}" for v in VARIANTS]]
    lines = [
        "trace, inflate 1.3: GPUs (1000 MiB) of memory allocated minus the best of "
        + ", ".join(BASELINES)
    ]
    lines.append(
        f"{'pod list':12s} {'order':>5s} {'best':>8s} "
        + " ".join(f"{r.removeprefix('planner/')[:12]:>12s}" for r in rules)
    )
    behind = {r: 0 for r in rules}
    total = {r: 0.0 for r in rules}
    worst = {r: float("inf") for r in rules}
    for run in runs:
        g = run["allocatedGpus"]
        best = max(g[b] for b in BASELINES)
        order = "file" if run["shuffleNodes"] is None else str(run["shuffleNodes"])
        cells = []
        for r in rules:
            m = g[r] - best
            behind[r] += m < 0
            total[r] += m
            worst[r] = min(worst[r], m)
            cells.append(f"{m:+12.2f}")
        lines.append(f"{run['podList']:12s} {order:>5s} {best:8.2f} " + " ".join(cells))
    lines.append(f"{'behind in':27s}" + " ".join(f"{behind[r]:12d}" for r in rules))
    lines.append(f"{'worst':27s}" + " ".join(f"{worst[r]:+12.2f}" for r in rules))
    lines.append(f"{'sum':27s}" + " ".join(f"{total[r]:+12.2f}" for r in rules))
    lines.append("(column X: the planner with one-pod rule X, its name cut to 12 characters)")
    lines.append("")
    lines.append("llm-mixed: pods placed / GiB allocated")
    for label in llm["placed"]:
        lines.append(f"  {label:28s} {llm['placed'][label]:4d} / {llm['allocatedGiB'][label]:8.1f}")
    return "\n".join(lines)


def _write(path: Path, start: float, body: dict) -> None:
    body = {
        "command": " ".join(["benchmarks/planner_rules.py", *sys.argv[1:]]),
        "wallSeconds": round(time.perf_counter() - start, 1),
        **body,
    }
    path.write_text(json.dumps(body, indent=1) + "\n")
    print(f"results: {path}")


#: idle-nodes: the planner and the baselines it trails where a largest pod finds no node
IDLE_POLICIES = ("planner", "fgd", "hot-path", "first-fit")
#: the one-pod rule each policy's single pods go through (`greedy.POLICIES`)
_RULE_OF = {"planner": "fgd-packed"}


def _counting_largest(rule: RuleFn, k: int, seen: list[dict]) -> RuleFn:
    """`rule`, noting at each pod asking `k` GPUs how many nodes have `k` idle GPUs, how many of
    those have the pod's cores and memory free too, and whether the rule placed it."""

    def spy(cap: Capacity, demand: Demand, frag: FragIndex | None = None) -> Choice | None:
        if demand.gpu_count != k:
            return rule(cap, demand, frag)
        _, per_node = idle_gpus(cap)
        whole = per_node >= k
        room = whole & (cap.cpu_free >= demand.cpu_milli) & (cap.mem_free >= demand.memory_bytes)
        got = rule(cap, demand, frag)
        seen.append(
            {
                "pod": demand.pod.name,
                "nodesWithIdleGpus": int(whole.sum()),
                "withHostRoom": int(room.sum()),
                "placed": got is not None,
            }
        )
        return got

    return spy


def idle_nodes_on_list(job: tuple[str, float, int | None]) -> dict:
    """One list under every `IDLE_POLICIES` policy, with `_counting_largest` around its rule."""
    pod_list, factor, shuffle = job
    loaded = tp.load(pod_list, factor, shuffle)
    nodes, tasks, bound, _, workload = loaded
    largest = largest_pods([t.demand for t in tasks])
    out: dict = {"list": pod_list, "inflate": factor, "shuffle": shuffle, "policies": {}}
    if largest is None:
        return out
    k = largest[0]
    out["gpus"] = k
    for policy in IDLE_POLICIES:
        name = _RULE_OF.get(policy, policy)
        original = POLICIES[name]
        seen: list[dict] = []
        POLICIES[name] = _counting_largest(original, k, seen)
        try:
            r = run_policy(policy, nodes, tasks, bound, workload=workload, time_limit=0.25)
        finally:
            POLICIES[name] = original
        out["policies"][policy] = {
            "allocatedGpus": round(r.allocatedMemoryBytes / tp.GPU_MIB, 2),
            "largestPods": seen,
        }
    return out


def idle_nodes_table(runs: list[dict]) -> str:
    """Per run, the last five arrivals of the largest pods: nodes with K idle GPUs (with the
    pod's cores and memory free too), per policy; F marks a pod that found no node."""
    lines = []
    for run in runs:
        if "gpus" not in run:
            lines.append(f"{run['list']}: no pod asks 2 GPUs or more")
            continue
        order = "file order" if run["shuffle"] is None else f"order {run['shuffle']}"
        lines.append(
            f"{run['list']}, inflate {run['inflate']:g}, {order}: "
            f"nodes with {run['gpus']} idle GPUs (and the pod's host room) at its last arrivals"
        )
        for policy, got in run["policies"].items():
            cells = [
                f"{p['nodesWithIdleGpus']} ({p['withHostRoom']}){'' if p['placed'] else ' F'}"
                for p in got["largestPods"][-5:]
            ]
            lines.append(f"  {policy:<10} {got['allocatedGpus']:>10.2f} GPUs  " + ", ".join(cells))
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "mode",
        choices=[
            "variants",
            "models",
            "whole-nodes",
            "profile",
            "open-cost",
            "portfolio",
            "idle-nodes",
        ],
    )
    ap.add_argument("--lists", nargs="*", help="pod lists (default: every list found)")
    ap.add_argument("--workers", type=whole(at_least=1), default=2)
    ap.add_argument(
        "--out", type=output_file, help="default: benchmarks/results/planner_rules_<mode>.json"
    )
    ap.add_argument(
        "--shuffle-orders",
        type=whole(at_least=0),
        default=2,
        help="variants, models, whole-nodes, profile, open-cost: shuffled node orders 1..N",
    )
    ap.add_argument(
        "--inflate",
        type=number(at_least=0, at_most=MAX_INFLATE),
        default=1.3,
        help="portfolio, idle-nodes",
    )
    ap.add_argument(
        "--shuffle-nodes", type=whole(at_least=0), default=None, help="portfolio, idle-nodes"
    )
    ap.add_argument(
        "--checkpoints",
        type=number(at_least=0, at_most=1),
        nargs="*",
        default=list(CHECKPOINTS),
        help="portfolio",
    )
    ap.add_argument(
        "--depth",
        type=number(above=0),
        default=1.3,
        help="portfolio: rollout length, x the free GPUs",
    )
    ap.add_argument(
        "--prefix",
        type=number(above=0, at_most=1),
        nargs="*",
        default=[0.1, 0.25],
        help="portfolio",
    )
    return ap


def main() -> int:
    args = build_parser().parse_args()
    out = args.out or RESULTS / f"planner_rules_{args.mode}.json"
    lists = args.lists or tp.trace_lists()
    start = time.perf_counter()
    if args.mode == "models":
        jobs = [
            (x, f, o)
            for x in limited_lists(lists)
            for f in (1.3, 0.0)
            for o in [None, *range(1, args.shuffle_orders + 1)]
        ]
        with ProcessPoolExecutor(args.workers) as pool:
            runs = list(pool.map(models_on_list, jobs))
        print(models_table(runs))
        _write(out, start, {"runs": runs})
        return 0
    # modes that run every list at both inflations and several node orders
    per_run = {
        "open-cost": (open_cost_on_list, [f"open-{c:g}" for c in OPEN_COSTS]),
        "whole-nodes": (whole_nodes_on_list, [*WHOLE_NODE_VARIANTS, *HOST_VARIANTS]),
        "profile": (profile_on_list, list(PROFILE_VARIANTS)),
    }
    if args.mode in per_run:
        job, variants = per_run[args.mode]
        jobs = [
            (x, f, o)
            for f in (1.3, 0.0)
            for o in [None, *range(1, args.shuffle_orders + 1)]
            for x in lists
        ]
        with ProcessPoolExecutor(args.workers) as pool:
            runs = list(pool.map(job, jobs))
        print(models_table(runs, variants))
        _write(out, start, {"runs": runs})
        return 0
    if args.mode == "variants":
        orders: list[int | None] = [None, *range(1, args.shuffle_orders + 1)]
        with ProcessPoolExecutor(args.workers) as pool:
            llm = pool.submit(variants_llm_mixed)
            runs = list(pool.map(variants_on_list, [(x, o) for o in orders for x in lists]))
            llm_result = llm.result()
        print(variants_table(runs, llm_result))
        _write(out, start, {"runs": runs, "llmMixed": llm_result})
        return 0
    if args.mode == "idle-nodes":
        idle_jobs = [(x, args.inflate, args.shuffle_nodes) for x in lists]
        with ProcessPoolExecutor(args.workers) as pool:
            runs = list(pool.map(idle_nodes_on_list, idle_jobs))
        print(idle_nodes_table(runs))
        _write(out, start, {"runs": runs})
        return 0
    portfolio_jobs = [
        (
            x,
            args.inflate,
            args.shuffle_nodes,
            tuple(sorted(args.checkpoints)),
            tuple(args.prefix),
            args.depth,
        )
        for x in lists
    ]
    with ProcessPoolExecutor(args.workers) as pool:
        runs = list(pool.map(one_list, portfolio_jobs))
    print(table(runs))
    _write(out, start, {"runs": runs})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
