"""The background planner as the service's PlanSource: plan use, per-node invalidation, fallbacks."""

from __future__ import annotations

import asyncio

import pytest
from builders import cluster, gpu_node, pod

from extender.cluster import check_cluster
from extender.demand import PodRef, pod_demand
from extender.embedded import EmbeddedBinder
from extender.ledger import Reservation, check_invariant
from extender.planner.background import BackgroundPlanner
from extender.quantity import GIB
from extender.service import ExtenderService
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
        result = asyncio.run(
            svc.bind(
                ExtenderBindingArgs(
                    PodName=p["metadata"]["name"], PodNamespace="default", Node=node
                )
            )
        )
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
    result = asyncio.run(
        svc.bind(ExtenderBindingArgs(PodName="x", PodNamespace="default", Node="a"))
    )
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
    assert (
        asyncio.run(
            svc.bind(ExtenderBindingArgs(PodName="p1", PodNamespace="default", Node=e1.node))
        ).Error
        == ""
    )
    assert (
        planner.planned_node("default/p2") == e2.node
    )  # same node changed, its GPUs are still free
    assert planner.planned_node("default/p1") is None  # bound: no longer pending


def test_a_stale_planned_reservation_is_not_used_by_bind():
    p = pod("p", "60Gi")
    c, planner, svc = setup(p, pod("q", "60Gi"))
    planner.plan_once()
    e = planner.entries["default/p"]
    c.ledger.record(
        Reservation(PodRef("other", "x"), e.node, e.reservation.device_ids, (70 * GIB,))
    )
    result = asyncio.run(
        svc.bind(ExtenderBindingArgs(PodName="p", PodNamespace="default", Node=e.node))
    )
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


def bind_x(svc, node: str) -> str:
    """kube-scheduler's bind of pod default/x to `node`: its error, "" on success."""
    args = ExtenderBindingArgs(PodName="x", PodNamespace="default", Node=node)
    return asyncio.run(svc.bind(args)).Error


def test_a_plan_made_before_the_model_memory_was_edited_is_not_booked():
    """A pending pod's annotation can be edited under the same UID. The plan's GPUs were sized
    for the old value: booked as they are, the ledger (and the assignment bind writes) would
    count 20 GiB for a pod that now uses 70."""
    c, planner, svc = setup(pod("x", "20Gi", uid="u1"))
    planner.plan_once()
    node = planner.entries["default/x"].node
    edited = pod("x", "70Gi", uid="u1")
    c.upsert_pod(edited)
    assert planner.planned_node("default/x", NODES, pod_demand(edited)) is None
    assert bind_x(svc, node) == ""
    held = c.ledger.reservation("default/x")
    assert (held.pod.uid, held.bytes_per_device) == ("u1", (70 * GIB,))
    assert svc.plan_refused_at_bind == 0  # the entry was dropped at prioritize, not refused
    assert check_cluster(c) == []


def test_bind_books_what_the_pod_asks_even_when_handed_a_plan_for_its_old_size():
    c, planner, svc = setup(pod("x", "20Gi", uid="u1"))
    planner.plan_once()
    node = planner.entries["default/x"].node
    c.upsert_pod(pod("x", "70Gi", uid="u1"))  # no prioritize since: the entry is still there
    assert bind_x(svc, node) == ""
    assert c.ledger.reservation("default/x").bytes_per_device == (70 * GIB,)
    assert svc.plan_refused_at_bind == 1
    assert check_cluster(c) == []


def test_a_pod_re_created_while_the_solver_runs_does_not_get_the_old_pods_plan(monkeypatch):
    from extender.planner import background

    c, planner, svc = setup(pod("x", "20Gi", uid="u1"))
    solve = background._solve

    def slow_solve(*args, **kwargs):
        c.upsert_pod(pod("x", "70Gi", uid="u2"))  # a StatefulSet's next pod, meanwhile
        return solve(*args, **kwargs)

    monkeypatch.setattr(background, "_solve", slow_solve)
    plan = asyncio.run(planner.replan())
    assert plan is not None and plan.placed == 1
    assert planner.planned_node("default/x") is None
    node = plan.choices[0][0].node
    assert bind_x(svc, node) == ""
    held = c.ledger.reservation("default/x")
    assert (held.pod.uid, held.bytes_per_device) == ("u2", (70 * GIB,))
    assert check_cluster(c) == []


