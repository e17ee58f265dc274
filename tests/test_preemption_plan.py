"""vramsched's own preemption plan (`placement.plan_preemption`) against brute force on small
random clusters: two or three nodes of exclusive or time-sliced GPUs, pods of one or two GPUs at
several priorities, every replica policy.

What every set of victims says, tried one by one (filter run on the cluster rebuilt without
them): no plan when the pod fits a node already, or when no set of lower-priority pods makes
room anywhere; else, per node, the fewest such pods, the lowest priorities among equally few,
and among nodes the one kube-scheduler would pick (lowest highest victim priority, lowest sum,
sum shifted by 2^31 as kube-scheduler shifts it, fewest victims, least VRAM evicted, node
order). The placement returned fits the ledger once the
victims are gone, and no pod `eligible` refuses is ever a victim. With a `HostRoom` (cores each
node has free and each pod holds), the victims must free the pod's cores too."""

from __future__ import annotations

import json
import random
from dataclasses import replace
from itertools import combinations
from typing import Any

import pytest
from builders import cluster, gpu_node, pod, service
from test_preempt_brute import fill, running

from extender.demand import Demand, pod_demand
from extender.inventory import ReplicaPolicy
from extender.placement import HostRoom, filter_nodes, plan_preemption, preempt_victims
from extender.wire import ExtenderPreemptionArgs

GIB = 1 << 30
PRIORITY = 50


def held_twice(*extra: dict[str, Any]) -> list[dict[str, Any]]:
    """Node n, a time-sliced 80 GiB GPU of 4 replicas, held by two 35 GiB pods of priority 0
    (low) and 10 (mid): a 40 GiB pod fits once one of them is gone, with replicas left."""
    return [
        gpu_node("n", count=1, memory_mib=80 * 1024, replicas=4),
        *extra,
        running("low", 35, "n", [0], 0),
        running("mid", 35, "n", [0], 10),
    ]


def random_case(rng: random.Random) -> tuple[list[dict[str, Any]], list[str], dict[str, Any]]:
    """Nodes of one kind, their pods, and a pod of priority 50 that may need some of them gone."""
    count = rng.choice([1, 2])
    replicas = rng.choice([1, 2, 4])
    memory = rng.choice([16, 24, 80])
    names = [f"n{i}" for i in range(rng.choice([2, 3]))]
    objects: list[dict[str, Any]] = []
    for node in names:
        objects.append(gpu_node(node, count=count, memory_mib=memory * 1024, replicas=replicas))
        objects += fill(
            rng,
            node,
            count,
            memory,
            replicas,
            pods=4,
            priorities=(0, 1, 50, 100),
            prefix=f"{node}-",
        )
    width = 2 if count > 1 and rng.random() < 0.25 else 1
    new = pod("new", f"{rng.randint(memory // 2, memory) * width}Gi", gpus=width, priority=PRIORITY)
    return objects, names, new


def fits_without(
    objects: list[dict[str, Any]], gone: set[str], new: dict[str, Any], node: str, policy: Any
) -> bool:
    c = cluster(*(o for o in objects if o["metadata"]["name"] not in gone), replica_policy=policy)
    return filter_nodes(c.ledger, pod_demand(new), [node]).feasible == [node]


