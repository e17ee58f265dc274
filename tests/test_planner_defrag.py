"""`vramsched plan-defrag`'s model (`extender.planner.defrag`) against a brute force on small
clusters.

The brute force tries every way the movable pods can stay or move (each to any other GPU of the
same product, its room counted as it is now, so the moves can be made one by one in any order)
within the disruption limits, and keeps the most GPUs freed, then the fewest moves. The model must
find exactly that, prove it, and its moves, made one by one through the ledger in either order,
must never overcommit a GPU.
"""

from __future__ import annotations

import itertools
import random
from collections import defaultdict

import pytest
from builders import gpu_node

from extender.demand import Demand, PodRef
from extender.ledger import Ledger, Reservation, check_invariant
from extender.planner.capacity import Capacity
from extender.planner.defrag import DefragPlan, Limits, plan_defrag
from extender.planner.move_model import reservation_for
from extender.quantity import GIB
from extender.simulate.engine import build_capacity

Demands = dict[str, tuple[int, int, str | None]]


def random_case(seed: int) -> tuple[Capacity, Demands, Limits]:
    """2-3 nodes of 1-2 time-sliced 80 GiB GPUs (2-4 replicas, 8 or 16 cores), 3-5 pods of one
    declared share (10-40 GiB, 0-6 cores, priority 0, 5 or 9) placed at random where they fit,
    sometimes a pod of a whole GPU (which never moves), in namespace default or prod, and random
    disruption limits (moves in all, per namespace, per node, prod left alone)."""
    rng = random.Random(seed)
    nodes = [
        gpu_node(
            f"n{i}",
            count=rng.choice([1, 2]),
            memory_mib=80 * 1024,
            replicas=rng.choice([2, 3, 4]),
            cpu=str(rng.choice([8, 16])),
        )
        for i in range(rng.choice([2, 3]))
    ]
    _, cap = build_capacity(nodes)
    a = cap.arrays
    demands: Demands = {}
    pods = [(f"p{i}", rng.choice([10, 20, 30, 40])) for i in range(rng.randint(3, 5))]
    if rng.random() < 0.3:
        pods.append(("whole", 0))
    for name, gib in pods:
        d = Demand(
            PodRef(rng.choice(["default", "prod"]), name),
            1,
            gib * GIB if gib else None,
            cpu_milli=rng.choice([0, 2000, 4000, 6000]),
            memory_bytes=GIB,
            priority=rng.choice([0, 0, 5, 5, 5, 9]),
        )
        options = [
            r
            for r in range(len(a.capacity))
            if a.used_replicas[r] < a.replicas[r]
            and a.capacity[r] - a.used[r] >= (d.bytes_per_gpu or a.capacity[r])
            and (d.bytes_per_gpu or a.used_replicas[r] == 0)
            and cap.cpu_free[a.node_of[r]] >= d.cpu_milli
        ]
        if not options:
            continue
        r = rng.choice(options)
        n = int(a.node_of[r])
        cap.apply(d, reservation_for(cap, d, n, (r,)), n)
        demands[d.pod.key] = (d.cpu_milli, d.memory_bytes, d.resource)
    limits = Limits(
        max_moves=rng.choice([None, None, 1, 2, 3]),
        max_per_namespace=rng.choice([None, None, 1, 2]),
        max_per_node=rng.choice([None, None, 1]),
        exclude_namespaces=rng.choice([frozenset(), frozenset(), frozenset({"prod"})]),
    )
    return cap, demands, limits


def brute_force(cap: Capacity, demands: Demands, limits: Limits) -> tuple[int, int, int]:
    """(most GPUs freed, fewest moves that free that many, fewest pods of the highest priority
    among those moves), over every stay-or-move choice."""
    a, ledger = cap.arrays, cap.ledger
    holders: dict[int, list[str]] = defaultdict(list)
    movers: list[tuple[str, int, int, int, int]] = []  # key, device row, node row, bytes, cpu
    priority: dict[str, int] = {}
    for res in ledger.reservations():
        g = ledger.row(res.node, res.device_ids[0])
        assert g is not None
        holders[g].append(res.key)
        if (
            res.declared
            and res.key not in limits.exclude_pods
            and res.pod.namespace not in limits.exclude_namespaces
        ):
            cpu, _, _ = demands[res.key]
            movers.append((res.key, g, int(a.node_of[g]), res.bytes_per_device[0], cpu))
            priority[res.key] = res.priority
    top = max(priority.values(), default=0)
    free = a.capacity - a.used
    rep_free = a.replicas - a.used_replicas
    choices = [
        [
            None,
            *(h for h in range(len(a.capacity)) if h != g and a.product_id[h] == a.product_id[g]),
        ]
        for _, g, _, _, _ in movers
    ]
    best = (0, 0, 0)
    for pick in itertools.product(*choices):
        moves = [(mv, h) for mv, h in zip(movers, pick, strict=True) if h is not None]
        if limits.max_moves is not None and len(moves) > limits.max_moves:
            continue
        per_node: dict[int, int] = defaultdict(int)
        per_ns: dict[str, int] = defaultdict(int)
        into_b: dict[int, int] = defaultdict(int)
        into_n: dict[int, int] = defaultdict(int)
        into_cpu: dict[int, int] = defaultdict(int)
        for (key, _, n, b, cpu), h in moves:
            per_node[n] += 1
            per_ns[key.split("/")[0]] += 1
            into_b[h] += b
            into_n[h] += 1
            if int(a.node_of[h]) != n:  # a move within its node takes no new CPU
                into_cpu[int(a.node_of[h])] += cpu
        if limits.max_per_node is not None and any(
            v > limits.max_per_node for v in per_node.values()
        ):
            continue
        if limits.max_per_namespace is not None and any(
            v > limits.max_per_namespace for v in per_ns.values()
        ):
            continue
        if any(into_b[h] > free[h] or into_n[h] > rep_free[h] for h in into_b):
            continue
        if any(into_cpu[n] > cap.cpu_free[n] for n in into_cpu):
            continue
        moved = {mv[0] for mv, _ in moves}
        freed = sum(
            1 for g, keys in holders.items() if set(keys) <= moved and into_n.get(g, 0) == 0
        )
        high = sum(1 for k in moved if top > 0 and priority[k] == top)
        if freed and (-freed, len(moves), high) < (-best[0], best[1], best[2]):
            best = (freed, len(moves), high)
    return best


