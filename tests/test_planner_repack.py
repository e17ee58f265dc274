"""Repacking by migration (`extender.planner.repack`) against a brute force on small clusters.

The brute force tries every set of movable pods by size, removes them, and searches every way to
place them back together with the blocked pod (every k-subset of fitting devices of every node):
the first size that works is the fewest moves. The model must find exactly that many, prove it,
and its plan, applied through the ledger, must leave no device, node CPU or node memory
overcommitted.
"""

from __future__ import annotations

import itertools
import random
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pytest
from builders import gpu_node

from extender.demand import Demand, PodRef
from extender.ledger import LedgerError, Reservation, check_invariant
from extender.planner.capacity import Capacity
from extender.planner.move_model import need_bytes, reservation_for
from extender.planner.repack import (
    Neighbourhood,
    apply_plan,
    final_state_fits,
    plan_repack,
    search_repack,
)
from extender.planner.repack_counts import solve_counts
from extender.planner.repack_pool import Pool, dominates
from extender.quantity import GIB
from extender.simulate.engine import build_capacity

Running = list[tuple[Demand, Reservation]]


def demand(name: str, gib: int | None, *, gpus: int = 1, cpu: int = 0, prio: int = 0) -> Demand:
    """A pod asking `gpus` devices with `gib` GiB each (None: whole devices), `cpu` millicores."""
    return Demand(
        PodRef("default", name),
        gpus,
        None if gib is None else gib * GIB,
        cpu_milli=cpu,
        memory_bytes=GIB if cpu else 0,
        priority=prio,
    )


def placements(cap: Capacity, d: Demand) -> list[tuple[int, tuple[int, ...]]]:
    """Every way to place `d` now: (node row, device rows), every k-subset of fitting devices."""
    a = cap.arrays
    need = need_bytes(cap, d)
    out: list[tuple[int, tuple[int, ...]]] = []
    for n in range(len(a.node_names)):
        if cap.cpu_free[n] < d.cpu_milli or cap.mem_free[n] < d.memory_bytes:
            continue
        if d.gpu_count == 0:
            out.append((n, ()))
            continue
        lo, hi = int(a.node_start[n]), int(a.node_start[n + 1])
        ok = [
            r
            for r in range(lo, hi)
            if cap.matches(d.resource, d.allowed_products)[r]
            and a.used_replicas[r] < a.replicas[r]
            and a.capacity[r] - a.used[r] >= need[r]
            and a.per_pod_cap[r] >= need[r]
        ]
        out += [(n, rows) for rows in itertools.combinations(ok, d.gpu_count)]
    return out


def place_all(
    cap: Capacity, pods: Sequence[Demand], allowed: Callable[[Demand], Any] | None = None
) -> bool:
    """Whether `pods` can all be placed together now, each on a node `allowed` gives it (None:
    any); exhaustive, capacity restored."""
    if not pods:
        return True
    d, rest = pods[0], pods[1:]
    mask = allowed(d) if allowed is not None else None
    for n, rows in placements(cap, d):
        if mask is not None and not mask[n]:
            continue
        res = reservation_for(cap, d, n, rows) if rows else None
        cap.apply(d, res, n)
        try:
            if place_all(cap, rest, allowed):
                return True
        finally:
            cap.remove(d, n)
    return False


def brute_force(
    cap: Capacity,
    pod: Demand,
    running: Running,
    movable: Callable[[Demand], bool] | None = None,
    pod_nodes: np.ndarray | None = None,
    target_nodes: Callable[[Demand], Any] | None = None,
) -> int | None:
    """The fewest running pods to move so that they and `pod` all fit again, `pod` on a node
    `pod_nodes` allows and each moved pod on one `target_nodes` allows (None: any); None: no
    number."""
    ledger = cap.ledger
    pool = [(d, r) for d, r in running if movable is None or movable(d)]
    for size in range(len(pool) + 1):
        for subset in itertools.combinations(pool, size):
            for d, r in subset:
                cap.remove(d, ledger.node_row(r.node) or 0)
            try:
                ok = any(
                    _placed_then(cap, pod, n, rows, [d for d, _ in subset], target_nodes)
                    for n, rows in placements(cap, pod)
                    if pod_nodes is None or pod_nodes[n]
                )
            finally:
                for d, r in subset:
                    cap.apply(d, r if r.device_ids else None, ledger.node_row(r.node) or 0)
            if ok:
                return size
    return None