def brute_force(
    objects: list[dict[str, Any]],
    names: list[str],
    new: dict[str, Any],
    policy: Any,
    eligible: set[str],
    cores: Cores | None = None,
) -> tuple[str, tuple[int, ...]] | None | bool:
    """True: it fits already; None: no victims make room; else (node, its rank). `cores`: the
    cores each node has free, each pod holds and the new pod asks."""

    def room(node: str, gone: tuple[str, ...]) -> bool:
        if cores is None:
            return True
        free, held, need = cores
        return free[node] + sum(held[n] for n in gone) >= need

    if any(fits_without(objects, set(), new, n, policy) and room(n, ()) for n in names):
        return True
    pods = [o for o in objects if o["kind"] == "Pod"]
    priority = {p["metadata"]["name"]: p["spec"]["priority"] for p in pods}
    gib = {
        p["metadata"]["name"]: sum(
            json.loads(p["metadata"]["annotations"]["vramsched.io/assignment"])["bytesPerDevice"]
        )
        for p in pods
    }
    best: tuple[tuple[int, ...], str] | None = None
    for order, node in enumerate(names):
        lower = [
            n
            for n in priority
            if n.startswith(node + "-") and priority[n] < PRIORITY and n in eligible
        ]
        for size in range(1, len(lower) + 1):
            working = [
                s
                for s in combinations(lower, size)
                if fits_without(objects, set(s), new, node, policy) and room(node, s)
            ]
            if working:
                top, total = min(
                    (max(priority[n] for n in s), sum(priority[n] for n in s)) for s in working
                )
                chosen = [
                    s
                    for s in working
                    if (max(priority[n] for n in s), sum(priority[n] for n in s)) == (top, total)
                ]
                freed = min(sum(gib[n] for n in s) for s in chosen)
                # kube-scheduler sums priorities shifted by 2^31 (MaxInt32 + 1)
                rank = (top, total + size * (1 << 31), size, freed, order)
                if best is None or rank < best[0]:
                    best = (rank, node)
                break
    return None if best is None else (best[1], best[0])


#: cores free per node, held per pod, asked by the new pod
Cores = tuple[dict[str, int], dict[str, int], int]


def random_cores(seed: int, names: list[str], pods: list[str]) -> Cores:
    rng = random.Random(seed + 1000)  # its own draws: the cases without cores stay as they were
    return (
        {n: rng.randint(0, 3) for n in names},
        {p: rng.randint(0, 4) for p in pods},
        rng.randint(0, 7),
    )


def with_cores(
    demand: Demand, names: list[str], cores: Cores | None
) -> tuple[Demand, HostRoom | None]:
    """The pod asking `cores`' cores, and the room the nodes have for them (memory unlimited)."""
    if cores is None:
        return demand, None
    free, held, need = cores
    room = HostRoom(
        {n: (free[n] * 1000, 1 << 40) for n in names},
        lambda res: (held[res.pod.name] * 1000, 0),
    )
    return replace(demand, cpu_milli=need * 1000), room


@pytest.mark.parametrize("host", [False, True], ids=["vram", "vram+cores"])
@pytest.mark.parametrize("policy", list(ReplicaPolicy))
@pytest.mark.parametrize("seed", range(60))
def test_plan_is_the_one_brute_force_finds(seed: int, policy: Any, host: bool) -> None:
    rng = random.Random(seed)
    objects, names, new = random_case(rng)
    pods = [o["metadata"]["name"] for o in objects if o["kind"] == "Pod"]
    eligible = {n for n in pods if rng.random() < 0.85}
    c = cluster(*objects, replica_policy=policy)
    cores = random_cores(seed, names, pods) if host else None
    demand, room = with_cores(pod_demand(new), names, cores)
    got = plan_preemption(
        c.ledger,
        demand,
        nodes=names,
        eligible=lambda res: res.pod.name in eligible,
        host=room,
    )
    want = brute_force(objects, names, new, policy, eligible, cores)
    if want is True or want is None:
        assert got is None, (objects, new, got)
        return
    assert got is not None, (objects, new, want)
    node, rank = want
    victims = {v.pod.name for v in got.victims}
    priority = {v.pod.name: v.priority for v in got.victims}
    assert got.node == node, (got, want)
    assert all(v.node == node and v.priority < PRIORITY for v in got.victims)
    assert victims <= eligible
    top, total = max(priority.values()), sum(p + (1 << 31) for p in priority.values())
    assert (top, total, len(victims)) == rank[:3]
    assert fits_without(objects, victims, new, node, policy)
    if cores is not None:
        assert cores[0][node] + sum(cores[1][v] for v in victims) >= cores[2]
    after = cluster(
        *(o for o in objects if o["metadata"]["name"] not in victims), replica_policy=policy
    )
    assert got.placement.node == node
    assert after.ledger.fits(got.placement) is None, got.placement


