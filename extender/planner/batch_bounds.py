"""Proven bounds for a batch over the whole cluster: what no plan can beat, for reports and gaps.

- The *class relaxation* (`relaxation_bound`) merges every node class into one bin with M times
  its free memory, replicas, CPU and memory: any real plan summed over a class's nodes is a
  solution of it, so its optimum can only be lower. It bounds the first goal (pods left out) and,
  weighted below it, the empty GPUs any plan placing every pod must open (`opened_lower_bound`).
- The *arc-flow relaxation* (`arcflow`) keeps the per-GPU thresholds that stranded VRAM is made of
  and relaxes the node instead: it bounds the second goal (`stranded_lower_bound`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from ortools.sat.python import cp_model

from extender.demand import Demand
from extender.planner import clock
from extender.planner.arcflow import ArcFlow
from extender.planner.batch_layout import BatchLayout, PodClass, compat, layout, pod_classes
from extender.planner.capacity import Capacity, FragIndex
from extender.planner.staged import Settings, Stage, staged_solve

__all__ = [
    "batch_arcflow",
    "opened_bound",
    "opened_lower_bound",
    "relaxation_bound",
    "stranded_lower_bound",
]


def relaxation_bound(
    lay: BatchLayout, time_limit: float, num_workers: int, W: int | None = None
) -> float | None:
    """A proven lower bound on the first goal for the *whole* cluster (the class relaxation); with
    `W`, on `W * unplaced + empty GPUs opened`.

    None when there is no bound within `time_limit`, which also bounds building the model: on
    a busy cluster nearly every node is a class of its own, and building a model of hundreds
    of thousands of variables in Python took 9 s at 5,000 nodes (in the server's planner
    thread, holding the GIL the event loop needs). The bound only reports; no plan depends on it."""
    a, cap = lay.a, lay.cap
    deadline = clock.now() + time_limit
    m = cp_model.CpModel()
    placed: list[list[cp_model.IntVar]] = [[] for _ in lay.classes]
    opened = []
    for _key, nodes in lay.groups:
        if clock.now() > deadline:
            return None
        M = len(nodes)
        n0 = nodes[0]
        devs = lay.dev_order[n0]
        dev_b: list[list[cp_model.LinearExprT]] = [[] for _ in devs]
        dev_n: list[list[cp_model.IntVar]] = [[] for _ in devs]
        cpu: list[cp_model.LinearExprT] = []
        mem: list[cp_model.LinearExprT] = []
        for p, pc in enumerate(lay.classes):
            if not lay.usable[p, n0]:
                continue
            n_p, d = len(pc.members), pc.demand
            if pc.k == 0:
                v = m.new_int_var(0, n_p, "")
                placed[p].append(v)
                cpu.append(d.cpu_milli * v)
                mem.append(d.memory_bytes * v)
                continue
            zv = m.new_int_var(0, n_p, "") if pc.k >= 2 else None
            shares = []
            for li, g in enumerate(devs):
                if lay.fit[p, g]:
                    v = m.new_int_var(0, n_p, "")
                    if zv is not None:
                        m.add(v <= zv)
                    dev_b[li].append(int(lay.need[p, g]) * v)
                    dev_n[li].append(v)
                    shares.append(v)
            if not shares:
                continue
            if zv is not None:
                m.add(sum(shares) == pc.k * zv)
                placed[p].append(zv)
                cpu.append(d.cpu_milli * zv)
                mem.append(d.memory_bytes * zv)
            else:
                placed[p].extend(shares)
                cpu.append(d.cpu_milli * sum(shares))
                mem.append(d.memory_bytes * sum(shares))
        if cpu:
            m.add(sum(cpu) <= M * int(cap.cpu_free[n0]))
            m.add(sum(mem) <= M * int(cap.mem_free[n0]))
        for li, g in enumerate(devs):
            if not dev_b[li]:
                continue
            free0 = max(0, int(a.capacity[g] - a.used[g]))
            rep0 = max(0, int(a.replicas[g] - a.used_replicas[g]))
            m.add(sum(dev_b[li]) <= M * free0)
            m.add(sum(dev_n[li]) <= M * rep0)
            if a.used_replicas[g] == 0:
                o = m.new_int_var(0, M, "")
                m.add(sum(dev_b[li]) <= free0 * o)
                m.add(sum(dev_n[li]) <= max(rep0, 1) * o)
                opened.append(o)
    for p, pc in enumerate(lay.classes):
        if placed[p]:
            m.add(sum(placed[p]) <= len(pc.members))
    unplaced = sum(
        pc.weight * (len(pc.members) - sum(placed[p])) for p, pc in enumerate(lay.classes)
    )
    # the first goal is pods placed; with W, the bound is on W * unplaced + opened (fewest GPUs opened)
    goal = unplaced if W is None else W * unplaced + sum(opened)
    if deadline - clock.now() <= 0:
        return None
    result = staged_solve(
        m,
        [Stage("placed", goal, least=0.02)],
        deadline,
        settings=Settings(num_workers, light_presolve=True),
    )
    stage = result.stages[0]
    return float(stage.bound) if stage.solved else None


def opened_bound(relax: float | None, W: int) -> int | None:
    """From a relaxation bound on `W * pods left out + empty GPUs opened` (W above any count of
    GPUs): the fewest empty GPUs a plan placing every pod must open, or None when there is no bound
    or the relaxation finds that no plan places every pod."""
    return int(math.ceil(relax)) if relax is not None and relax < W else None


def opened_lower_bound(
    cap: Capacity,
    demands: Sequence[Demand],
    frag: FragIndex,
    time_limit: float = 5.0,
    num_workers: int = 2,
) -> int | None:
    """The fewest empty GPUs any plan placing every pod of `demands` must open, proven by the class
    relaxation of the whole cluster (`relaxation_bound`), or None (no bound within
    `time_limit`, or no plan places them all). For reports (`make bench-planner`): a batch that a
    greedy plan places whole is planned without the solver, so no plan carries this proof."""
    lay = layout(cap, demands, frag, {})
    if lay.empty:
        return None
    W = len(cap.arrays.capacity) + 1
    return opened_bound(relaxation_bound(lay, time_limit, num_workers, W), W)


def stranded_lower_bound(
    cap: Capacity,
    demands: Sequence[Demand],
    frag: FragIndex,
    time_limit: float = 5.0,
    num_workers: int = 2,
) -> int | None:
    """The fewest KiB by which any plan placing every pod of `demands` changes stranded VRAM (the
    second goal of `batch_goals.evaluate`), proven by the per-GPU arc-flow relaxation, or None."""
    deadline = clock.now() + time_limit
    return batch_arcflow(cap, pod_classes(demands), frag, deadline).solve(deadline, num_workers)


def batch_arcflow(
    cap: Capacity, classes: Sequence[PodClass], frag: FragIndex, deadline: float
) -> ArcFlow:
    """The arc-flow relaxation of a batch: a share may only go to a device it fits, on a node that
    could host its whole pod now."""
    need, fit, usable = compat(cap, classes)
    shares = np.asarray([pc.k * len(pc.members) for pc in classes], np.int64)
    return ArcFlow(frag, need, fit & usable[:, cap.arrays.node_of], shares, deadline)