def _placed_then(
    cap: Capacity,
    d: Demand,
    n: int,
    rows: tuple[int, ...],
    rest: Sequence[Demand],
    allowed: Callable[[Demand], Any] | None = None,
) -> bool:
    """Whether, with `d` on node `n` (`rows`), `rest` can all be placed (capacity restored)."""
    res = reservation_for(cap, d, n, rows) if rows else None
    cap.apply(d, res, n)
    try:
        return place_all(cap, rest, allowed)
    finally:
        cap.remove(d, n)


def random_case(seed: int) -> tuple[Capacity, Demand, Running]:
    """2-3 nodes of 1-3 GPUs of 80 GiB (2-4 replicas, 8-16 cores), filled first-fit with random
    pods (one or two GPUs, or none; 10-70 GiB; 0-6 cores); the blocked pod is one more that
    does not fit now (when one of a few draws does not)."""
    rng = random.Random(seed)
    nodes = [
        gpu_node(
            f"n{i}",
            count=rng.choice([1, 2, 3]),
            memory_mib=80 * 1024,
            replicas=rng.choice([2, 3, 4]),
            cpu=str(rng.choice([8, 16])),
        )
        for i in range(rng.choice([2, 3]))
    ]
    _, cap = build_capacity(nodes)
    running: Running = []
    for i in range(rng.randint(5, 9)):
        gpus = rng.choice([0, 1, 1, 1, 2])
        d = demand(
            f"r{i}",
            rng.choice([10, 20, 30, 40, 50, 70]) if gpus else None,
            gpus=gpus,
            cpu=rng.choice([0, 2000, 4000, 6000]) if gpus else rng.choice([2000, 6000]),
        )
        options = placements(cap, d)
        if not options:
            continue
        n, rows = options[rng.randrange(len(options))]
        res = reservation_for(cap, d, n, rows)
        cap.apply(d, res if rows else None, n)
        running.append((d, res))
    for _ in range(6):  # a pod that does not fit now, when a few draws find one
        pod = demand(
            "blocked",
            rng.choice([30, 40, 50, 60, 70, 80]),
            gpus=rng.choice([1, 1, 1, 2]),
            cpu=rng.choice([0, 2000, 4000]),
        )
        if not placements(cap, pod):
            break
    return cap, pod, running


def ledger_state(cap: Capacity) -> tuple[object, ...]:
    res = sorted(
        (r.key, r.node, r.device_ids, r.bytes_per_device) for r in cap.ledger.reservations()
    )
    return (res, cap.cpu_free.tolist(), cap.mem_free.tolist())


def assert_plan_is_sound(cap: Capacity, plan, running: Running) -> None:
    """The plan applied through the ledger: invariant holds, CPU and memory not overcommitted,
    every pod on k distinct devices of one node, of its resource."""
    apply_plan(cap, plan)
    assert check_invariant(cap.ledger) == []
    assert (cap.cpu_free >= 0).all() and (cap.mem_free >= 0).all()
    a = cap.arrays
    for d, res in [*((m.demand, m.target) for m in plan.moves), (plan.pod, plan.placement)]:
        assert len(set(res.device_ids)) == d.gpu_count
        for dev in res.device_ids:
            r = cap.ledger.row(res.node, dev)  # one node: every device is looked up on it
            assert r is not None and a.resource_id[r] == a.resources[d.resource]
        if d.gpu_count:
            assert cap.ledger.reservation(d.pod.key).same_placement(res)
    keys = {d.pod.key for d, _ in running}
    assert {m.pod.key for m in plan.moves} <= keys


SEEDS = range(80)


@pytest.mark.parametrize("seed", SEEDS)
def test_fewest_moves_is_the_brute_force_minimum_and_never_overcommits(seed):
    cap, pod, running = random_case(seed)
    best = brute_force(cap, pod, running)
    found = search_repack(cap, pod, running, time_limit=10, num_workers=1)
    if best is None:
        assert found.plan is None and found.proven
        return
    plan = found.plan
    assert plan is not None, found
    assert len(plan.moves) == best
    assert plan.optimal and found.proven
    before = ledger_state(cap)
    assert final_state_fits(cap, plan)
    assert_plan_is_sound(cap, plan, running)
    assert ledger_state(cap) != before or best == 0


