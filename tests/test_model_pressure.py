"""Pods limited to some GPU models: the pressure on each model (`planner.pressure`), the planner's
measure that does not count other models' memory as stranded, and the rule that keeps pods with a
choice off the models the limited pods need (docs/packing.md, "Why the planner's rule differs
from FGD's")."""

from __future__ import annotations

import numpy as np
from builders import gpu_node, mig_mixed_node

from extender.demand import Demand, PodRef
from extender.planner import greedy
from extender.planner.capacity import MAX_TYPES, Capacity, FragIndex, Workload
from extender.planner.greedy import place_one
from extender.quantity import GIB
from extender.simulate.engine import build_capacity


def pod(name: str, gib: int, models: set[str] | None = None, *, cpu: int = 0) -> Demand:
    allowed = frozenset(models) if models else None
    return Demand(PodRef("t", name), 1, gib * GIB, cpu_milli=cpu, allowed_products=allowed)


def cluster() -> Capacity:
    """n0: one 80 GiB RARE GPU, listed first; n1, n2: one 80 GiB COMMON GPU each."""
    _, cap = build_capacity(
        [
            gpu_node("n0", count=1, memory_mib=80 * 1024, replicas=8, product="RARE"),
            gpu_node("n1", count=1, memory_mib=80 * 1024, replicas=8, product="COMMON"),
            gpu_node("n2", count=1, memory_mib=80 * 1024, replicas=8, product="COMMON"),
        ]
    )
    return cap


def workload() -> Workload:
    """3 of 7 pods need RARE, 3 COMMON, 1 either; 40 GiB each."""
    return Workload.from_demands(
        [pod(f"r{i}", 40, {"RARE"}) for i in range(3)]
        + [pod(f"c{i}", 40, {"COMMON"}) for i in range(3)]
        + [pod("any", 40)]
    )


def products(cap: Capacity, frag: FragIndex) -> dict[str, float]:
    rho = frag.pressure.per_product()
    return {
        name.removesuffix("-SHARED"): float(rho[pid]) for name, pid in cap.arrays.products.items()
    }


def test_pressure_is_what_the_limited_pods_ask_of_a_model_against_its_free_memory():
    cap = cluster()
    frag = FragIndex(cap, workload())
    # RARE: 3/7 of the demand x 240 GiB free / 80 GiB; COMMON: 3/7 x 240 / 160
    p = products(cap, frag)
    assert np.isclose(p["RARE"], 9 / 7) and np.isclose(p["COMMON"], 9 / 14)
    # a workload with no limited pod puts no pressure anywhere
    free = FragIndex(cap, Workload.from_demands([pod("a", 40), pod("b", 20)]))
    assert not free.pressure.active


def test_the_planner_measure_does_not_count_another_models_memory_as_stranded():
    cap = cluster()
    only_rare = Workload.from_demands([pod("r", 40, {"RARE"})])
    fgd_count = FragIndex(cap, only_rare).node_frag() / GIB
    planner_count = FragIndex(cap, only_rare, count_foreign=False).node_frag() / GIB
    # FGD: a RARE pod cannot run on n1 or n2, so all their free memory is stranded for it
    assert np.allclose(fgd_count, [0, 80, 80])
    assert np.allclose(planner_count, [0, 0, 0])


def test_a_node_without_the_types_resource_still_counts_as_stranded_for_it():
    """Only another GPU *model* is left out: a MIG type on a node of whole GPUs keeps FGD's count
    (all the node's free memory), so the planner still ranks MIG and whole-GPU nodes as FGD does."""
    _, cap = build_capacity(
        [
            gpu_node("whole", count=1, memory_mib=80 * 1024, replicas=4),
            mig_mixed_node("mig", {"1g.10gb": (7, 9856)}),
        ]
    )
    mig_type = Demand(PodRef("t", "m"), 1, 9 * GIB, resource="nvidia.com/mig-1g.10gb")
    w = Workload.from_demands([mig_type])
    fgd_count = FragIndex(cap, w).node_frag()
    assert np.allclose(FragIndex(cap, w, count_foreign=False).node_frag(), fgd_count)
    assert np.isclose(fgd_count[0] / GIB, 80)


def replay(rule: str, count_foreign: bool) -> int:
    cap = cluster()
    frag = FragIndex(cap, workload(), count_foreign=count_foreign)
    placed = 0
    arrivals = [pod("any0", 40), pod("any1", 40)] + [
        pod(f"rare{i}", 40, {"RARE"}) for i in range(2)
    ]
    for d in arrivals:
        choice = greedy.choose(rule, cap, d, frag)
        if choice is not None:
            place_one(cap, d, choice, frag)
            placed += 1
    return placed


def test_pods_with_a_choice_leave_the_model_that_limited_pods_need():
    """Two pods that may go anywhere, then two that need RARE. FGD's measure falls as much on RARE
    as on COMMON (each is stranded for the 3/7 limited to the other), so FGD and first fit take
    n0, the RARE GPU, and the RARE pods find it full. The planner's rule sends both to COMMON."""
    assert replay("fgd", True) == 2
    assert replay("first-fit", True) == 2
    assert replay("fgd-packed", False) == 4


def test_the_first_pod_with_a_choice_goes_to_the_less_pressed_model():
    cap = cluster()
    frag = FragIndex(cap, workload(), count_foreign=False)
    assert greedy.fgd_packed(cap, pod("any", 40), frag)[1] == 1
    assert greedy.fgd(cap, pod("any", 40), FragIndex(cap, workload()))[1] == 0
    # a pod limited to RARE has no choice to make
    assert greedy.fgd_packed(cap, pod("r", 40, {"RARE"}), frag)[1] == 0


def test_every_limited_pod_set_counts_even_beyond_the_common_types():
    common = [pod(f"p{i}", 1 + i % 60, cpu=i) for i in range(2 * MAX_TYPES)]
    rare = pod("rare", 30, {"RARE"})
    w = Workload.from_demands(common + common + [rare])
    assert len(w) == MAX_TYPES and frozenset({"RARE"}) not in w.allowed
    assert w.limited == [("nvidia.com/gpu", frozenset({"RARE"}), 30 * GIB, 0)]
    declared = sum(d.bytes_per_gpu for d in common + common + [rare])
    assert w.gpu_demand == (declared, 0)