def dense_case(rng: random.Random) -> tuple[list[dict[str, Any]], list[str], dict[str, Any]]:
    """Two nodes of one 24 GiB GPU with 8 replicas, each shared by up to 8 pods of 2-4 GiB (as
    gpushare lists share a GPU): a pod of 12-20 GiB needs two to five of them gone."""
    names = ["n0", "n1"]
    objects: list[dict[str, Any]] = []
    for node in names:
        objects.append(gpu_node(node, count=1, memory_mib=24 * 1024, replicas=8))
        free = 24
        for i in range(rng.randint(4, 8)):
            gib = rng.randint(2, 4)
            if gib > free:
                break
            free -= gib
            objects.append(running(f"{node}-v{i}", gib, node, [0], rng.choice((0, 1, 50, 100))))
    return objects, names, pod("new", f"{rng.randint(12, 20)}Gi", priority=PRIORITY)


@pytest.mark.parametrize("host", [False, True], ids=["vram", "vram+cores"])
@pytest.mark.parametrize("seed", range(30))
def test_many_small_pods_on_one_gpu_give_the_plan_brute_force_finds(seed: int, host: bool) -> None:
    rng = random.Random(seed)
    objects, names, new = dense_case(rng)
    pods = [o["metadata"]["name"] for o in objects if o["kind"] == "Pod"]
    c = cluster(*objects)
    cores = random_cores(seed, names, pods) if host else None
    demand, room = with_cores(pod_demand(new), names, cores)
    got = plan_preemption(c.ledger, demand, nodes=names, host=room)
    want = brute_force(objects, names, new, None, set(pods), cores)
    if want is True or want is None:
        assert got is None, (objects, new, got)
        return
    assert got is not None, (objects, new, want)
    priority = {v.pod.name: v.priority for v in got.victims}
    top, total = max(priority.values()), sum(p + (1 << 31) for p in priority.values())
    assert (got.node, top, total, len(priority)) == (want[0], *want[1][:3])


def test_the_fewest_victims_may_be_on_any_gpu_of_the_node() -> None:
    """Two 24 GiB GPUs: a and b (10 GiB each) on GPU 0, c (16 GiB) on GPU 1. A 20 GiB pod needs
    both of GPU 0's pods gone, or c alone: c goes, and the pod takes GPU 1."""
    objects = [
        gpu_node("n", count=2, memory_mib=24 * 1024, replicas=4),
        running("a", 10, "n", [0], 0),
        running("b", 10, "n", [0], 0),
        running("c", 16, "n", [1], 0),
    ]
    got = plan_preemption(cluster(*objects).ledger, pod_demand(pod("new", "20Gi", priority=50)))
    assert got is not None and [v.pod.name for v in got.victims] == ["c"]
    assert got.placement.device_ids == ("1",)


def test_a_pod_that_only_vram_keeps_out_gets_one_victim() -> None:
    """A time-sliced 80 GiB GPU with replicas left: two pods of 35 GiB hold it; a 40 GiB pod of
    higher priority needs one of them gone. kube-scheduler's dry run (replicas only) finds no
    victim here; the plan evicts the lower-priority one."""
    new = pod("new", "40Gi", priority=100)
    c = cluster(*held_twice())
    got = plan_preemption(c.ledger, pod_demand(new))
    assert got is not None
    assert [v.pod.name for v in got.victims] == ["low"]
    assert (got.node, got.placement.device_ids) == ("n", ("0",))
    # not below its own priority, nor when it fits already
    assert plan_preemption(c.ledger, pod_demand(pod("new", "40Gi", priority=0))) is None
    assert plan_preemption(c.ledger, pod_demand(pod("new", "10Gi", priority=100))) is None
    # the preempt verb's answer is unchanged: it still narrows what kube-scheduler proposes
    assert preempt_victims(c.ledger, pod_demand(new), {"n": ["low", "mid"]}) == {"n": ["low"]}