@pytest.mark.parametrize("seed", range(120))
def test_the_pod_goes_only_to_the_nodes_it_may_use(seed):
    """kube-scheduler's labels and taints may leave the blocked pod some nodes only: the fewest
    moves that put it on one of those, as the brute force finds them, and never elsewhere."""
    cap, pod, running = random_case(seed)
    rng = random.Random(seed)
    n_nodes = len(cap.arrays.node_names)
    pod_nodes = np.array([rng.random() < 0.5 for _ in range(n_nodes)])
    best = brute_force(cap, pod, running, pod_nodes=pod_nodes)
    found = search_repack(cap, pod, running, time_limit=10, num_workers=1, pod_nodes=pod_nodes)
    if best is None:
        assert found.plan is None and found.proven
        return
    plan = found.plan
    assert plan is not None and len(plan.moves) == best and found.proven, found
    assert pod_nodes[cap.ledger.node_row(plan.placement.node)]
    assert_plan_is_sound(cap, plan, running)


@pytest.mark.parametrize("seed", range(40))
def test_moved_pods_go_only_to_the_nodes_they_may_use(seed):
    """Each running pod may go to some nodes only (its own kept for staying): the fewest moves,
    as the brute force finds them with every moved pod on a node it may use, and no plan that
    sends one elsewhere."""
    cap, pod, running = random_case(seed)
    rng = random.Random(1000 + seed)
    n_nodes = len(cap.arrays.node_names)
    masks = {d.pod.key: np.array([rng.random() < 0.6 for _ in range(n_nodes)]) for d, _ in running}

    def target_nodes(d: Demand) -> np.ndarray | None:
        return masks.get(d.pod.key)

    best = brute_force(cap, pod, running, target_nodes=target_nodes)
    found = search_repack(
        cap, pod, running, time_limit=10, num_workers=1, target_nodes=target_nodes
    )
    if best is None:
        assert found.plan is None and found.proven, found
        return
    plan = found.plan
    assert plan is not None and len(plan.moves) == best and found.proven, found
    for mv in plan.moves:
        assert masks[mv.pod.key][cap.ledger.node_row(mv.target.node)], mv
    assert_plan_is_sound(cap, plan, running)


def test_a_pod_that_fits_only_where_it_may_not_go_is_not_said_to_fit():
    cap, running = _two_gpus_half_full()
    small = demand("small", 20)
    assert plan_repack(cap, small, running, max_moves=0).placement.node == "n0"
    elsewhere = np.array([False, True])
    plan = plan_repack(cap, small, running, pod_nodes=elsewhere)
    assert plan is not None and plan.placement.node == "n1"
    nowhere = np.zeros(2, bool)
    found = search_repack(cap, small, running, pod_nodes=nowhere)
    assert found.plan is None and found.proven and "even if every movable pod left" in found.reason


def test_the_random_cases_exercise_moves():
    """The cases above are worth running: many need moves, several need two or more, some
    have no plan at all, and multi-GPU and GPU-less pods move."""
    need: list[int | None] = []
    multi_moved = cpu_only_moved = 0
    for seed in SEEDS:
        cap, pod, running = random_case(seed)
        need.append(brute_force(cap, pod, running))
        plan = plan_repack(cap, pod, running, time_limit=10, num_workers=1)
        if plan:
            multi_moved += any(m.demand.gpu_count > 1 for m in plan.moves)
            cpu_only_moved += any(m.demand.gpu_count == 0 for m in plan.moves)
    assert sum(1 for n in need if n and n >= 1) >= 30
    assert sum(1 for n in need if n and n >= 2) >= 10
    assert need.count(None) >= 10
    assert multi_moved >= 3 and cpu_only_moved >= 3