def _with_requests(p: dict, cpu: str, memory: str) -> dict:
    p["spec"]["containers"][0]["resources"]["requests"].update({"cpu": cpu, "memory": memory})
    return p


def _reference_usage(c) -> tuple[dict, dict]:
    """CPU/memory per node as the snapshot used to compute it: every live bound pod parsed again,
    one whose annotation is unreadable as one that declares no memory."""
    from extender.demand import DemandError, pod_demand

    cpu: dict[str, int] = {}
    mem: dict[str, int] = {}
    for p in c.pods.values():
        node = p["spec"].get("nodeName")
        if not node or p["status"].get("phase") in ("Succeeded", "Failed"):
            continue
        try:
            d = pod_demand(p)
        except DemandError:
            # counted as if it declared no memory (its annotation unreadable), else not at all
            rest = dict(p["metadata"].get("annotations") or {})
            rest.pop("vramsched.io/model-memory", None)
            try:
                d = pod_demand({**p, "metadata": {**p["metadata"], "annotations": rest}})
            except DemandError:
                continue
        cpu[node] = cpu.get(node, 0) + d.cpu_milli
        mem[node] = mem.get(node, 0) + d.memory_bytes
    return cpu, mem


@pytest.mark.parametrize("seed", range(16))
def test_cpu_and_memory_sums_and_the_demand_mix_follow_every_pod_event(seed: int) -> None:
    """After any sequence of pod events the CPU and memory sums, the demand mix and the ledger's
    holdings are those of the latest objects alone, including events no API server sends (a
    pod's scheduler, node or GPU count changed under the same UID): the cluster's state must not
    depend on the path taken."""
    import random

    from extender.cluster import check_cluster

    rng = random.Random(seed)
    c = cluster(*(gpu_node(n, count=2, memory_mib=80 * 1024, replicas=4) for n in NODES))
    for step in range(300):
        name = f"p{rng.randrange(25)}"
        roll = rng.random()
        if roll < 0.15:
            c.delete_pod(f"default/{name}")
            continue
        p = _with_requests(
            pod(
                name,
                rng.choice(["8Gi", None]),
                gpus=rng.choice([0, 1]),
                node=rng.choice([None, *NODES]),
                phase=rng.choice(["Pending", "Running", "Running", "Succeeded"]),
                uid=f"{name}-{rng.randrange(3)}",
                scheduler=rng.choice(["vramsched", "vramsched", "default-scheduler"]),
            ),
            f"{rng.randrange(1, 9)}",
            f"{rng.randrange(1, 9)}Gi",
        )
        if roll < 0.2:
            p["spec"]["containers"][0]["resources"]["requests"]["cpu"] = (
                "lots"  # unreadable: counted nowhere
            )
        c.upsert_pod(p)
        want_cpu, want_mem = _reference_usage(c)
        assert (
            {k: v for k, v in c.cpu_used.items() if v},
            {k: v for k, v in c.memory_used.items() if v},
        ) == ({k: v for k, v in want_cpu.items() if v}, {k: v for k, v in want_mem.items() if v}), (
            step
        )
        # every rule but the device one: a pod bound by another scheduler, or guessed on whole
        # GPUs, may hold more than a GPU has, as the API says it does
        assert not [str(v) for v in check_cluster(c) if "oversubscribed" not in v.what], step
    assert c.cpu_used  # the walk ended with pods running somewhere
    assert c.demand_mix  # and pods of ours pending or running