def test_nodes_outside_the_allowed_ones_are_not_touched() -> None:
    objects = [
        gpu_node("a", count=1, memory_mib=80 * 1024, replicas=4),
        gpu_node("b", count=1, memory_mib=80 * 1024, replicas=4),
        running("a-low", 70, "a", [0], 0),
        running("b-low", 70, "b", [0], 5),
    ]
    c = cluster(*objects)
    new = pod_demand(pod("new", "40Gi", priority=100))
    assert plan_preemption(c.ledger, new).node == "a"  # type: ignore[union-attr]
    only_b = plan_preemption(c.ledger, new, nodes=["b"])
    assert only_b is not None and [v.pod.name for v in only_b.victims] == ["b-low"]
    assert plan_preemption(c.ledger, new, nodes=[]) is None


def test_the_preempt_verb_picks_victims_for_a_node_kube_scheduler_sent_without_any() -> None:
    """kube-scheduler with kubernetes PR 135486 sends a node its in-tree dry run fits with
    nobody gone as a placeholder, with no victims: vramsched picks them (the fewest of lower
    priority), or leaves the node out when none make room."""
    c = cluster(*held_twice())
    assert preempt_victims(c.ledger, pod_demand(pod("new", "40Gi", priority=100)), {"n": []}) == {
        "n": ["low"]
    }
    assert preempt_victims(c.ledger, pod_demand(pod("new", "40Gi", priority=0)), {"n": []}) == {}
    # it fits already: the placeholder passes through as it came
    assert preempt_victims(c.ledger, pod_demand(pod("new", "8Gi", priority=100)), {"n": []}) == {
        "n": []
    }
    both = preempt_victims(c.ledger, pod_demand(pod("new", "79Gi", priority=100)), {"n": []})
    assert sorted(both["n"]) == ["low", "mid"]


def test_the_preempt_verb_reads_a_placeholder_sent_as_null_and_passes_it_on() -> None:
    """Go sends a nil victim list as `"Pods": null`; the answer keeps the placeholder when the
    pod needs nobody gone, names the victims when it does."""
    c = cluster(*held_twice(gpu_node("m", count=1, memory_mib=80 * 1024, replicas=4)))
    body = {
        "Pod": pod("new", "40Gi", priority=100),
        "NodeNameToMetaVictims": {
            "n": {"Pods": None, "NumPDBViolations": 0},
            "m": {"Pods": None, "NumPDBViolations": 0},
        },
    }
    out = service(c).preempt(ExtenderPreemptionArgs.model_validate(body))
    assert out.model_dump() == {
        "NodeNameToMetaVictims": {
            "n": {"Pods": [{"UID": "low"}], "NumPDBViolations": 0},
            "m": {"Pods": [], "NumPDBViolations": 0},
        }
    }


def test_negative_priorities_are_summed_as_kube_scheduler_sums_them() -> None:
    """Node a needs both its pods of priority -10 gone, node b its one: summed plainly, a's
    -20 would win; shifted by 2^31 each, as kube-scheduler sums them, b's one victim does."""
    objects = [
        gpu_node("a", count=1, memory_mib=80 * 1024, replicas=4),
        gpu_node("b", count=1, memory_mib=80 * 1024, replicas=4),
        running("a1", 35, "a", [0], -10),
        running("a2", 35, "a", [0], -10),
        running("b1", 60, "b", [0], -10),
    ]
    got = plan_preemption(cluster(*objects).ledger, pod_demand(pod("new", "50Gi", priority=0)))
    assert got is not None and [v.pod.name for v in got.victims] == ["b1"]
