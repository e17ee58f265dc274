"""The arc-flow relaxation: its stranded-VRAM bound against brute force, and the plan built from it."""

from __future__ import annotations

import random

import pytest
from builders import gpu_node
from test_planner_model import brute_force, demand

from extender.ledger import check_invariant
from extender.planner import model
from extender.planner.batch_goals import evaluate, valid
from extender.planner.capacity import FragIndex, Workload
from extender.planner.greedy import greedy_batch
from extender.simulate.engine import build_capacity


def _case(seed: int, *, multi: bool):
    rng = random.Random(seed)
    nodes = [
        gpu_node(
            f"n{i}",
            count=2,
            memory_mib=80 * 1024,
            replicas=3,
            cpu=str(rng.choice([4, 8] if multi else [64])),
        )
        for i in range(2)
    ]
    _, cap = build_capacity(nodes)
    demands = [
        demand(
            f"p{i}",
            rng.choice([10, 20, 30, 40, 50]),
            gpus=rng.choice([1, 1, 2]) if multi else 1,
            cpu=rng.choice([1000, 3000]) if multi else 0,
        )
        for i in range(3)
    ]
    profile = [demand("t1", 40), demand("t2", 20), demand("t4", 70)]
    if multi:
        profile.append(demand("t3", 40, gpus=2, cpu=2000))
    return cap, demands, FragIndex(cap, Workload.from_demands(profile))


@pytest.mark.parametrize("seed", [0, 2, 3, 4, 5, 6, 7, 8])  # seed 1: no plan places every pod
def test_stranded_bound_is_never_above_the_best_plan(seed):
    # multi-GPU pods, CPU limits and a multi-GPU type in the profile: what the relaxation drops
    cap, demands, frag = _case(seed, multi=True)
    best = brute_force(cap, demands, frag)
    assert best[0] == 0
    bound = model.stranded_lower_bound(cap, demands, frag, time_limit=10, num_workers=1)
    assert bound is not None and bound <= best[1]


@pytest.mark.parametrize("seed", range(6))
def test_stranded_bound_is_exact_for_single_gpu_pods_with_room(seed):
    # single-GPU pods and types, CPU to spare: nothing is relaxed, so the bound is the optimum
    # (up to rounding each GPU's change down to whole KiB)
    cap, demands, frag = _case(seed, multi=False)
    best = brute_force(cap, demands, frag)
    assert best[0] == 0
    bound = model.stranded_lower_bound(cap, demands, frag, time_limit=10, num_workers=1)
    assert best[1] - len(cap.arrays.capacity) <= bound <= best[1]


def _packable(n_nodes: int, sizes: list[int]):
    _, cap = build_capacity(
        [gpu_node(f"n{i}", count=2, memory_mib=80 * 1024, replicas=8) for i in range(n_nodes)]
    )
    demands = [demand(f"p{i}", gib) for i, gib in enumerate(sizes)]
    return cap, demands, FragIndex(cap, Workload.from_demands(demands))


# 160 GiB of pods for two empty 80 GiB GPUs (40+30+10 and 20+30+30): FGD one pod at a time opens four
SIX = [20, 30, 30, 30, 10, 40]
# 17 pods on three nodes: FGD's sequential plan strands memory, the relaxation's plan none
SEVENTEEN = [30, 30, 20, 20, 10, 30, 40, 10, 30, 10, 40, 20, 40, 40, 20, 20, 20]


def test_flow_plan_reaches_the_bound_where_fgd_one_pod_at_a_time_strands_memory():
    cap, demands, frag = _packable(2, SIX)
    reference = evaluate(
        cap, demands, greedy_batch(cap, demands, frag, order="arrival", rule="fgd"), frag
    )
    flow = model.flow_plan(cap, demands, frag, time_limit=10, num_workers=1)
    cost = evaluate(cap, demands, flow, frag)
    assert len(flow) == len(SIX) and valid(cap, demands, flow, frag)
    assert reference[1] > 0 and reference[2] == 4
    assert (
        cost[1] == 0 == model.stranded_lower_bound(cap, demands, frag, time_limit=10, num_workers=1)
    )
    assert cost[2] == 2  # the two GPUs the sizes fill exactly
    assert (
        check_invariant(cap.ledger) == [] and int(cap.arrays.used.sum()) == 0
    )  # capacity restored


def test_a_large_batch_takes_the_flow_plan_and_a_small_one_keeps_fgds():
    cap, demands, frag = _packable(3, SEVENTEEN)
    plan = model.solve_batch(cap, demands, frag, time_limit=10, num_workers=1, prove=True)
    assert plan.status == "FLOW" and plan.improved and plan.placed == len(SEVENTEEN)
    assert plan.greedy_cost[1] > 0 and plan.cost[1] == 0 and plan.cost[2] <= plan.greedy_cost[2]
    assert valid(cap, demands, plan.choices, frag)
    # the proof: stranded VRAM cannot go below the bound, and the plan is at it
    assert plan.stats["strandedLowerBoundKiB"] == 0
    assert (
        plan.stages[-1].status == "BOUNDED"
        and plan.stages[-1].objective == plan.cost[1]
        and plan.gap == 0
    )
    # a batch of SMALL_BATCH pods or fewer (the trace's bursts) keeps FGD's sequential plan
    cap, demands, frag = _packable(2, SIX)
    plan = model.solve_batch(cap, demands, frag, time_limit=10, num_workers=1, prove=True)
    assert plan.status == "GREEDY" and plan.cost[1] > 0
    assert plan.stats["strandedLowerBoundKiB"] == 0 and plan.gap == 1.0


def test_flow_plan_honours_cpu_and_falls_back_to_fgd_for_what_it_cannot_place():
    # the relaxation ignores CPU: with 2 CPUs per node only two pods fit on each node,
    # whatever the GPUs hold; every pod still gets a valid place
    _, cap = build_capacity(
        [gpu_node(f"n{i}", count=2, memory_mib=80 * 1024, replicas=8, cpu="2") for i in range(9)]
    )
    demands = [demand(f"p{i}", gib, cpu=1000) for i, gib in enumerate(SEVENTEEN)]
    frag = FragIndex(cap, Workload.from_demands(demands))
    flow = model.flow_plan(cap, demands, frag, time_limit=10, num_workers=1)
    assert len(flow) == len(SEVENTEEN) and valid(cap, demands, flow, frag)
    per_node: dict[int, int] = {}
    for _, n, _ in flow.values():
        per_node[n] = per_node.get(n, 0) + 1
    assert max(per_node.values()) <= 2


def test_no_bound_when_the_batch_cannot_be_placed_whole():
    cap, _, frag = _packable(1, [])
    assert (
        model.stranded_lower_bound(
            cap, [demand(f"q{i}", 50) for i in range(3)], frag, time_limit=5, num_workers=1
        )
        is None
    )