def test_cpu_held_during_an_in_place_resize_stays_counted():
    """A pod shrunk in place holds its old CPU until the kubelet applies the new size: the
    planner's books follow the status as kube-scheduler's do, and free it once applied."""
    from extender.cluster import check_cluster

    p = _with_requests(pod("p", node="a", phase="Running"), "1", "1Gi")
    p["spec"]["containers"][0]["name"] = "app"
    c = cluster(gpu_node("a"), p)
    assert c.cpu_used == {"a": 1000}
    held = {"name": "app", "allocatedResources": {"cpu": "4", "memory": "1Gi"}}
    resizing = {**p, "status": {**p["status"], "containerStatuses": [held]}}
    c.upsert_pod(resizing)
    assert c.cpu_used == {"a": 4000} and check_cluster(c) == []
    held["allocatedResources"]["cpu"] = "1"
    done = {**p, "status": {**p["status"], "containerStatuses": [held]}}
    c.upsert_pod(done)
    assert c.cpu_used == {"a": 1000} and check_cluster(c) == []


def test_check_cluster_notices_a_wrong_cpu_sum():
    from extender.cluster import check_cluster

    c = cluster(gpu_node("a"), _with_requests(pod("p", node="a", phase="Running"), "2", "1Gi"))
    assert c.cpu_used == {"a": 2000} and check_cluster(c) == []
    c.cpu_used["a"] = 1000
    assert [v.what for v in check_cluster(c)] == [
        "CPU/memory requested on the node is (2000, 1073741824), counted (1000, 1073741824)"
    ]


def test_snapshot_is_a_private_copy_equal_to_the_cluster():
    from extender.placement import choose_devices
    from extender.planner.background import snapshot

    running = [
        _with_requests(pod(f"r{i}", "20Gi", node=NODES[i % 3], phase="Running"), "4", "16Gi")
        for i in range(5)
    ]
    c, planner, svc = setup(*running, pod("waiting", "30Gi"))
    cap, gens = snapshot(c)
    a, b = c.ledger.arrays, cap.arrays
    assert (a.used == b.used).all() and (a.used_replicas == b.used_replicas).all()
    assert (a.node_used_replicas == b.node_used_replicas).all()
    assert gens == c.ledger.node_generation
    # a capacity copy: the used columns without the record of who holds them
    assert list(cap.ledger.reservations()) == [] and cap.ledger.pods_on(NODES[0]) == []
    want_cpu, want_mem = _reference_usage(c)
    for i, name in enumerate(b.node_names):
        assert cap.cpu_free[i] == cap.cpu_total[i] - want_cpu.get(name, 0)
        assert cap.mem_free[i] == cap.mem_total[i] - want_mem.get(name, 0)
    # the copy and the cluster change independently
    before = a.used.copy()
    copy_before = b.used.copy()
    demand = svc._demand(c.pod("default/waiting"))
    res = cap.ledger.reserve(choose_devices(cap.ledger, demand, "a"))
    assert (c.ledger.arrays.used == before).all() and c.ledger.reservation(
        "default/waiting"
    ) is None
    assert b.used.sum() == copy_before.sum() + sum(res.bytes_per_device)
    c.ledger.release("default/r0")
    assert c.ledger.arrays.used.sum() < before.sum() and b.used.sum() == copy_before.sum() + sum(
        res.bytes_per_device
    )
    # the copy releases what it reserved itself, back to the state it was taken in
    cap.ledger.release("default/waiting")
    assert (b.used == copy_before).all() and check_invariant(c.ledger) == []


def test_a_pod_placed_before_it_is_min_age_old_is_never_planned_and_a_waiting_one_is():
    c, planner, svc = setup(pod("quick", "20Gi"), pod("waits", "20Gi"))
    t0 = 1000.0
    aged = planner._aged(t0)
    assert aged == frozenset() and not planner._needs_plan(aged, t0)
    asyncio.run(
        svc.bind(ExtenderBindingArgs(PodName="quick", PodNamespace="default", Node="a"))
    )  # placed at once
    aged = planner._aged(t0 + planner.min_age)
    assert aged == {"default/waits"} and planner._needs_plan(aged, t0 + planner.min_age)
    asyncio.run(planner.replan(aged))
    assert (
        planner.planned_node("default/waits") in NODES
        and planner.planned_node("default/quick") is None
    )