def make_moves(ledger: Ledger, plan: DefragPlan, order: list[int]) -> None:
    """The plan's moves one by one in `order`, each through the ledger (the pod's share released
    at its GPU, then reserved at its target): `reserve` refuses any that overcommits."""
    for i in order:
        mv = plan.moves[i]
        res = ledger.reservation(mv.pod)
        assert res is not None and (res.node, res.device_ids) == (mv.from_node, (mv.from_device,))
        ledger.release(mv.pod)
        ledger.reserve(
            Reservation(
                pod=res.pod,
                node=mv.to_node,
                device_ids=(mv.to_device,),
                bytes_per_device=(mv.bytes,),
                priority=res.priority,
            )
        )


@pytest.mark.parametrize("seed", range(60))
def test_the_most_gpus_freed_with_the_fewest_moves_as_the_brute_force(seed: int) -> None:
    cap, demands, limits = random_case(seed)
    freed, moves, high = brute_force(cap, demands, limits)
    plan = plan_defrag(cap, demands, limits, time_limit=10, num_workers=1)
    if not freed:
        assert plan.moves == [] and plan.freed == []
        return
    assert plan.status == "OPTIMAL", plan
    top = max(
        r.priority
        for r in cap.ledger.reservations()
        if r.declared and r.pod.namespace not in limits.exclude_namespaces
    )
    plan_high = sum(1 for mv in plan.moves if top > 0 and mv.priority == top)
    assert (len(plan.freed), len(plan.moves), plan_high) == (freed, moves, high), plan
    assert plan.bound_freed == freed
    for order in (list(range(len(plan.moves))), list(reversed(range(len(plan.moves))))):
        ledger = cap.ledger.clone()
        make_moves(ledger, plan, order)
        assert check_invariant(ledger) == []
        held = {(r.node, d) for r in ledger.reservations() for d in r.device_ids}
        assert not held & set(plan.freed)  # the GPUs said freed hold no pod


def test_the_random_cases_exercise_the_model() -> None:
    """The cases above are worth running: many free a GPU, several free two or more, some free
    none, and the limits cut some plans short."""
    results = []
    for seed in range(60):
        cap, demands, limits = random_case(seed)
        unlimited = brute_force(cap, demands, Limits())
        results.append((brute_force(cap, demands, limits), unlimited))
    assert sum(1 for (f, _, _), _ in results if f >= 1) >= 25
    assert sum(1 for (f, _, _), _ in results if f >= 2) >= 5
    assert sum(1 for (f, _, _), _ in results if f == 0) >= 5
    assert sum(1 for (f, _, _), (u, _, _) in results if f < u) >= 5


def test_a_gpu_held_by_many_pods_of_the_highest_priority_is_still_freed() -> None:
    """Four pods of one priority share a's GPU; b's, holding one pod, has room for all four.
    Freeing a's GPU takes four moves of pods of the highest priority, which must still weigh
    less than the GPU (and freeing b's takes one move)."""
    _, cap = build_capacity(
        [gpu_node("a", count=1, replicas=5), gpu_node("b", count=1, replicas=5)]
    )
    demands: Demands = {}
    for i in range(4):
        d = Demand(PodRef("default", f"p{i}"), 1, 10 * GIB, priority=1000)
        cap.apply(d, reservation_for(cap, d, 0, (0,)), 0)
        demands[d.pod.key] = (0, 0, d.resource)
    d = Demand(PodRef("default", "q"), 1, 10 * GIB)
    cap.apply(d, reservation_for(cap, d, 1, (1,)), 1)  # GPU 1 in use: freeing it takes one move
    demands[d.pod.key] = (0, 0, d.resource)
    plan = plan_defrag(cap, demands, time_limit=10, num_workers=1)
    assert (len(plan.freed), len(plan.moves), plan.bound_freed) == (1, 1, 1)
    assert brute_force(cap, demands, Limits()) == (1, 1, 0)
    kept = Limits(exclude_pods=frozenset({"default/q"}))
    only_them = plan_defrag(cap, demands, kept, time_limit=10, num_workers=1)
    assert only_them.freed == [("a", "0")] and len(only_them.moves) == 4
    assert only_them.bound_freed == 1
    assert brute_force(cap, demands, kept) == (1, 4, 4)