@pytest.mark.parametrize("seed", SEEDS)
def test_max_moves_is_respected_and_proven(seed):
    cap, pod, running = random_case(seed)
    best = brute_force(cap, pod, running)
    if best is None:  # no number of moves is enough
        assert plan_repack(cap, pod, running, max_moves=len(running), num_workers=1) is None
        return
    if best == 0:
        plan = plan_repack(cap, pod, running, max_moves=0)
        assert plan is not None and plan.moves == ()
        return
    short = search_repack(cap, pod, running, max_moves=best - 1, time_limit=10, num_workers=1)
    assert short.plan is None and short.proven
    enough = plan_repack(cap, pod, running, max_moves=best, time_limit=10, num_workers=1)
    assert enough is not None and len(enough.moves) == best


@pytest.mark.parametrize("seed", SEEDS)
def test_pods_that_may_not_move_never_move(seed):
    cap, pod, running = random_case(seed)
    frozen = {d.pod.key for d, _ in running[::2]}

    def movable(d: Demand) -> bool:
        return d.pod.key not in frozen

    best = brute_force(cap, pod, running, movable)
    plan = plan_repack(cap, pod, running, movable=movable, time_limit=10, num_workers=1)
    if best is None:
        assert plan is None
        return
    assert plan is not None and len(plan.moves) == best
    assert not {m.pod.key for m in plan.moves} & frozen
    assert_plan_is_sound(cap, plan, running)


def _two_gpus_half_full() -> tuple[Capacity, Running]:
    """n0: two 80 GiB GPUs, each holding one 50 GiB pod; n1: one GPU holding 20 GiB."""
    _, cap = build_capacity(
        [
            gpu_node("n0", count=2, memory_mib=80 * 1024, replicas=4),
            gpu_node("n1", count=1, memory_mib=80 * 1024, replicas=4),
        ]
    )
    running: Running = []
    for name, node, dev, gib in (("a", 0, 0, 50), ("b", 0, 1, 50), ("c", 1, 2, 20)):
        d = demand(name, gib)
        res = reservation_for(cap, d, node, [dev])
        cap.apply(d, res, node)
        running.append((d, res))
    return cap, running


def test_a_whole_gpu_pod_gets_a_gpu_emptied_by_one_move():
    cap, running = _two_gpus_half_full()
    pod = demand("big", 80)
    plan = plan_repack(cap, pod, running, num_workers=1)
    assert plan is not None and len(plan.moves) == 1 and plan.optimal
    (mv,) = plan.moves
    # c (20 GiB) joins a or b, rather than a or b (50 GiB) joining c: the least memory moves
    assert mv.pod.name == "c" and mv.target.node == "n0"
    assert_plan_is_sound(cap, plan, running)


def test_a_two_gpu_pod_stays_on_one_node():
    # two 60 GiB devices on one node: n0 after one move, n1 after two
    _, bigger = build_capacity(
        [
            gpu_node("n0", count=2, memory_mib=80 * 1024, replicas=4),
            gpu_node("n1", count=2, memory_mib=80 * 1024, replicas=4),
        ]
    )
    running = []
    for name, node, dev, gib in (("a", 0, 0, 30), ("b", 1, 2, 30), ("c", 1, 3, 30)):
        d = demand(name, gib)
        res = reservation_for(bigger, d, node, [dev])
        bigger.apply(d, res, node)
        running.append((d, res))
    pod = demand("pair", 60, gpus=2)
    plan = plan_repack(bigger, pod, running, num_workers=1)
    assert plan is not None and len(plan.moves) == 1  # a leaves n0: 2 x 80 GiB free there
    assert plan.placement.node == "n0" and len(set(plan.placement.device_ids)) == 2
    assert_plan_is_sound(bigger, plan, running)


def test_none_when_no_node_could_ever_hold_the_pod():
    cap, running = _two_gpus_half_full()
    found = search_repack(cap, demand("huge", 90), running)  # more than any GPU has
    assert found.plan is None and found.proven and "even if every movable pod left" in found.reason
    found = search_repack(cap, demand("big", 80), running, movable=lambda d: False)
    assert found.plan is None and found.proven


def test_a_pod_that_fits_needs_no_move():
    cap, running = _two_gpus_half_full()
    plan = plan_repack(cap, demand("small", 20), running, max_moves=0)
    assert plan is not None and plan.moves == () and plan.status == "FITS"
    assert plan.placement.node == "n0"  # best fit: 30 GiB free there, 60 on n1