def test_after_a_plan_only_new_waiting_pods_replan_at_once_other_changes_wait_for_refresh():
    import time

    c, planner, svc = setup(pod("w1", "20Gi"))
    planner._aged(time.monotonic() - planner.min_age)  # w1 has been waiting long enough
    aged = planner._aged(time.monotonic())
    asyncio.run(planner.replan(aged))
    planned_at = planner._planned_from[2]
    assert not planner._needs_plan(aged, planned_at)  # nothing changed
    c.upsert_pod(pod("elsewhere", "10Gi", node="b", phase="Running"))  # the cluster changed
    assert not planner._needs_plan(aged, planned_at + planner.refresh / 2)
    assert planner._needs_plan(aged, planned_at + planner.refresh)
    c.upsert_pod(pod("w2", "20Gi"))  # a new pod starts waiting
    soon = planned_at + planner.min_interval
    planner._aged(soon - planner.min_age)
    aged = planner._aged(soon)
    assert aged == {"default/w1", "default/w2"}
    assert not planner._needs_plan(
        aged, planned_at + planner.min_interval / 2
    )  # plans start at most this often
    assert planner._needs_plan(aged, soon)
    # a planned pod that leaves needs no new plan: the others' entries stay valid per node
    asyncio.run(planner.replan(aged))
    planned_at = planner._planned_from[2]
    node = planner.planned_node("default/w1")
    asyncio.run(svc.bind(ExtenderBindingArgs(PodName="w1", PodNamespace="default", Node=node)))
    after = planned_at + planner.min_interval + 0.1
    aged = planner._aged(after)
    assert aged == {"default/w2"} and not planner._needs_plan(aged, after)
    assert planner.planned_node("default/w2") in NODES


def test_a_pod_that_fit_nowhere_is_left_out_of_plans_for_new_pods_until_the_refresh():
    import time

    c, planner, svc = setup(pod("huge", "200Gi"), pod("w1", "20Gi"))
    start = time.monotonic()
    planner._aged(start - planner.min_age)
    asyncio.run(planner.step(start))
    assert planner.stats.last_batch == 2 and planner._unplaced == {"default/huge"}
    c.upsert_pod(pod("w2", "20Gi"))
    planner._aged(start - planner.min_age)
    asyncio.run(
        planner.step(planner._planned_from[2] + planner.min_interval)
    )  # a new waiting pod, without `huge`
    assert planner.stats.plans == 2 and planner.stats.last_batch == 1  # w2 alone, around w1's entry
    assert (
        planner.planned_node("default/w2") in NODES and planner.planned_node("default/w1") in NODES
    )
    c.upsert_pod(pod("elsewhere", "10Gi", node="b", phase="Running"))
    asyncio.run(
        planner.step(planner._planned_from[2] + planner.refresh)
    )  # the refresh: still without it
    assert planner.stats.plans == 3 and planner.stats.last_batch == 2
    c.upsert_pod(pod("elsewhere-2", "10Gi", node="c", phase="Running"))
    asyncio.run(
        planner.step(planner._planned_from[2] + planner.refresh_all)
    )  # the full plan: everyone
    assert planner.stats.plans == 4 and planner.stats.last_batch == 3
    assert planner._unplaced == {"default/huge"}


