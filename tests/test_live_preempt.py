"""vramsched's own preemption by VRAM (`vramsched serve --preempt`) against the scripted API of
tests/test_live_repack.py: two single-GPU time-sliced nodes of 24Gi with 4 replicas each, so a
pod that fits no GPU's free VRAM still passes kube-scheduler's replica count, and its own
preemption finds no victim. The ledger's invariant is checked after every step."""

from __future__ import annotations

from typing import Any

import pytest
from builders import assigned, pod
from prometheus_client import CollectorRegistry, generate_latest
from test_live_repack import World, versioned, web

from extender.cli import build_parser
from extender.cluster import check_cluster
from extender.live.repack import RepackCollector
from extender.preemption_policy import PREEMPTED_REASON
from extender.repack_policy import ABANDONED_REASON, NOMINATED, REASON


def running(name: str, gib: int, node: str, priority: int) -> dict[str, Any]:
    return pod(
        name,
        f"{gib}Gi",
        node=node,
        uid=name,
        annotations=assigned(node, "0", gib),
        phase="Running",
        priority=priority,
    )


def crowded(priority: int = 100) -> list[dict[str, Any]]:
    """a: 14Gi of priority 0 (10 free); b: 14Gi of priority 5 (10 free); p asks 16Gi at
    `priority`: it fits no GPU until one of them goes, and every GPU has replicas left."""
    return [
        running("low0", 14, "a", 0),
        running("low5", 14, "b", 5),
        pod("p", "16Gi", uid="p", priority=priority),
    ]


@pytest.fixture
async def world() -> Any:
    made: list[World] = []

    def make(pods: list[dict[str, Any]], **kw: Any) -> World:
        w = World(versioned(pods), preempt=True, **{"repack": False, **kw})
        made.append(w)
        return w

    yield make
    for w in made:
        await w.repacker.stop()


async def test_the_lowest_priority_pod_is_evicted_and_its_gpu_held_for_the_pod(
    world: Any,
) -> None:
    w = world(crowded())
    assert w.filter("default/p")[0] == []
    await w.step(advance=1.5)
    # dry run, then the eviction, of the one pod of lowest priority
    assert w.evictions.calls == [("low0", True), ("low0", False)]
    assert w.evictions.bodies[-1]["deleteOptions"] == {
        "preconditions": {"uid": "low0", "resourceVersion": "1"}
    }
    run = w.repacker.run
    assert run is not None and run.phase == "releasing" and run.leaving() == ["default/low0"]
    # low0 is terminating and still holds a: p waits for it, and nobody else takes the room
    assert w.filter("default/p")[0] == []
    w.gone("default/low0")
    w.source.apply("pods", "ADDED", pod("other", "16Gi", uid="other", priority=100))
    assert w.filter("default/other")[0] == []
    assert w.held()["default/p"] == ("a", ("0",))
    await w.step()  # the pod is annotated: kube-scheduler retries it at once
    assert w.api.pods["default/p"]["metadata"]["annotations"][NOMINATED] == "a"
    assert w.filter("default/p")[0] == ["a"]
    assert await w.bind("default/p", "a") == ""
    await w.step()
    assert w.repacker.run is None
    last = w.repacker.last
    assert last is not None and last["phase"] == "done" and last["preempted"] == ["default/low0"]
    assert last["outcome"] == "blocked pod placed; 1 pod(s) preempted"
    assert check_cluster(w.cluster) == []
    stats = w.repacker.stats
    assert (stats.preemptions, stats.preempted, stats.moves, w.repacker.budget.spent) == (
        1,
        1,
        0,
        0,
    )
    events = await w.events()
    (on_low0,) = [e for e in events if e["reason"] == PREEMPTED_REASON]
    assert on_low0["involvedObject"]["uid"] == "low0"
    assert "for pod default/p of priority 100 (this pod: 0)" in on_low0["message"]
    assert "needs 16Gi on 1 GPU" in on_low0["message"]
    (on_p,) = [e for e in events if e["reason"] == REASON]
    assert on_p["involvedObject"]["name"] == "p"
    assert "preempted 1 pod(s) of lower priority (default/low0)" in on_p["message"]


@pytest.mark.parametrize(
    "why", ["equal priority", "preemptionPolicy Never", "kube-scheduler nominated it"]
)
async def test_no_preemption_where_kubernetes_would_not(world: Any, why: str) -> None:
    pods = crowded(priority=5 if why == "equal priority" else 100)
    if why == "equal priority":
        pods[0]["spec"]["priority"] = 5  # both pods are of the pod's priority
    if why == "preemptionPolicy Never":
        pods[2]["spec"]["preemptionPolicy"] = "Never"
    if why == "kube-scheduler nominated it":
        pods[2]["status"]["nominatedNodeName"] = "b"
    w = world(pods)
    w.filter("default/p")
    await w.step(advance=1.5)
    await w.step(advance=11)
    assert w.evictions.calls == [] and w.repacker.run is None