def test_a_gpu_less_pod_moves_out_to_make_cpu_room():
    """n0 and n1: 6 of 8 cores taken by a GPU-less pod; n2: cores free, its GPU full."""
    _, cap = build_capacity([gpu_node(f"n{i}", count=1, cpu="8") for i in range(3)])
    running: Running = []
    for name, node in (("cpu0", 0), ("cpu1", 1)):
        d = demand(name, None, gpus=0, cpu=6000)
        cap.apply(d, None, node)
        running.append((d, Reservation(d.pod, f"n{node}", (), ())))
    full = demand("full", None)
    res = reservation_for(cap, full, 2, [2])
    cap.apply(full, res, 2)
    running.append((full, res))
    pod = demand("gpu", 40, cpu=4000)
    plan = plan_repack(cap, pod, running, num_workers=1)
    assert plan is not None and [m.pod.name for m in plan.moves] in (["cpu0"], ["cpu1"])
    assert plan.moves[0].target.node == "n2" and plan.moves[0].target.device_ids == ()
    assert_plan_is_sound(cap, plan, running)
    # 6 + 6 cores cannot share an 8-core node, and the full GPU may not move: no plan, proven
    _, cap = build_capacity([gpu_node(f"n{i}", count=1, cpu="8") for i in range(2)])
    for d, r in running[:2]:
        cap.apply(d, None, int(r.node[1]))
    found = search_repack(cap, pod, running[:2], num_workers=1)
    assert found.plan is None and found.proven


def test_apply_plan_is_all_or_nothing():
    cap, running = _two_gpus_half_full()
    plan = plan_repack(cap, demand("big", 80), running, num_workers=1)
    assert plan is not None and len(plan.moves) == 1
    # someone takes the moved pod's target first: the plan must not half-happen
    target = plan.moves[0].target
    r = cap.ledger.row(target.node, target.device_ids[0])
    left = int(cap.arrays.capacity[r] - cap.arrays.used[r])
    thief = Demand(PodRef("default", "thief"), 1, left)
    node = cap.ledger.node_row(target.node)
    cap.apply(thief, Reservation(thief.pod, target.node, target.device_ids, (left,)), node)
    before = ledger_state(cap)
    with pytest.raises(LedgerError):
        apply_plan(cap, plan)
    assert ledger_state(cap) == before
    assert check_invariant(cap.ledger) == []


def neighbourhood_case() -> tuple[Capacity, Running]:
    """40 nodes (beyond the exact size): each GPU holds 70 GiB except one that holds a lone
    10 GiB pod (p37)."""
    _, cap = build_capacity(
        [gpu_node(f"n{i:02d}", count=2, memory_mib=80 * 1024, replicas=4) for i in range(40)]
    )
    running: Running = []
    a = cap.arrays
    for r in range(len(a.capacity)):
        d = demand(f"p{r}", 10 if r == 37 else 70)
        n = int(a.node_of[r])
        res = reservation_for(cap, d, n, [r])
        cap.apply(d, res, n)
        running.append((d, res))
    assert np.count_nonzero(cap.arrays.used == 70 * GIB) == 79
    return cap, running


def test_a_large_cluster_is_searched_in_a_neighbourhood():
    """`neighbourhood_case`: a whole-GPU pod needs p37 moved next to a 70 GiB pod, and the
    search finds that single move, optimal by the per-node bound."""
    cap, running = neighbourhood_case()
    found = search_repack(cap, demand("big", 80), running, neighbourhood=Neighbourhood())
    assert found.plan is not None and len(found.plan.moves) == 1 and found.proven
    assert found.nodes < 40  # a neighbourhood, not the whole cluster
    # p37 joins a 70 GiB pod, or a 70 GiB pod joins p37: both free a whole GPU
    (mv,) = found.plan.moves
    p37 = running[37][1]
    assert mv.pod.name == "p37" or (mv.target.node, mv.target.device_ids) == (
        p37.node,
        p37.device_ids,
    )
    assert_plan_is_sound(cap, found.plan, running)


