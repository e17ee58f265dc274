"""The planner's one-pod rule: FGD's choice for GPU pods, the lowest node among equal ones, and
GPU-less pods to the node with the least free GPU memory (`fgd-packed`);
what FGD and the other rules choose on the cases that explain the trace's results (docs/packing.md)."""

from __future__ import annotations

import numpy as np
import pytest
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


def delta_gib_by_node(cap: Capacity, frag: FragIndex, pod: Demand) -> dict[int, float]:
    """FGD's measure of placing `pod` on each node, in GiB (each case's nodes have one GPU)."""
    c = candidates(cap, pod, dedupe=False)
    return dict(zip(c.node.tolist(), (frag.delta(c, pod) / GIB).tolist()))


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
    delta = delta_gib_by_node(cap, frag, pod)
    assert np.isclose(delta[0], -7.5) and np.isclose(delta[1], 5.0) and np.isclose(delta[2], 0.0)
    assert greedy.fgd(cap, pod, frag)[1] == 0
    # best-fit: the GPU left with the least free memory (n1: 5 GiB)
    assert greedy.best_fit(cap, pod, frag)[1] == 1
    # vramsched's own rule (the planner's largest-first plan of a batch) has FGD's measure first: n0
    assert greedy.vramsched(cap, pod, frag)[1] == 0


def near_tie_case(rare_weight: float) -> tuple[Capacity, FragIndex, Demand]:
    """n0 holds 40 GiB and n1 45 GiB of one 80 GiB GPU each, n2 is idle; a 20 GiB pod arrives. Most
    pods of the workload need 10 GiB, a share `rare_weight` needs 38 GiB. On n1 the pod fills 20 of
    35 GiB that no 38 GiB pod could use (FGD's measure falls by 20 x weight); on n0 it leaves 20 GiB
    that no 38 GiB pod can use (it rises by 20 x weight); n2 stays usable by both (0)."""
    _, cap = build_capacity(
        [gpu_node(f"n{i}", count=1, memory_mib=80 * 1024, replicas=4) for i in range(3)]
    )
    place_on(cap, demand("a", 40), 0)
    place_on(cap, demand("b", 45), 1)
    w = [demand(f"small{i}", 10) for i in range(round(100 * (1 - rare_weight)))]
    w += [demand(f"rare{i}", 38) for i in range(round(100 * rare_weight))]
    return cap, FragIndex(cap, Workload.from_demands(w)), demand("p", 20)


def test_fgd_packed_keeps_fgd_choice_for_a_gpu_pod_however_near_the_others():
    # weight 0.01: n1 -0.2 GiB, n2 0, n0 +0.2 GiB: a band of 1% of an 80 GiB GPU (0.8 GiB) would
    # pack the pod onto the lowest node as first-fit does; the rule has no band (FGD_TOLERANCE 0)
    cap, frag, pod = near_tie_case(0.01)
    delta = delta_gib_by_node(cap, frag, pod)
    assert np.allclose([delta[0], delta[1], delta[2]], [0.2, -0.2, 0.0])
    assert greedy.fgd(cap, pod, frag)[1] == 1  # the least increase, by 0.4 GiB of expectation
    assert greedy.fgd_packed(cap, pod, frag)[1] == 1
    assert greedy.first_fit(cap, pod, frag)[1] == 0
    assert greedy.FGD_TOLERANCE == 0.0


def test_fgd_packed_takes_the_lowest_node_among_equal_fgd_choices():
    # three idle nodes: every placement of the pod keeps its GPU usable by every type (0)
    _, cap = build_capacity(
        [gpu_node(f"n{i}", count=1, memory_mib=80 * 1024, replicas=4) for i in range(3)]
    )
    frag = FragIndex(cap, Workload.from_demands([demand("w", 10)]))
    pod = demand("p", 20)
    assert np.allclose(frag.delta(candidates(cap, pod, dedupe=False), pod), 0.0)
    assert greedy.fgd_packed(cap, pod, frag)[1] == 0


def gpuless_case() -> tuple[Capacity, FragIndex, Demand]:
    """n0 and n1: one idle 80 GiB GPU each; n2: its GPU taken by a 78 GiB pod. Every node has 64
    cores; the workload's GPU pods need 8 cores and 10 GiB. A GPU-less pod of 8 cores arrives."""
    _, cap = build_capacity(
        [gpu_node(f"n{i}", count=1, memory_mib=80 * 1024, replicas=8, cpu="64") for i in range(3)]
    )
    place_on(cap, demand("big", 78), 2)
    frag = FragIndex(cap, Workload.from_demands([demand("w", 10, cpu=8000)]))
    cpu_pod = Demand(PodRef("t", "cpu"), 0, None, cpu_milli=8000)
    return cap, frag, cpu_pod


