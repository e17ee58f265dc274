"""The background planner as the service's PlanSource: plan use, per-node invalidation, fallbacks."""

from __future__ import annotations

import asyncio

from builders import cluster, gpu_node, pod
from extender.ledger import Reservation, check_invariant
from extender.demand import PodRef
from extender.planner.background import BackgroundPlanner
from extender.quantity import GIB
from extender.service import EmbeddedBinder, ExtenderService
from extender.wire import ExtenderArgs, ExtenderBindingArgs

NODES = ["a", "b", "c"]


def setup(*pending):
    c = cluster(*(gpu_node(n, count=2, memory_mib=80 * 1024, replicas=4) for n in NODES), *pending)
    planner = BackgroundPlanner(c, time_limit=2.0, num_workers=1)
    return c, planner, ExtenderService(c, EmbeddedBinder(c), planner=planner)


def scores(svc, p):
    return {h.Host: h.Score for h in svc.prioritize(ExtenderArgs(Pod=p, NodeNames=NODES))}


def test_prioritize_gives_the_planned_node_the_top_score_and_bind_uses_the_planned_gpus():
    pods = [pod("big", "60Gi"), pod("mid", "30Gi"), pod("small", "20Gi")]
    c, planner, svc = setup(*pods)
    assert c.pending == {"default/big", "default/mid", "default/small"}
    plan = planner.plan_once()
    assert plan is not None and plan.placed == 3
    for p in pods:
        key = f"default/{p['metadata']['name']}"
        node = planner.planned_node(key)
        assert node in NODES
        assert scores(svc, p)[node] == 10
        planned = planner.entries[key].reservation
        result = asyncio.run(svc.bind(ExtenderBindingArgs(PodName=p["metadata"]["name"], PodNamespace="default", Node=node)))
        assert result.Error == ""
        held = c.ledger.reservation(key)
        assert (held.node, held.device_ids) == (planned.node, planned.device_ids)
    assert check_invariant(c.ledger) == []
    assert planner.stats.hits == 3


def test_without_a_plan_the_greedy_path_answers():
    p = pod("x", "20Gi")
    c, planner, svc = setup(p)
    plain = ExtenderService(c, EmbeddedBinder(c))
    assert planner.planned_node("default/x") is None  # cold start
    assert scores(svc, p) == scores(plain, p)
    result = asyncio.run(svc.bind(ExtenderBindingArgs(PodName="x", PodNamespace="default", Node="a")))
    assert result.Error == "" and c.ledger.reservation("default/x").node == "a"


def test_a_change_invalidates_only_the_entries_it_touches():
    pods = [pod("p1", "70Gi"), pod("p2", "70Gi"), pod("p3", "70Gi")]
    c, planner, svc = setup(*pods)
    planner.plan_once()
    where = {k: e for k, e in planner.entries.items()}
    victim_key = "default/p1"
    victim = where[victim_key]
    # someone else takes the planned GPU (a pod bound by another scheduler)
    dev = victim.reservation.device_ids[0]
    c.ledger.record(Reservation(PodRef("other", "intruder"), victim.node, (dev,), (50 * GIB,)))
    assert planner.planned_node(victim_key) is None
    for key, e in where.items():
        if key != victim_key and (e.node != victim.node or e.reservation.device_ids[0] != dev):
            assert planner.planned_node(key) == e.node
    assert planner.stats.stale == 1


def test_binding_one_planned_pod_keeps_its_neighbours_plans():
    pods = [pod("p1", "30Gi"), pod("p2", "30Gi")]
    c, planner, svc = setup(*pods)
    planner.plan_once()
    e1, e2 = planner.entries["default/p1"], planner.entries["default/p2"]
    assert asyncio.run(svc.bind(ExtenderBindingArgs(PodName="p1", PodNamespace="default", Node=e1.node))).Error == ""
    assert planner.planned_node("default/p2") == e2.node  # same node changed, its GPUs are still free
    assert planner.planned_node("default/p1") is None  # bound: no longer pending


def test_a_stale_planned_reservation_is_not_used_by_bind():
    p = pod("p", "60Gi")
    c, planner, svc = setup(p, pod("q", "60Gi"))
    planner.plan_once()
    e = planner.entries["default/p"]
    c.ledger.record(Reservation(PodRef("other", "x"), e.node, e.reservation.device_ids, (70 * GIB,)))
    result = asyncio.run(svc.bind(ExtenderBindingArgs(PodName="p", PodNamespace="default", Node=e.node)))
    assert result.Error == ""  # best fit on the other GPU of that node
    assert c.ledger.reservation("default/p").device_ids != e.reservation.device_ids
    assert check_invariant(c.ledger) == []


def test_background_loop_plans_off_the_event_loop():
    async def scenario():
        c, planner, svc = setup()
        planner.poll = 0.05
        await planner.start()
        try:
            c.upsert_pod(pod("late", "20Gi"))
            planner.notify_pending("default/late")
            for _ in range(400):
                if planner.planned_node("default/late"):
                    break
                await asyncio.sleep(0.05)
            return planner.planned_node("default/late"), planner.stats.plans
        finally:
            await planner.stop()

    node, plans = asyncio.run(scenario())
    assert node in NODES and plans >= 1


def test_a_failing_solver_leaves_the_greedy_path_in_charge(monkeypatch):
    from extender.planner import background

    p = pod("x", "20Gi")
    c, planner, svc = setup(p)

    def boom(*a, **k):
        raise RuntimeError("solver crashed")

    monkeypatch.setattr(background, "_solve", boom)
    assert asyncio.run(planner.replan()) is None
    assert planner.stats.errors == 1 and planner.planned_node("default/x") is None
    plain = ExtenderService(c, EmbeddedBinder(c))
    assert scores(svc, p) == scores(plain, p)


def test_a_recreated_pod_does_not_inherit_the_old_plan():
    c, planner, svc = setup(pod("x", "20Gi", uid="old"))
    planner.plan_once()
    assert planner.planned_node("default/x") is not None
    c.upsert_pod(pod("x", "20Gi", uid="new"))
    assert planner.planned_node("default/x") is None