def test_apply_plan_refuses_a_node_whose_cpu_went_meanwhile():
    cap, running = _two_gpus_half_full()
    plan = plan_repack(cap, demand("big", 80, cpu=2000), running, num_workers=1)
    assert plan is not None and len(plan.moves) == 1
    n = cap.ledger.node_row(plan.placement.node)
    hog = Demand(PodRef("default", "hog"), 0, None, cpu_milli=int(cap.cpu_free[n]) - 1000)
    cap.apply(hog, None, n)  # 1 core left where the pod was to go: it needs 2
    before = ledger_state(cap)
    with pytest.raises(LedgerError, match="CPU or memory"):
        apply_plan(cap, plan)
    assert ledger_state(cap) == before
    assert check_invariant(cap.ledger) == []


def _rule_case() -> tuple[Capacity, Running]:
    """n0: GPU 0 holds 30 GiB (50 free), GPU 1 holds 55 (25 free); n1: one GPU holding 20 GiB."""
    _, cap = build_capacity(
        [
            gpu_node("n0", count=2, memory_mib=80 * 1024, replicas=4),
            gpu_node("n1", count=1, memory_mib=80 * 1024, replicas=4),
        ]
    )
    running: Running = []
    for name, node, dev, gib in (("a", 0, 0, 30), ("b", 0, 1, 55), ("c", 1, 2, 20)):
        d = demand(name, gib)
        res = reservation_for(cap, d, node, [dev])
        cap.apply(d, res, node)
        running.append((d, res))
    return cap, running


def test_moved_pods_land_where_the_given_rule_puts_them():
    """c (20 GiB) leaves n1's GPU for an 80 GiB pod: best fit (the default) puts it on GPU 1
    (25 free), first-fit on GPU 0; with FGD's rule on a FragIndex, the index is as it was after
    the search (every change the search made, and undid, was followed)."""
    from extender.planner.capacity import FragIndex, Workload

    cap, running = _rule_case()
    big = demand("big", 80)
    for rule, device in ((None, "1"), ("first-fit", "0")):
        plan = plan_repack(cap, big, running, place_rule=rule, num_workers=1)
        assert plan is not None and [m.pod.name for m in plan.moves] == ["c"]
        assert (plan.moves[0].target.node, plan.moves[0].target.device_ids) == ("n0", (device,))
    frag = FragIndex(cap, Workload.from_demands([big, demand("x", 20)]))
    plan = plan_repack(cap, big, running, place_rule="fgd", frag=frag, num_workers=1)
    assert plan is not None and len(plan.moves) == 1
    fresh = FragIndex(cap, frag.w)
    assert np.array_equal(frag.A, fresh.A) and np.array_equal(frag.okc, fresh.okc)
    assert_plan_is_sound(cap, plan, running)


def test_the_whole_cluster_is_modelled_when_the_time_limit_allows_its_movers():
    """A cluster of at most `exact_nodes` nodes is modelled whole only while its movable pods
    are few for the time limit (the whole model's size is movers x devices): 100 movers on 20
    nodes get a neighbourhood with 1 s and the whole cluster with 2 s."""
    nh = Neighbourhood()
    assert nh.whole(24, 96, 1.0) and not nh.whole(24, 97, 1.0)
    assert nh.whole(24, 480, 5.0) and not nh.whole(25, 10, 5.0)
    _, cap = build_capacity(
        [gpu_node(f"n{i:02d}", count=1, memory_mib=80 * 1024, replicas=8) for i in range(20)]
    )
    running: Running = []
    for n in range(20):
        for j in range(5):  # 70 GiB held, 10 free: no 14 GiB pod fits anywhere else
            d = demand(f"p{n}-{j}", 14)
            res = reservation_for(cap, d, n, [n])
            cap.apply(d, res, n)
            running.append((d, res))
    before = ledger_state(cap)
    short = search_repack(cap, demand("blocked", 20), running, time_limit=1.0, num_workers=1)
    long = search_repack(cap, demand("blocked", 20), running, time_limit=2.0, num_workers=1)
    assert short.plan is None and long.plan is None  # no GPU can take a 14 GiB pod: no plan
    assert 0 < short.nodes < 20 and long.nodes == 20 and long.movers == 100
    assert ledger_state(cap) == before


def _one_gpu(d: Demand) -> bool:
    return d.gpu_count == 1