def test_a_gpu_less_pod_goes_where_the_gpus_are_taken():
    cap, frag, pod = gpuless_case()
    c = candidates(cap, pod, dedupe=False)
    # FGD's measure is flat: every node keeps 56 cores, enough for the workload's pods
    assert np.allclose(frag.delta(c, pod), 0.0)
    assert greedy.fgd(cap, pod, frag)[1] == 0 and greedy.first_fit(cap, pod, frag)[1] == 0
    # the planner's rule: n2, whose GPU has 2 GiB left, over the idle GPUs of n0 and n1
    res, node, _ = greedy.fgd_packed(cap, pod, frag)
    assert res is None and node == 2


def gpuless_short_of_cpu_case(used_gib: int) -> tuple[Capacity, FragIndex, Demand]:
    """n0 and n1: one idle 80 GiB GPU and 64 cores each; n2: a GPU holding `used_gib` and 10 cores.
    The workload's GPU pods need 8 cores and 1 GiB; a GPU-less pod of 8 cores arrives and would
    leave n2 2 cores, stranding what n2's GPU has free."""
    _, cap = build_capacity(
        [gpu_node(f"n{i}", count=1, memory_mib=80 * 1024, replicas=8, cpu="64") for i in range(2)]
        + [gpu_node("n2", count=1, memory_mib=80 * 1024, replicas=8, cpu="10")]
    )
    place_on(cap, demand("big", used_gib), 2)
    frag = FragIndex(cap, Workload.from_demands([demand("w", 1, cpu=8000)]))
    return cap, frag, Demand(PodRef("t", "cpu"), 0, None, cpu_milli=8000)


def test_a_gpu_less_pod_strands_at_most_a_tenth_of_a_gpu_to_go_where_the_gpus_are_taken():
    # n2 keeps 6 GiB free: the pod strands them (+6 GiB, 7.5% of a GPU, within GPULESS_TOLERANCE)
    # and the rule takes n2 anyway, the node with the least free GPU memory
    cap, frag, pod = gpuless_short_of_cpu_case(74)
    delta = delta_gib_by_node(cap, frag, pod)
    assert np.allclose([delta[0], delta[1], delta[2]], [0.0, 0.0, 6.0])
    assert greedy.fgd_packed(cap, pod, frag)[1] == 2
    # n2 keeps 20 GiB free: stranding them (25% of a GPU) is beyond the band, so the lowest node
    cap, frag, pod = gpuless_short_of_cpu_case(60)
    assert np.isclose(delta_gib_by_node(cap, frag, pod)[2], 20.0)
    assert greedy.fgd_packed(cap, pod, frag)[1] == 0
    assert greedy.GPULESS_TOLERANCE == 0.1


def test_gpu_less_pods_keep_the_gpu_nodes_cpu_for_gpu_pods():
    """Eight 8-core GPU-less pods, then 10 GiB GPU pods of 8 cores: FGD stacks the GPU-less pods on
    n0 until one more would strand its GPU, and n0's GPU goes mostly unused; the planner's rule
    puts them on n2, and n0 and n1 fill their GPUs."""
    results = {}
    for rule in ("fgd", "fgd-packed"):
        cap, frag, _ = gpuless_case()
        for i in range(8):
            cpu_pod = Demand(PodRef("t", f"cpu{i}"), 0, None, cpu_milli=8000)
            place_one(cap, cpu_pod, greedy.choose(rule, cap, cpu_pod, frag), frag)
        placed = 0
        for i in range(16):
            gpu_pod = demand(f"g{i}", 10, cpu=8000)
            choice = greedy.choose(rule, cap, gpu_pod, frag)
            if choice is not None:
                place_one(cap, gpu_pod, choice, frag)
                placed += 1
        results[rule] = placed
    # FGD: 7 GPU-less pods on n0 (8 cores left: one GPU pod), the 8th on n1 (7 GPU pods), none on
    # n2 (2 GiB left); the planner's rule: n2's 64 cores, then 8 GPU pods each on n0 and n1
    assert results == {"fgd": 8, "fgd-packed": 16}


def test_the_planner_follows_its_rule_for_one_pod_and_for_the_reference_plan():
    cap, frag, pod = cpu_starved_case()
    assert model.SEQUENTIAL_RULE == "fgd-packed"
    assert greedy.fgd_packed(cap, pod, frag)[1] == greedy.fgd(cap, pod, frag)[1] == 0
    plan = solve_batch(cap, [pod], frag, time_limit=1, num_workers=1)
    assert plan.choices[0][1] == 0
    # a batch whose FGD sequential plan places every pod keeps that plan: both pods go where FGD puts them
    other = demand("q", 15, cpu=0)
    plan = solve_batch(cap, [pod, other], frag, time_limit=1, num_workers=1)
    sequential = greedy.greedy_batch(
        cap, [pod, other], frag, order="arrival", rule=model.SEQUENTIAL_RULE
    )
    assert not plan.improved and {i: ch[1] for i, ch in plan.choices.items()} == {
        i: ch[1] for i, ch in sequential.items()
    }
    assert plan.choices[0][1] == 0