def test_a_pod_filter_found_no_node_for_is_not_planned_until_the_full_plan():
    import time

    c, planner, svc = setup(pod("w1", "20Gi"))
    start = time.monotonic()
    planner._aged(start - planner.min_age)
    asyncio.run(planner.step(start))
    assert planner.stats.plans == 1
    stuck = pod("stuck", "200Gi")
    out = svc.filter(ExtenderArgs(Pod=stuck, NodeNames=NODES))  # embedded mode learns it here
    assert out.NodeNames == [] and "default/stuck" in planner._unschedulable
    planner._aged(start - planner.min_age)
    soon = planner._planned_from[2] + planner.min_interval
    assert not planner._needs_plan(planner._aged(soon), soon)  # waiting, but no plan for it
    c.upsert_pod(pod("elsewhere", "10Gi", node="b", phase="Running"))
    later = start + planner.refresh_all
    asyncio.run(planner.step(later))  # the full plan, still without it
    assert planner.stats.plans == 2 and planner.stats.last_batch == 1
    later = planner._planned_from[2]
    # room appears (here: a bigger node) and kube-scheduler's retry finds it: planned again
    c.upsert_node(gpu_node("roomy", count=4, memory_mib=256 * 1024))
    assert svc.filter(ExtenderArgs(Pod=stuck, NodeNames=[*NODES, "roomy"])).NodeNames == ["roomy"]
    assert "default/stuck" not in planner._unschedulable
    later += planner.min_interval
    assert planner._needs_plan(planner._aged(later), later)
    asyncio.run(planner.step(later))
    assert planner.planned_node("default/stuck") == "roomy"


def test_serve_plans_by_default_and_no_planner_turns_it_off():
    from extender.cli import build_parser
    from extender.commands.serve import _planner

    c = cluster(gpu_node("a"))
    on = build_parser().parse_args(["serve", "--cluster", "x.yaml"])
    off = build_parser().parse_args(["serve", "--cluster", "x.yaml", "--no-planner"])
    assert isinstance(_planner(on, c), BackgroundPlanner)
    assert _planner(off, c) is None


def test_serve_open_gpu_cost_reaches_the_planner_and_bad_values_stop_serve():
    from extender.cli import build_parser
    from extender.commands.serve import _planner

    c = cluster(gpu_node("a"))
    parser = build_parser()
    assert _planner(parser.parse_args(["serve", "--cluster", "x.yaml"]), c).open_cost == 0.0
    args = parser.parse_args(["serve", "--cluster", "x.yaml", "--open-gpu-cost", "0.2"])
    assert _planner(args, c).open_cost == 0.2
    for bad in ("-1", "nan"):
        with pytest.raises(SystemExit) as stop:
            parser.parse_args(["serve", "--cluster", "x.yaml", "--open-gpu-cost", bad])
        assert stop.value.code == 2


def test_a_planner_with_an_open_gpu_cost_plans_without_overcommitting():
    pods = [pod(f"m{i}", "23Gi") for i in range(3)] + [pod("mixtral", "49Gi")]
    c = cluster(*(gpu_node(n, count=2, memory_mib=80 * 1024, replicas=4) for n in NODES), *pods)
    planner = BackgroundPlanner(c, time_limit=2.0, num_workers=1, open_cost=0.2)
    plan = planner.plan_once()
    assert plan is not None and plan.placed == 4
    assert all(planner.planned_node(f"default/{p['metadata']['name']}") in NODES for p in pods)
    assert check_invariant(c.ledger) == []


def test_a_newly_waiting_pod_is_planned_around_the_entries_that_still_hold():
    """Between full plans, a pod that starts waiting gets a plan of its own on a snapshot that holds
    what the kept entries hold: the two plans never count the same room twice."""
    import time

    c = cluster(
        gpu_node("a", count=1, memory_mib=80 * 1024, replicas=4),
        gpu_node("b", count=1, memory_mib=80 * 1024, replicas=4),
        pod("w1", "60Gi"),
    )
    planner = BackgroundPlanner(c, time_limit=2.0, num_workers=1)
    start = time.monotonic()
    planner._aged(start - planner.min_age)
    asyncio.run(planner.step(start))
    first = planner.entries["default/w1"]
    c.upsert_pod(pod("w2", "60Gi"))
    planner._aged(start - planner.min_age)
    asyncio.run(planner.step(planner._planned_from[2] + planner.min_interval))
    assert planner.stats.plans == 2 and planner.stats.last_batch == 1
    assert planner.entries["default/w1"] is first  # kept as it was
    assert {planner.planned_node("default/w1"), planner.planned_node("default/w2")} == {"a", "b"}
    c.upsert_pod(pod("w3", "60Gi"))  # no room left beside what w1 and w2 are planned to take
    planner._aged(start - planner.min_age)
    asyncio.run(planner.step(planner._planned_from[2] + 2 * planner.min_interval))
    assert planner.stats.plans == 3 and planner.stats.last_batch == 1
    assert planner.planned_node("default/w3") is None and "default/w3" in planner._unplaced
    assert planner.planned_node("default/w1") == first.node