async def test_a_budget_refusing_the_cheapest_victim_picks_the_next(world: Any) -> None:
    w = world(crowded())
    w.evictions.refuse["low0"] = 429
    w.filter("default/p")
    await w.step(advance=1.5)
    assert w.evictions.real() == ["low5"]
    run = w.repacker.run
    assert run is not None and run.placement.node == "b"


async def test_no_victim_anywhere_says_why_once(world: Any) -> None:
    w = world(crowded())
    w.evictions.refuse["low0"] = w.evictions.refuse["low5"] = 429
    w.filter("default/p")
    await w.step(advance=1.5)
    await w.step(advance=11)
    assert w.evictions.real() == [] and w.repacker.run is None
    events = await w.events()
    assert len(events) == 1 and events[0]["involvedObject"]["name"] == "p"
    message = events[0]["message"]
    assert message.startswith("no preemption now: no pods of lower priority")
    assert "default/low0: a PodDisruptionBudget allows no disruption now" in message


async def test_only_nodes_the_pod_may_use_are_preempted_on(world: Any) -> None:
    pods = crowded()
    pods[2]["spec"]["nodeSelector"] = {"kubernetes.io/hostname": "b"}
    w = world(pods)
    for n in w.nodes:
        w.cluster.nodes[n]["metadata"].setdefault("labels", {})["kubernetes.io/hostname"] = n
    w.filter("default/p")
    await w.step(advance=1.5)
    assert w.evictions.real() == ["low5"]


def requests_cpu(p: dict[str, Any], cores: str) -> dict[str, Any]:
    p["spec"]["containers"][0]["resources"]["requests"]["cpu"] = cores
    return p


async def test_a_node_short_of_cpu_with_the_victims_gone_is_passed_over(world: Any) -> None:
    """p asks 60 cores; a (64) runs a pod of 10 cores that may not go: evicting low0 there would
    free the VRAM but not the cores, so low5 on b goes instead (a plan books GPUs only; kube-
    scheduler would refuse p on a for its cores)."""
    pods = crowded()
    requests_cpu(pods[2], "60")
    pods.append(requests_cpu(running("hog", 2, "a", 1000), "10"))
    pods[0] = running("low0", 12, "a", 0)  # a: 12 + 2 used, 10 free; 24 free with low0 gone
    w = world(pods)
    w.filter("default/p")
    await w.step(advance=1.5)
    assert w.evictions.real() == ["low5"]
    # the victims' own cores count as freed: with low0 asking 10, 54 of a's 64 come free
    requests_cpu(pods[0], "10")
    requests_cpu(pods[2], "50")
    w2 = world(pods)
    w2.filter("default/p")
    await w2.step(advance=1.5)
    assert w2.evictions.real() == ["low0"]


async def test_victims_free_the_cores_as_well_as_the_vram(world: Any) -> None:
    """On a (64 cores, 24Gi): low0 holds the VRAM p needs (12Gi, 2 cores) and lowcpu the cores
    (2Gi, 40); hog (10 cores) may not go, nor b's pod (priority 200). Evicting low0 alone frees
    the VRAM but leaves 14 cores of the 50 p asks: both go, the fewest that free both."""
    pods = [
        requests_cpu(running("low0", 12, "a", 0), "2"),
        requests_cpu(running("lowcpu", 2, "a", 0), "40"),
        requests_cpu(running("hog", 2, "a", 1000), "10"),
        running("high", 14, "b", 200),
        requests_cpu(pod("p", "14Gi", uid="p", priority=100), "50"),
    ]
    w = world(pods)
    w.filter("default/p")
    await w.step(advance=1.5)
    assert sorted(w.evictions.real()) == ["low0", "lowcpu"]
    run = w.repacker.run
    assert run is not None and run.placement.node == "a"
    # p asking 56 cores: short even with both gone (54 free, hog stays), so nobody is evicted
    requests_cpu(pods[4], "56")
    w2 = world(pods)
    w2.filter("default/p")
    await w2.step(advance=1.5)
    assert w2.evictions.real() == [] and w2.repacker.run is None


async def test_a_pod_leaving_already_is_waited_for(world: Any) -> None:
    pods = crowded()
    pods[0]["metadata"]["deletionTimestamp"] = "now"
    w = world(pods)
    w.filter("default/p")
    await w.step(advance=1.5)
    assert w.evictions.calls == [] and w.repacker.run is None


