"""The planner's one-pod rule is FGD's: what that choice is on the case that explains the trace's
churn result (docs/packing.md, "The churn replay: why the planner keeps FGD's rule")."""

from __future__ import annotations

import numpy as np
from builders import gpu_node

from extender.demand import Demand, PodRef
from extender.planner import greedy, model
from extender.planner.capacity import Capacity, FragIndex, Workload, candidates
from extender.planner.greedy import place_one
from extender.planner.model import solve_batch
from extender.quantity import GIB
from extender.simulate.engine import build_capacity


def demand(name: str, gib: int, *, cpu: int = 0) -> Demand:
    return Demand(PodRef("t", name), 1, gib * GIB, cpu_milli=cpu)


def place_on(cap: Capacity, d: Demand, node_row: int) -> None:
    c = candidates(cap, d, dedupe=False)
    j = int(np.flatnonzero(c.node == node_row)[0])
    place_one(cap, d, (c.reservation(cap.arrays, j, d), node_row, False))


def cpu_starved_case() -> tuple[Capacity, FragIndex, Demand]:
    """n0: a GPU with 30 GiB free on a node with 1 core left; n1: a GPU with 20 GiB free on a node
    with 64 cores; n2: idle. Half the workload needs 8 cores, so n0's free memory is stranded for it."""
    _, cap = build_capacity(
        [
            gpu_node("n0", count=1, memory_mib=80 * 1024, replicas=4, cpu="4"),
            gpu_node("n1", count=1, memory_mib=80 * 1024, replicas=4),
            gpu_node("n2", count=1, memory_mib=80 * 1024, replicas=4),
        ]
    )
    place_on(cap, demand("cpu-heavy", 50, cpu=3000), 0)
    place_on(cap, demand("large", 60), 1)
    frag = FragIndex(cap, Workload.from_demands([demand("w8cpu", 10, cpu=8000), demand("w15", 15)]))
    return cap, frag, demand("p", 15, cpu=1000)


def test_fgd_fills_the_roomier_gpu_of_a_cpu_starved_node_where_best_fit_takes_the_tightest():
    cap, frag, pod = cpu_starved_case()
    # FGD: n0's 30 GiB are stranded for the 8-core type (its node has 1 core left), so filling them
    # lowers the measure (-15 GiB x 1/2); n1 would keep 5 GiB no type can use (+5 GiB); n2 opens a GPU
    # whose 65 GiB every type can still use (0).
    c = candidates(cap, pod, dedupe=False)
    delta = dict(zip(c.node.tolist(), (frag.delta(c, pod) / GIB).tolist()))
    assert np.isclose(delta[0], -7.5) and np.isclose(delta[1], 5.0) and np.isclose(delta[2], 0.0)
    assert greedy.fgd(cap, pod, frag)[1] == 0
    # best-fit: the GPU left with the least free memory (n1: 5 GiB)
    assert greedy.best_fit(cap, pod, frag)[1] == 1
    # vramsched's own rule (the planner's largest-first plan of a batch) has FGD's measure first: n0
    assert greedy.vramsched(cap, pod, frag)[1] == 0


def test_the_planner_follows_fgd_for_one_pod_and_for_the_reference_plan():
    cap, frag, pod = cpu_starved_case()
    assert model.SEQUENTIAL_RULE == "fgd"
    plan = solve_batch(cap, [pod], frag, time_limit=1, num_workers=1)
    assert plan.choices[0][1] == 0
    # a batch whose FGD sequential plan places every pod keeps that plan: both pods go where FGD puts them
    other = demand("q", 15, cpu=0)
    plan = solve_batch(cap, [pod, other], frag, time_limit=1, num_workers=1)
    sequential = greedy.greedy_batch(cap, [pod, other], frag, order="arrival", rule="fgd")
    assert not plan.improved and {i: ch[1] for i, ch in plan.choices.items()} == {
        i: ch[1] for i, ch in sequential.items()
    }
    assert plan.choices[0][1] == 0