def test_the_pool_reads_dominance_by_kind_as_dominates_reads_it_per_pod():
    """`Pool.dominating` works per kind of running pod and keeps each answer for the search:
    per pod it is what `dominates` says, for whole-GPU, shared, two-GPU and GPU-less pods, and
    a kept answer cannot be written to."""
    _, cap = build_capacity([gpu_node("n0", count=8, memory_mib=80 * 1024, replicas=8, cpu="64")])
    running: Running = []
    kinds = [(10, 1, 2000), (20, 1, 0), (None, 1, 4000), (10, 2, 2000), (None, 0, 2000)]
    for i, (gib, gpus, cpu) in enumerate(kinds * 3):
        d = demand(f"r{i}", gib, gpus=gpus, cpu=cpu)
        n, rows = placements(cap, d)[0]
        res = reservation_for(cap, d, n, rows)
        cap.apply(d, res if rows else None, n)
        running.append((d, res))
    pool = Pool(cap, demand("blocked", 30), running, None)
    assert len(pool) == 15
    seen = set()
    for gib, gpus, cpu in [(10, 1, 0), (10, 1, 2000), (20, 1, 2000), (None, 1, 0), (10, 2, 0)]:
        probe = demand("probe", gib, gpus=gpus, cpu=cpu)
        got = pool.dominating(probe)
        assert got.tolist() == [dominates(d, probe) for d in pool.demands]
        assert pool.dominating(probe) is got and not got.flags.writeable
        seen |= set(got.tolist())
    assert seen == {True, False}


@pytest.mark.parametrize("seed", SEEDS)
def test_the_count_model_finds_the_fewest_moves_of_one_gpu_pods(seed):
    """`repack_counts` moves only one-GPU pods (counts per kind and device): its plan has
    exactly the brute force's fewest moves of one-GPU pods, and never overcommits."""
    cap, pod, running = random_case(seed)
    best = brute_force(cap, pod, running, _one_gpu)
    pool = Pool(cap, pod, running, None)
    before = ledger_state(cap)
    plan, status = solve_counts(cap, pod, pool, len(running), time.perf_counter() + 10, 1)
    assert ledger_state(cap) == before
    if best is None:
        assert plan is None and status in ("INFEASIBLE", "NO_MOVERS"), status
        return
    assert plan is not None, status
    assert len(plan.moves) == best and status == "OPTIMAL", status
    assert all(m.demand.gpu_count == 1 for m in plan.moves)
    assert_plan_is_sound(cap, plan, running)


def test_the_count_model_says_infeasible_when_no_one_gpu_pod_can_move():
    """Only GPU-less pods run, holding the CPU the blocked pod needs: the count model (one-GPU
    pods only) has nothing to move, and says the pod cannot fit rather than passing on its
    constant objective's status."""
    cap, pod, running = random_case(623)
    assert all(d.gpu_count == 0 for d, _ in running) and not placements(cap, pod)
    assert brute_force(cap, pod, running, _one_gpu) is None
    plan, status = solve_counts(
        cap, pod, Pool(cap, pod, running, None), len(running), time.perf_counter() + 10, 1
    )
    assert plan is None and status == "INFEASIBLE"