def test_bind_rechecks_the_device_plugin_bound_before_taking_the_planned_gpus():
    """Plans are made on exact per-GPU books. With a replica policy (the stock device plugin picks
    the physical GPU of a time-sliced replica) a plan's GPUs that the per-GPU books still take may
    break the plugin's node-level bound by the time of the bind: bind must not take them."""
    c = cluster(
        gpu_node("a", count=2, memory_mib=80 * 1024, replicas=4),
        pod("new", "40Gi"),
        replica_policy="distributed",
    )
    c.ledger.reserve(Reservation(PodRef("default", "big", "big"), "a", ("0",), (50 * GIB,)))
    planner = BackgroundPlanner(c, time_limit=1.0, num_workers=1)
    svc = ExtenderService(c, EmbeddedBinder(c), planner=planner)
    planner.plan_once()
    planned = planner.entries["default/new"].reservation
    assert planner.planned_node("default/new") == "a" and planned.device_ids == ("1",)
    # a 10Gi pod lands on GPU 1 first: three pods on two GPUs, so the plugin may put two on one
    # GPU, 50 + 40 Gi on 80 Gi; the per-GPU books alone would still take the plan
    c.ledger.reserve(Reservation(PodRef("default", "small", "small"), "a", ("1",), (10 * GIB,)))
    assert c.ledger.fits(planned) is None
    result = asyncio.run(
        svc.bind(ExtenderBindingArgs(PodName="new", PodNamespace="default", Node="a"))
    )
    assert "does not fit on a" in result.Error and "may stack 90Gi on a 80Gi GPU" in result.Error
    assert c.ledger.reservation("default/new") is None and check_invariant(c.ledger) == []
    assert svc.planner_state()["hits"] == 1 and svc.planner_state()["refusedAtBind"] == 1


def test_a_burst_of_pods_is_planned_by_the_arc_flow_relaxation_and_bound_as_planned():
    """More than 16 pods pending together (a Deployment scaled up): FGD one at a time strands
    memory that the arc-flow plan uses; prioritize and bind then follow that plan."""
    sizes = [20, 20, 30, 40, 10, 10, 40, 30, 20, 20, 40, 40, 40, 20, 20, 20, 40]  # 460 GiB for 480
    pods = [pod(f"r{i}", f"{gib}Gi") for i, gib in enumerate(sizes)]
    c, planner, svc = setup(*pods)
    plan = planner.plan_once()
    assert plan is not None and plan.status == "FLOW" and plan.placed == len(sizes)
    assert plan.cost[1] < plan.greedy_cost[1]  # less stranded VRAM than FGD's sequential plan
    for p in pods:
        key = f"default/{p['metadata']['name']}"
        node = planner.planned_node(key)
        assert scores(svc, p)[node] == 10
        planned = planner.entries[key].reservation
        assert (
            asyncio.run(
                svc.bind(
                    ExtenderBindingArgs(
                        PodName=p["metadata"]["name"], PodNamespace="default", Node=node
                    )
                )
            ).Error
            == ""
        )
        held = c.ledger.reservation(key)
        assert (held.node, held.device_ids) == (planned.node, planned.device_ids)
    assert check_invariant(c.ledger) == [] and planner.stats.hits == len(sizes)