def open_gpu_case(open_cost: float) -> tuple[Capacity, FragIndex, Demand]:
    """Two nodes of one 80 GiB time-sliced GPU: n0 holds a 23 GiB model, n1 is idle. A quarter of
    the workload is 49 GiB models (Mixtral's share per GPU), the rest 23 GiB ones. Another 23 GiB
    pod on n0 leaves 34 GiB no 49 GiB model can use (FGD's measure rises by 34 x 1/4 = 8.5 GiB);
    on n1 it keeps 57 GiB every model can use (0), but opens a second GPU."""
    _, cap = build_capacity(
        [gpu_node(f"n{i}", count=1, memory_mib=80 * 1024, replicas=4) for i in range(2)]
    )
    place_on(cap, demand("llama", 23), 0)
    w = [demand(f"small{i}", 23) for i in range(3)] + [demand("mixtral", 49)]
    return cap, FragIndex(cap, Workload.from_demands(w), open_cost=open_cost), demand("p", 23)


def test_open_gpu_cost_shares_a_gpu_in_use_where_fgd_opens_an_idle_one():
    cap, frag, pod = open_gpu_case(0.0)
    delta = delta_gib_by_node(cap, frag, pod)
    assert np.isclose(delta[0], 8.5) and np.isclose(delta[1], 0.0)
    assert greedy.fgd_packed(cap, pod, frag)[1] == 1  # FGD's measure alone: open n1
    # a charge of 0.2 x 80 GiB = 16 GiB for opening n1 outweighs the 8.5 GiB on n0
    cap, frag, pod = open_gpu_case(0.2)
    assert greedy.fgd_packed(cap, pod, frag)[1] == 0
    # a charge below the 8.5 GiB (0.1 x 80 GiB = 8 GiB) leaves FGD's choice
    cap, frag, pod = open_gpu_case(0.1)
    assert greedy.fgd_packed(cap, pod, frag)[1] == 1


def test_open_gpu_cost_counts_devices_not_their_memory():
    """An idle 16 GiB T4 and an idle 80 GiB A100 cost the same to open (the cluster's mean device
    memory each): charging memory would send small models to a T4 each."""
    _, cap = build_capacity(
        [
            gpu_node("a100", count=2, memory_mib=80 * 1024, replicas=4),
            gpu_node("t4", count=1, memory_mib=16 * 1024, replicas=1),
        ]
    )
    c = candidates(cap, demand("p", 8), dedupe=False)
    opened = greedy.opened_memory(c, cap)
    mean = float(cap.arrays.capacity.mean())
    assert np.allclose(opened, mean)  # every device is idle: each candidate opens one
    place_on(cap, demand("q", 8), 0)
    c = candidates(cap, demand("p", 8), dedupe=False)
    opened = greedy.opened_memory(c, cap)
    used = cap.arrays.used_replicas[c.devices[:, 0]] > 0
    assert np.allclose(opened[used], 0.0) and np.allclose(opened[~used], mean)


@pytest.mark.parametrize("bad", [-0.1, float("nan"), float("inf")])
def test_open_gpu_cost_must_be_a_finite_number_at_least_zero(bad: float) -> None:
    _, cap = build_capacity([gpu_node("n0", count=1, memory_mib=80 * 1024, replicas=4)])
    with pytest.raises(ValueError, match="open_cost"):
        FragIndex(cap, Workload.from_demands([demand("w", 10)]), open_cost=bad)


def test_fgd_measure_weighs_in_integers_and_scales_counts_that_would_overflow():
    """The measure is weighed by pods per type in int64 (exact on every machine); a pod count
    that, times a node's memory, would pass 62 bits is scaled down in proportion, and the measure
    stays what the float shares give."""
    cap, _, pod = cpu_starved_case()
    kinds = [demand("w8cpu", 10, cpu=8000), demand("w15", 15)]
    base = Workload.from_demands(kinds)
    huge = Workload.from_demands(kinds)
    huge.count = np.asarray([3 * 10**12, 10**12], np.int64)  # weights as counted: 3 to 1
    huge.weight = huge.count / huge.count.sum()
    for w in (base, huge):
        frag = FragIndex(cap, w)
        assert frag.count.dtype == np.int64
        assert frag.count_total * 80 * GIB < 1 << 62  # a node's memory times it fits int64
        run = frag.runnable(cap.cpu_free, cap.mem_free, frag.okc)
        want = np.where(run, frag.A, frag.total[:, None]) @ w.weight
        np.testing.assert_allclose(frag.node_frag(), want, rtol=1e-6)
    assert FragIndex(cap, huge).count.tolist() != huge.count.tolist()  # it was scaled