def test_a_small_cluster_with_many_movers_is_repacked_by_counts():
    """A cycle of three moves on a small cluster with more movable pods than the whole per-pod
    model takes in 1 s: a 28 GiB pod leaves a time-sliced GPU for an exclusive one, whose
    whole-GPU pod takes an MPS share, whose 9 GiB pod joins the blocked pod on the time-sliced
    GPU. The blocked pod fits no MPS share and the exclusive node lacks its CPU; the greedy plans
    cannot chain that far; the count model finds the three moves."""
    mps = gpu_node("mps", count=1, replicas=4, strategy="mps")
    nodes = [gpu_node("ex", count=1, cpu="4"), mps, gpu_node("ts", count=1, replicas=4)]
    nodes += [gpu_node(f"fill{i:02d}", count=1, replicas=10) for i in range(10)]
    _, cap = build_capacity(nodes)
    running: Running = []

    def put(d: Demand, node: str) -> None:
        n = cap.ledger.node_row(node)
        assert n is not None
        res = reservation_for(cap, d, n, [int(cap.arrays.node_start[n])])
        cap.apply(d, res, n)
        running.append((d, res))

    put(demand("whole", None), "ex")
    for i in range(4):
        put(demand(f"small{i}", 9), "mps")
    put(demand("m28", 28), "ts")
    put(demand("pinned", 40), "ts")
    for i in range(10):
        for j in range(10):
            put(demand(f"fill{i}-{j}", 8), f"fill{i:02d}")
    blocked = Demand(PodRef("default", "blocked"), 1, 21 * GIB, cpu_milli=8000)

    def movable(d: Demand) -> bool:
        return d.pod.name != "pinned"

    assert not placements(cap, blocked) and not Neighbourhood().whole(13, len(running), 1.0)
    found = search_repack(cap, blocked, running, movable=movable, time_limit=1.0, num_workers=1)
    assert found.plan is not None, found
    assert found.status != "GREEDY" and found.nodes == 13
    assert sorted(m.pod.name for m in found.plan.moves) == ["m28", "small0", "whole"]
    assert found.plan.placement.node == "ts"
    assert_plan_is_sound(cap, found.plan, running)


def test_a_search_leaves_the_cached_device_masks_as_they_were():
    """`Capacity.matches` is cached and read by every later placement on the same capacity (the
    simulator's whole replay, the planner's candidates): a search for a 30 GiB pod must not
    drop the 16 GiB GPU from the mask of `nvidia.com/gpu` devices, or no later pod could use it."""
    _, cap = build_capacity(
        [gpu_node("big", count=1, replicas=2), gpu_node("small", count=1, memory_mib=16 * 1024)]
    )
    running: Running = []
    for name, gib, node in (("a", 40, "big"), ("b", 10, "big")):
        d = demand(name, gib)
        n = cap.ledger.node_row(node)
        assert n is not None
        res = reservation_for(cap, d, n, [int(cap.arrays.node_start[n])])
        cap.apply(d, res, n)
        running.append((d, res))
    before = cap.matches("nvidia.com/gpu", None).copy()
    assert before.all()
    found = search_repack(cap, demand("blocked", 30), running, time_limit=2, num_workers=1)
    assert found.plan is not None and [m.pod.name for m in found.plan.moves] == ["b"]
    assert np.array_equal(cap.matches("nvidia.com/gpu", None), before)


def test_nodes_where_a_gpu_less_pod_can_make_room_are_tried_first():
    """61 one-GPU nodes of 8 cores. On 59, a 39 GiB pod holds 6 cores (GPU room, CPU short,
    and no other node has room for that pod); on n59 (a 100 GiB GPU, half used) a GPU-less
    pod holds the 6 cores; n60's GPU is full, its cores free. Every node needs one move by the
    bound, and n59 is the last by memory held, beyond the nodes the greedy step and the
    neighbourhoods look at; the one plan moves the GPU-less pod to n60."""
    nodes = [gpu_node(f"n{i:02d}", count=1, cpu="8", replicas=4) for i in range(59)]
    nodes += [
        gpu_node("n59", count=1, cpu="8", replicas=4, memory_mib=100 * 1024),
        gpu_node("n60", count=1, cpu="8", replicas=4),
    ]
    _, cap = build_capacity(nodes)
    running: Running = []

    def put(d: Demand, n: int) -> None:
        res = (
            reservation_for(cap, d, n, [n])
            if d.gpu_count
            else Reservation(d.pod, f"n{n:02d}", (), ())
        )
        cap.apply(d, res if d.gpu_count else None, n)
        running.append((d, res))

    for n in range(59):
        put(demand(f"busy{n}", 39, cpu=6000), n)
    put(demand("half", 50), 59)
    put(demand("cpu-only", None, gpus=0, cpu=6000), 59)
    put(demand("full", 80), 60)
    pod = demand("gpu", 40, cpu=4000)
    found = search_repack(cap, pod, running, max_moves=1, num_workers=1)
    assert found.plan is not None and found.proven, found.reason
    (mv,) = found.plan.moves
    assert (mv.pod.name, mv.target.node, found.plan.placement.node) == ("cpu-only", "n60", "n59")
    assert_plan_is_sound(cap, found.plan, running)
