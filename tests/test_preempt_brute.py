"""Preempt's victims against brute force on small random nodes: exclusive and time-sliced GPUs,
pods of one or two GPUs, every replica policy. For each node kube-scheduler proposes, the answer
must be what trying every set of the proposed pods says: all of them when the pod fits without
any; else the fewest of our lower-priority pods whose removal lets it fit (filter, run on the
cluster rebuilt without them, passes the node), the lowest priorities among equally few, plus
every proposed pod we hold no GPU for; the node left out when no such set exists. A node
proposed with no pods (a placeholder) gets the fewest of all our lower-priority pods there."""

from __future__ import annotations

import json
import random
from itertools import combinations
from typing import Any

import pytest
from builders import cluster, gpu_node, pod

from extender.demand import pod_demand
from extender.inventory import ReplicaPolicy
from extender.placement import filter_nodes, preempt_victims

GIB = 1 << 30


def running(name: str, gib: int, node: str, devices: list[int], priority: int) -> dict[str, Any]:
    ann = {
        "vramsched.io/assignment": json.dumps(
            {
                "node": node,
                "devices": [str(d) for d in devices],
                "bytesPerDevice": [gib * GIB] * len(devices),
            }
        )
    }
    p = pod(
        name,
        f"{gib * len(devices)}Gi",
        gpus=len(devices),
        node=node,
        uid=name,
        annotations=ann,
        phase="Running",
        priority=priority,
    )
    return p


def fill(
    rng: random.Random,
    node: str,
    count: int,
    memory: int,
    replicas: int,
    *,
    pods: int,
    priorities: tuple[int, ...],
    prefix: str = "",
) -> list[dict[str, Any]]:
    """1 to `pods` running pods of one or two GPUs on `node` (`count` GPUs of `memory` GiB and
    `replicas` replicas each), of random sizes and `priorities`, named `<prefix>v<i>`."""
    out: list[dict[str, Any]] = []
    free = {d: memory for d in range(count)}
    slots = {d: replicas for d in range(count)}
    for i in range(rng.randint(1, pods)):
        width = 2 if count > 1 and rng.random() < 0.25 else 1
        open_ = [d for d in range(count) if slots[d] > 0 and free[d] >= 2]
        if len(open_) < width:
            break
        devices = rng.sample(open_, width)
        gib = rng.randint(2, min(free[d] for d in devices))
        if replicas == 1:
            gib = rng.randint(2, memory)
        for d in devices:
            free[d] -= gib
            slots[d] -= 1
        out.append(running(f"{prefix}v{i}", gib, node, devices, rng.choice(priorities)))
    return out


def random_case(rng: random.Random) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """One node, its pods and a pod that may need some of them gone."""
    count = rng.choice([1, 2, 3])
    replicas = rng.choice([1, 2, 4])
    memory = rng.choice([16, 24, 80])
    objects: list[dict[str, Any]] = [
        gpu_node("n", count=count, memory_mib=memory * 1024, replicas=replicas)
    ]
    objects += fill(rng, "n", count, memory, replicas, pods=6, priorities=(0, 1, 5, 100))
    width = 2 if count > 1 and rng.random() < 0.25 else 1
    new = pod("new", f"{rng.randint(2, memory) * width}Gi", gpus=width, priority=50)
    return objects, new


def fits_without(
    objects: list[dict[str, Any]], gone: set[str], new: dict[str, Any], policy: Any
) -> bool:
    c = cluster(*(o for o in objects if o["metadata"]["name"] not in gone), replica_policy=policy)
    return filter_nodes(c.ledger, pod_demand(new), ["n"]).feasible == ["n"]


@pytest.mark.parametrize("policy", list(ReplicaPolicy))
@pytest.mark.parametrize("seed", range(40))
def test_victims_are_the_fewest_lowest_priority_pods_that_make_room(seed: int, policy: Any) -> None:
    rng = random.Random(seed)
    objects, new = random_case(rng)
    pods = [o for o in objects if o["kind"] == "Pod"]
    proposed = [p["metadata"]["name"] for p in pods if rng.random() < 0.8]
    c = cluster(*objects, replica_policy=policy)
    got = preempt_victims(c.ledger, pod_demand(new), {"n": proposed})
    if fits_without(objects, set(), new, policy):
        assert got == {"n": proposed}
        return
    priority = {p["metadata"]["name"]: p["spec"]["priority"] for p in pods}
    # none proposed: a placeholder (kubernetes PR 135486), the victims are vramsched's to pick
    lower = [n for n in proposed or priority if priority[n] < 50]
    working = [
        set(s)
        for size in range(1, len(lower) + 1)
        for s in combinations(lower, size)
        if fits_without(objects, set(s), new, policy)
    ]
    if not working:
        assert got == {}, (objects, new, proposed)
        return
    fewest = min(len(s) for s in working)
    best = min(
        (max(priority[n] for n in s), sum(priority[n] for n in s))
        for s in working
        if len(s) == fewest
    )
    assert "n" in got, (objects, new, proposed)
    chosen = set(got["n"])
    assert chosen in working and len(chosen) == fewest
    assert (max(priority[n] for n in chosen), sum(priority[n] for n in chosen)) == best