async def test_a_victim_raised_above_the_pod_before_its_eviction_is_spared(
    world: Any,
) -> None:
    """Its priority is read again before the eviction (a re-created pod of a higher class under
    the name, say): the preemption stops, and says so."""
    w = world(crowded())

    def raise_it() -> None:
        w.api.pods["default/low0"]["spec"]["priority"] = 1000
        w.watch("default/low0")

    w.evictions.before[("low0", True)] = raise_it
    w.filter("default/p")
    await w.step(advance=1.5)
    assert w.evictions.real() == [] and w.repacker.run is None
    (warning,) = [e for e in await w.events() if e["reason"] == ABANDONED_REASON]
    assert "preemption abandoned after evicting 0 of 1 pod(s)" in warning["message"]
    assert "priority 1000 is not below 100" in warning["message"]


async def test_with_repacking_on_a_move_comes_before_a_preemption(world: Any) -> None:
    """A movable pod on b (4Gi of b's 10 used) can go to a: moving it places p on b without
    stopping anyone. Once it may not move, preemption evicts it instead."""
    pods = [
        running("low0", 14, "a", 0),
        running("f2", 6, "b", 5),
        web("m2", 4, "b"),
        pod("p", "16Gi", uid="p", priority=100),
    ]
    w = world(pods, repack=True)
    w.filter("default/p")
    await w.step(advance=1.5)
    assert w.evictions.real() == ["m2"] and w.repacker.stats.preemptions == 0

    pods[2]["metadata"]["annotations"].pop("vramsched.io/movable")
    w2 = world(pods, repack=True)
    w2.filter("default/p")
    await w2.step(advance=1.5)
    # the same pod goes, now as a victim: of the two of priority 0, the one freeing least VRAM
    assert w2.evictions.real() == ["m2"] and w2.repacker.stats.preemptions == 1
    run = w2.repacker.run
    assert run is not None and run.targets == [] and run.placement.node == "b"


async def test_a_plan_the_cluster_outgrew_while_it_was_checked_evicts_nobody(
    world: Any,
) -> None:
    """A pod lands on a between the plan and the evictions (after the dry run): with low0
    gone, a would have 14Gi free, not 16. Nothing is evicted; the next try plans again."""
    w = world(crowded())

    def lands() -> None:
        w.source.apply("pods", "ADDED", running("late", 10, "a", 1000))

    w.evictions.before[("low0", True)] = lands
    w.filter("default/p")
    await w.step(advance=1.5)
    assert w.evictions.real() == [] and w.repacker.run is None
    assert w.repacker.stats.stale == 1
    await w.step(advance=11)  # the next try: low5 on b is the only way now
    assert w.evictions.real() == ["low5"]


async def test_a_victim_that_never_leaves_abandons_the_preemption(world: Any) -> None:
    """A kubelet that never confirms the deletion: the pod never gets the GPU; once the victim
    had to be gone, the preemption is abandoned, saying which pod is still there."""
    w = world(crowded())
    w.filter("default/p")
    await w.step(advance=1.5)
    run = w.repacker.run
    assert run is not None and run.leaving() == ["default/low0"]
    await w.step(advance=run.deadline - w.clock() + 1)
    assert w.repacker.run is None and w.repacker.stats.abandoned == 1
    assert "default/p" not in w.held()
    (warning,) = [e for e in await w.events() if e["reason"] == ABANDONED_REASON]
    assert warning["message"].startswith(
        "vramsched preemption abandoned after evicting 1 of 1 pod(s) (default/low0): the "
        "preempted pods were not all gone in time (still there: default/low0)"
    )


async def test_preemption_metrics(world: Any) -> None:
    w = world(crowded())
    w.filter("default/p")
    await w.step(advance=1.5)
    registry = CollectorRegistry()
    registry.register(RepackCollector(w.repacker))
    text = generate_latest(registry).decode()
    assert "vramsched_preempted_pods_total 1.0" in text
    assert "vramsched_repack_moves_total 0.0" in text
    state = w.service.planner_state()
    assert state is not None and state["repack"]["preemptions"] == 1
    assert state["repack"]["running"]["preempted"] == ["default/low0"]


def test_serve_flag() -> None:
    parser = build_parser()
    assert parser.parse_args(["serve"]).preempt is False
    assert parser.parse_args(["serve", "--preempt"]).preempt is True
    with pytest.raises(SystemExit, match="--preempt needs live mode"):
        args = parser.parse_args(["serve", "--cluster", "x.yaml", "--preempt"])
        args.run(args)