def _mix_cluster(*extra):
    """a: one 80 GiB GPU with 40 GiB used; b: 20 GiB used; c: full of 40 GiB pods. Most of the
    pods running are 40 GiB ones."""
    from builders import assigned

    running = [
        pod("r40", "40Gi", node="a", phase="Running", annotations=assigned("a", "0", 40)),
        pod("r20", "20Gi", node="b", phase="Running", annotations=assigned("b", "0", 20)),
        pod("c1", "40Gi", node="c", phase="Running", annotations=assigned("c", "0", 40)),
        pod("c2", "40Gi", node="c", phase="Running", annotations=assigned("c", "0", 40)),
    ]
    nodes = (gpu_node(n, count=1, memory_mib=80 * 1024, replicas=4) for n in "abc")
    return cluster(*nodes, *running, *extra)


def test_the_demand_mix_counts_our_pending_and_running_pods_by_kind():
    from extender.cluster import check_cluster
    from extender.demand import pod_demand
    from extender.planner.capacity import demand_kind

    other = pod("theirs", "40Gi", node="a", phase="Running", scheduler="default-scheduler")
    c = _mix_cluster(pod("p20", "20Gi"), other)
    k20 = demand_kind(pod_demand(pod("x", "20Gi")))
    k40 = demand_kind(pod_demand(pod("x", "40Gi")))
    assert c.demand_mix == {k20: 2, k40: 3}  # not the other scheduler's pod
    c.delete_pod("default/c1")
    done = pod(
        "c2", "40Gi", node="c", phase="Succeeded", uid=c.pods["default/c2"]["metadata"]["uid"]
    )
    c.upsert_pod(done)
    assert c.demand_mix == {k20: 2, k40: 1}
    c.delete_pod("default/r40")
    assert c.demand_mix == {k20: 2}
    assert check_cluster(c) == []
    c.demand_mix[k40] += 1
    assert [v.what for v in check_cluster(c)] == [
        "demand mix counts 3 pods of 2 kinds, the pods have 2 of 1"
    ]


def test_a_gated_pod_waits_for_its_gates_not_for_the_planner():
    """kube-scheduler does not try a pod with scheduling gates (Kueue holds pods so until it
    admits them); planned all the same, it held room in later plans for a pod that may never
    come. It stays workload to come, and is planned once its gates are removed."""
    from extender.cluster import check_cluster

    gated = pod("queued", "60Gi")
    gated["spec"]["schedulingGates"] = [{"name": "kueue.x-k8s.io/admission"}]
    c, planner, _ = setup(gated, pod("now", "30Gi"))
    assert c.pending == {"default/now"}
    plan = planner.plan_once()
    assert plan is not None and planner.planned_node("default/queued") is None
    assert sum(c.demand_mix.values()) == 2 and check_cluster(c) == []
    c.upsert_pod(
        {**gated, "spec": {k: v for k, v in gated["spec"].items() if k != "schedulingGates"}}
    )
    assert c.pending == {"default/now", "default/queued"}
    planner.plan_once()
    assert planner.planned_node("default/queued") in NODES


def test_a_pod_planned_alone_is_placed_for_the_cluster_s_mix_not_its_own_type():
    # Alone, a 20 GiB pod leaves a usable gap on a or b either way; for the 40 GiB pods most of
    # the cluster runs, putting it on a leaves 20 GiB nobody of that kind can use.
    c = _mix_cluster(pod("p20", "20Gi"))
    planner = BackgroundPlanner(c, time_limit=1.0, num_workers=1)
    demands = planner.pending_demands()
    w = planner.workload(demands)
    assert sorted(zip(w.need.tolist(), w.weight.tolist())) == [(20 * GIB, 0.4), (40 * GIB, 0.6)]
    # /state shows the same, most common first
    assert [
        (t["memoryPerGpuBytes"], t["pods"], t["share"]) for t in planner.state()["profile"]
    ] == [
        (40 * GIB, 3, 0.6),
        (20 * GIB, 2, 0.4),
    ]
    plan = planner.plan_once()
    assert plan is not None and plan.placed == 1
    assert planner.planned_node("default/p20") == "b"
