"""Planning ahead (`serve --plan-ahead`): a pod placed at once gets the planner's one-pod rule."""

from __future__ import annotations

import asyncio
import random
import time

import pytest
from builders import assigned, cluster, gpu_node, pod

from extender.assignment import encode_assignment
from extender.demand import pod_demand
from extender.embedded import EmbeddedBinder
from extender.ledger import check_invariant
from extender.planner.ahead import InlineRule
from extender.planner.background import BackgroundPlanner
from extender.planner.capacity import FragIndex, Workload, demand_kind
from extender.planner.greedy import choose, place_one
from extender.planner.model import SEQUENTIAL_RULE
from extender.service import ExtenderService
from extender.simulate.engine import build_capacity
from extender.simulate.profile import LiveProfile
from extender.wire import ExtenderArgs, ExtenderBindingArgs

NODES = ["a", "b", "c"]


def _cluster(*extra):
    """a: one 80 GiB GPU with 40 GiB used; b: 20 GiB used; c: full of 40 GiB pods."""
    running = [
        pod("r40", "40Gi", node="a", phase="Running", annotations=assigned("a", "0", 40)),
        pod("r20", "20Gi", node="b", phase="Running", annotations=assigned("b", "0", 20)),
        pod("c1", "40Gi", node="c", phase="Running", annotations=assigned("c", "0", 40)),
        pod("c2", "40Gi", node="c", phase="Running", annotations=assigned("c", "0", 40)),
    ]
    nodes = (gpu_node(n, count=1, memory_mib=80 * 1024, replicas=4) for n in NODES)
    return cluster(*nodes, *running, *extra)


def _top(svc, p, names=NODES) -> str:
    scores = {h.Host: h.Score for h in svc.prioritize(ExtenderArgs(Pod=p, NodeNames=names))}
    best = max(scores.values())
    return sorted(n for n, s in scores.items() if s == best)[0]


def _bind(svc, p, node: str) -> str:
    args = ExtenderBindingArgs(PodName=p["metadata"]["name"], PodNamespace="default", Node=node)
    return asyncio.run(svc.bind(args)).Error


def test_a_pod_placed_at_once_gets_the_choice_planned_ahead_not_best_fit():
    c = _cluster()
    planner = BackgroundPlanner(c, time_limit=1.0, num_workers=1, plan_ahead=4)
    svc = ExtenderService(c, EmbeddedBinder(c), planner=planner)
    planner.plan_ahead_once()
    assert planner.state()["aheadTypes"] == 2  # 20 and 40 GiB pods both fit somewhere
    p = pod("p20", "20Gi")
    c.upsert_pod(p)
    # best fit takes a (20 GiB left); the planner's rule keeps a's 40 GiB for the 40 GiB pods
    # most of the cluster runs, and takes b
    plain = ExtenderService(c, EmbeddedBinder(c))
    assert _top(plain, p) == "a"
    assert _top(svc, p) == "b"
    queue = next(q for q in planner.ahead.entries.values() if q[0].demand.bytes_per_gpu == 20 << 30)
    assert queue[0].node == "b"
    assert _bind(svc, p, "b") == ""
    assert c.ledger.reservation("default/p20").device_ids == queue[0].reservation.device_ids
    assert planner.state()["aheadHits"] == 1
    assert check_invariant(c.ledger) == []
    # the next 20 GiB pod gets the type's next entry, planned with p20 in place
    q = pod("q20", "20Gi")
    c.upsert_pod(q)
    assert planner.planned_node("default/q20") == queue[1].node
    # a pod that took no entry lands on that node: its entries are gone until the next round,
    # and the pod gets the rule's choice made inline, on the cluster as it is now
    node = queue[1].node
    c.upsert_pod(pod("x", "8Gi", node=node, phase="Running", annotations=assigned(node, "0", 8)))
    assert planner.ahead.lookup("default/q20") is None
    assert planner.planned_node("default/q20") == _rule_now(c, planner, q)[0]
    planner.plan_ahead_once()
    assert planner.ahead.lookup("default/q20") is not None


def _rule_now(c, planner, p):
    """The planner's one-pod rule for `p` on a fresh snapshot of `c`, weighing by the mix of the
    last round: node and GPUs."""
    from extender.planner.background import snapshot

    cap, _ = snapshot(c)
    frag = FragIndex(cap, Workload.from_counts(planner.ahead.rule.mix), count_foreign=False)
    res, row, _ = choose(SEQUENTIAL_RULE, cap, pod_demand(p), frag)
    return cap.arrays.node_names[row], res.device_ids


def test_a_pod_the_watch_has_not_delivered_yet_gets_the_planned_choice_too():
    """Live mode: kube-scheduler can ask about a pod before the extender's pod watch delivers it,
    and a filter body does not write the cluster there; prioritize plans from the request's pod,
    and bind (which reads the pod from the API) takes the planned GPUs."""
    from extender.live.source import WatchedPods

    c = _cluster()
    planner = BackgroundPlanner(c, time_limit=1.0, num_workers=1, plan_ahead=4)
    p = pod("p20", "20Gi")

    async def read_pod(namespace: str, name: str) -> dict:
        assert (namespace, name) == ("default", "p20")
        return p

    svc = ExtenderService(
        c, EmbeddedBinder(c), planner=planner, pods=WatchedPods(c, read_pod=read_pod)
    )
    planner.plan_ahead_once()
    plain = ExtenderService(c, EmbeddedBinder(c), pods=WatchedPods(c))
    assert _top(plain, p) == "a"  # best fit
    assert svc.filter(ExtenderArgs(Pod=p, NodeNames=NODES)).NodeNames == ["a", "b"]
    assert c.pod("default/p20") is None  # the body wrote nothing
    assert _top(svc, p) == "b"  # the type's entry, as for a pod the watch delivered
    queue = next(q for q in planner.ahead.entries.values() if q[0].demand.bytes_per_gpu == 20 << 30)
    assert _bind(svc, p, "b") == ""
    assert c.ledger.reservation("default/p20").device_ids == queue[0].reservation.device_ids
    assert planner.state()["aheadHits"] == 1
    # a type with no entry gets the inline rule's choice, and its GPUs at bind
    odd = pod("odd", "30Gi")
    node, gpus = _rule_now(c, planner, odd)
    assert planner.planned_node("default/odd") is None  # unknown, and no request to read
    assert _top(svc, odd) == node
    c.upsert_pod(odd)  # what bind's read of the API does
    assert _bind(svc, odd, node) == ""
    assert c.ledger.reservation("default/odd").device_ids == gpus
    # a pod the cluster holds bound is not planned from a stale request
    assert planner.planned_node("default/odd", None, pod_demand(odd)) is None
    assert check_invariant(c.ledger) == []


def test_no_entry_for_a_type_the_cluster_does_not_hold_or_without_plan_ahead():
    c = _cluster()
    planner = BackgroundPlanner(c, time_limit=1.0, num_workers=1, plan_ahead=4)
    svc = ExtenderService(c, EmbeddedBinder(c), planner=planner)
    planner.plan_ahead_once()
    odd = pod("odd", "30Gi")
    c.upsert_pod(odd)  # counted now, but after the round: no entry, the rule inline
    assert planner.ahead.lookup("default/odd") is None
    node, gpus = _rule_now(c, planner, odd)
    # kube-scheduler's own filters (selectors, taints) left out the rule's node: the choice keeps
    # to the nodes it sent
    others = [n for n in NODES if n != node]
    assert planner.planned_node("default/odd", others) in others
    assert _top(svc, odd, others) == planner.planned_node("default/odd", others)
    assert planner.planned_node("default/odd", []) is None
    assert planner.planned_node("default/odd") == node == _top(svc, odd)
    assert _bind(svc, odd, node) == ""
    assert c.ledger.reservation("default/odd").device_ids == gpus
    assert planner.state()["aheadInline"] == 5 and planner.state()["aheadHits"] == 0
    assert check_invariant(c.ledger) == []
    # and Prometheus sees the same counts
    from prometheus_client import generate_latest

    from extender.metrics import Metrics

    text = generate_latest(Metrics(lambda: c.ledger, svc.planner_state).registry).decode()
    values = dict(line.split(" ") for line in text.splitlines() if line.startswith("vramsched_"))
    assert float(values["vramsched_planner_ahead_inline_total"]) == 5.0
    assert float(values["vramsched_planner_ahead_hits_total"]) == 0.0
    assert float(values["vramsched_planner_ahead_rounds_total"]) == 1.0
    off = BackgroundPlanner(c, time_limit=1.0, num_workers=1)
    c.upsert_pod(pod("p20", "20Gi"))
    assert off.planned_node("default/p20") is None and off.state()["aheadTypes"] == 0
    assert planner.planned_node("default/p20") == "b"
    # only the most common types get an entry
    one = BackgroundPlanner(c, time_limit=1.0, num_workers=1, plan_ahead=1)
    one.plan_ahead_once()
    assert [q[0].demand.bytes_per_gpu for q in one.ahead.entries.values()] == [40 * 2**30]


def test_the_inline_choice_made_at_prioritize_is_not_booked_after_the_pod_was_edited():
    """kube-scheduler binds without prioritizing again (one feasible node skips scoring), so the
    inline rule's pick at prioritize can reach bind after the pod's model-memory was edited: it
    books what the pod asks now, never the old size."""
    c = _cluster()
    planner = BackgroundPlanner(c, time_limit=1.0, num_workers=1, plan_ahead=4)
    svc = ExtenderService(c, EmbeddedBinder(c), planner=planner)
    planner.plan_ahead_once()
    odd = pod("odd", "30Gi", uid="u1")
    c.upsert_pod(odd)
    node = _top(svc, odd)  # the inline rule's node, its GPUs kept for the bind
    assert planner.planned_node("default/odd") == node
    assert node == "a"  # 40 GiB free there
    c.upsert_pod(pod("odd", "35Gi", uid="u1"))  # a size no entry is kept for: the inline pick
    assert _bind(svc, odd, node) == ""
    assert c.ledger.reservation("default/odd").bytes_per_device == (35 << 30,)
    assert check_invariant(c.ledger) == []


def test_the_loop_plans_ahead_again_only_after_a_change():
    async def scenario():
        c = _cluster()
        planner = BackgroundPlanner(
            c, time_limit=1.0, num_workers=1, plan_ahead=2, ahead_interval=0.0
        )
        now = time.monotonic()
        await planner.step(now)
        assert planner.ahead.rounds == 1
        await planner.step(now + 100)
        assert planner.ahead.rounds == 1  # nothing changed
        c.upsert_pod(
            pod("r2", "20Gi", node="b", phase="Running", annotations=assigned("b", "0", 20))
        )
        await planner.step(now + 100.000001)
        assert planner.ahead.rounds == 2
        c.upsert_pod(
            pod("r3", "20Gi", node="b", phase="Running", annotations=assigned("b", "0", 20))
        )
        # a round takes more than a microsecond: the next waits until rounds are 25% of the time
        await planner.step(now + 100.000002)
        assert planner.ahead.rounds == 2
        await planner.step(now + 200)
        assert planner.ahead.rounds == 3
        assert planner.poll == 0.0  # woken at least that often while planning ahead

    asyncio.run(scenario())


def test_a_stream_placed_at_once_lands_where_the_planner_rule_puts_it():
    """Pods placed one at a time through filter, prioritize and bind, with a round of planning
    ahead before each (after the pod appears, as the simulator counts it), land exactly where
    the simulator's planner with the live profile puts them: node and GPUs, refusals too."""
    nodes = [
        gpu_node("ex-h100", count=2, memory_mib=81559, product="NVIDIA-H100-80GB-HBM3"),
        gpu_node("ts-a100", count=2, memory_mib=81920, replicas=4),
        gpu_node("ts-l4", count=2, memory_mib=23034, replicas=4, product="NVIDIA-L4"),
    ]
    names = [n["metadata"]["name"] for n in nodes]
    sizes = [9, 16, 40, 9, 20, 70, 16, 9, 30, 12, 60, 9, 16, 20, 40, 9, 16, 9]
    pods = [pod(f"p{i}", f"{s}Gi") for i, s in enumerate(sizes)]

    c = cluster(*nodes)
    planner = BackgroundPlanner(c, time_limit=1.0, num_workers=1, plan_ahead=8, open_cost=0.2)
    svc = ExtenderService(c, EmbeddedBinder(c), planner=planner)
    plain_c = cluster(*nodes)
    plain = ExtenderService(plain_c, EmbeddedBinder(plain_c))
    served: dict[str, tuple[str, tuple[str, ...]] | None] = {}
    best_fit: dict[str, str | None] = {}
    for p in pods:
        name = p["metadata"]["name"]
        for state, service, out in ((c, svc, served), (plain_c, plain, best_fit)):
            state.upsert_pod(p)
            if service is svc:
                planner.plan_ahead_once()
            feasible = service.filter(ExtenderArgs(Pod=p, NodeNames=names)).NodeNames or []
            if not feasible:
                out[name] = None
                continue
            node = _top(service, p, feasible)
            assert _bind(service, p, node) == ""
            res = state.ledger.reservation(f"default/{name}")
            out[name] = (node, res.device_ids) if service is svc else node
    assert planner.state()["aheadHits"] == sum(v is not None for v in served.values())

    _, cap = build_capacity(nodes)
    live = LiveProfile(drift=0.0)
    simulated: dict[str, tuple[str, tuple[str, ...]] | None] = {}
    for p in pods:
        d = pod_demand(p)
        live.arrive(d.pod.key, d)
        frag = FragIndex(cap, live.workload(), count_foreign=False, open_cost=0.2)
        ch = choose(SEQUENTIAL_RULE, cap, d, frag)
        if ch is None:
            simulated[p["metadata"]["name"]] = None
            continue
        place_one(cap, d, ch, frag)
        simulated[p["metadata"]["name"]] = (cap.arrays.node_names[ch[1]], ch[0].device_ids)
    assert served == simulated
    assert any(v is None for v in served.values())  # the cluster fills: refusals compared too
    # and it is not what best fit does
    assert {k: v[0] if v else None for k, v in served.items()} != best_fit


def test_serve_plan_ahead_reaches_the_planner_and_bad_values_stop_serve():
    from extender.cli import build_parser
    from extender.commands.serve import _planner

    c = _cluster()
    parser = build_parser()
    assert _planner(parser.parse_args(["serve", "--cluster", "x.yaml"]), c).ahead is None
    args = parser.parse_args(["serve", "--cluster", "x.yaml", "--plan-ahead", "6"])
    assert _planner(args, c).ahead.types == 6
    with pytest.raises(SystemExit) as stop:
        parser.parse_args(["serve", "--cluster", "x.yaml", "--plan-ahead", "-1"])
    assert stop.value.code == 2
    args = parser.parse_args(["serve", "--cluster", "x.yaml", "--no-planner", "--plan-ahead", "2"])
    with pytest.raises(SystemExit, match="--plan-ahead needs the planner"):
        args.run(args)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_bursts_placed_at_once_match_the_simulator_s_plan_ahead_policy(seed):
    """Replicas arrive together and kube-scheduler places them one by one faster than a round:
    a round before each burst (the pods of the burst not yet counted), then each pod takes its
    type's entry while the entry's node is unchanged, else the rule inline with the round's mix
    (the hot path before the first round with a pod to plan for). The simulator's `plan-ahead`
    policy replays exactly that."""
    from extender.simulate.engine import run_policy
    from extender.simulate.trace import Task

    nodes = [
        gpu_node("ex-h100", count=4, memory_mib=81559, product="NVIDIA-H100-80GB-HBM3"),
        gpu_node("ts-a100", count=4, memory_mib=81920, replicas=4),
        gpu_node("ts-l4", count=4, memory_mib=23034, replicas=4, product="NVIDIA-L4"),
    ]
    names = [n["metadata"]["name"] for n in nodes]
    rng = random.Random(seed)
    sizes = [9, 9, 9, 16, 16, 20, 30, 40, 70]
    bursts = [[rng.choice(sizes) for _ in range(rng.randint(1, 6))] for _ in range(14)]
    pods, tasks = [], []
    for b, burst in enumerate(bursts):
        for r, size in enumerate(burst):
            p = pod(f"b{b}-{r}", f"{size}Gi")
            pods.append((b, p))
            tasks.append(Task(pod_demand(p), arrival=float(b)))

    c = cluster(*nodes)
    planner = BackgroundPlanner(c, time_limit=1.0, num_workers=1, plan_ahead=8, open_cost=0.2)
    svc = ExtenderService(c, EmbeddedBinder(c), planner=planner)
    placed = 0
    for b in range(len(bursts)):
        planner.plan_ahead_once()
        for _, p in (x for x in pods if x[0] == b):
            c.upsert_pod(p)
            feasible = svc.filter(ExtenderArgs(Pod=p, NodeNames=names)).NodeNames or []
            if feasible:
                assert _bind(svc, p, _top(svc, p, feasible)) == ""
                placed += 1
    a = c.ledger.arrays
    allocated = int(sum(min(int(u), int(cp)) for u, cp in zip(a.used, a.capacity)))

    r = run_policy("plan-ahead", nodes, tasks, open_cost=0.2)
    assert (r.placed, r.extra["aheadPlaced"], r.allocatedMemoryBytes) == (
        placed,
        planner.state()["aheadHits"],
        allocated,
    )
    assert 0 < r.extra["aheadPlaced"] < r.placed  # some replicas took no entry
    assert planner.state()["aheadInline"] > 0
    assert r.invariantViolations == 0 and r.overcommittedGpusPeak == 0


def test_the_inline_measure_follows_the_ledger_and_is_rebuilt_only_when_it_must():
    """Between rounds the inline rule refreshes its measure for the nodes that changed; it equals
    one built afresh after binds, deletions and a node added, and is rebuilt only for a new mix
    or new arrays."""
    c = _cluster()
    planner = BackgroundPlanner(c, time_limit=1.0, num_workers=1, plan_ahead=4)
    svc = ExtenderService(c, EmbeddedBinder(c), planner=planner)
    rule = planner.ahead.rule
    assert rule.choose(pod_demand(pod("early", "8Gi"))) is None  # no round yet: the hot path
    planner.plan_ahead_once()

    def fresh():
        from extender.planner.background import snapshot

        cap, _ = snapshot(c)
        return FragIndex(cap, Workload.from_counts(rule.mix), count_foreign=False).node_frag()

    for i, size in enumerate(["30Gi", "12Gi", "30Gi", "6Gi"]):
        p = pod(f"n{i}", size)
        c.upsert_pod(p)
        node = planner.planned_node(f"default/n{i}")  # refreshed for the binds before
        assert rule._frag.node_frag().tolist() == fresh().tolist()
        assert node is not None and _bind(svc, p, node) == ""
    assert rule.builds == 1  # the round's mix throughout: refreshed, never rebuilt
    c.delete_pod("default/n1")
    assert planner.planned_node("default/n3") is None  # bound: no longer pending
    c.upsert_pod(pod("m", "10Gi"))
    planner.planned_node("default/m")
    assert rule.builds == 1 and rule._frag.node_frag().tolist() == fresh().tolist()
    c.upsert_node(gpu_node("d", count=1, memory_mib=80 * 1024, replicas=4))
    planner.planned_node("default/m")
    assert rule.builds == 2 and rule._frag.node_frag().tolist() == fresh().tolist()
    planner.plan_ahead_once()  # the mix changed since the last round: a new measure
    planner.planned_node("default/m")
    assert rule.builds == 3
    planner.plan_ahead_once()  # the same mix: the measure stays
    planner.planned_node("default/m")
    assert rule.builds == 3 and check_invariant(c.ledger) == []


def _cpu_pod(name: str, node: str, cpu: str) -> dict:
    """A running pod of another scheduler that takes only CPU on `node`."""
    return {
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "default", "uid": f"uid-{name}"},
        "spec": {
            "nodeName": node,
            "schedulerName": "default-scheduler",
            "containers": [{"name": "c", "resources": {"requests": {"cpu": cpu}}}],
        },
        "status": {"phase": "Running"},
    }


def _with_cpu(p: dict, cpu: str) -> dict:
    p["spec"]["containers"][0]["resources"]["requests"]["cpu"] = cpu
    return p


@pytest.mark.parametrize("seed", range(4))
def test_the_inline_rule_s_kept_scores_choose_what_scores_made_afresh_choose(seed):
    """The inline rule keeps its scores between pods (`FragIndex.memo`) and drops those of the
    nodes changed since: after binds, deletions, CPU taken by other pods and any subset of nodes
    sent, it chooses what a rule that scores every device afresh chooses, device for device."""
    rng = random.Random(seed)
    names = [f"n{i}" for i in range(12)]
    nodes = [
        gpu_node(
            n,
            count=rng.choice([1, 2, 4]),
            memory_mib=rng.choice([40, 80]) * 1024,
            replicas=rng.choice([1, 2, 4]),
            cpu="16",
        )
        for n in names
    ]
    c = cluster(*nodes)
    shapes = [
        ("8Gi", 1, "2"),
        ("12Gi", 1, "4"),
        ("20Gi", 1, "2"),
        ("36Gi", 2, "8"),
        ("30Gi", 1, "6"),
    ]
    mix = {}
    for i, (size, gpus, cpu) in enumerate(shapes):
        d = pod_demand(_with_cpu(pod(f"t{i}", size, gpus=gpus), cpu))
        mix[demand_kind(d)] = rng.randint(1, 9)
    kept = InlineRule(c, open_cost=0.2)
    kept.use(mix)
    placed: list[str] = []
    for step in range(80):
        size, gpus, cpu = rng.choice(shapes)
        d = pod_demand(_with_cpu(pod(f"p{step}", size, gpus=gpus), cpu))
        sent = None if rng.random() < 0.5 else rng.sample(names, rng.randint(3, len(names)))
        fresh = InlineRule(c, open_cost=0.2, memo=False)
        fresh.use(mix)
        got, want = kept.choose(d, sent), fresh.choose(d, sent)
        assert got == want, f"step {step}"
        roll = rng.random()
        if got is not None and roll < 0.6:
            res, _, _ = got
            ann = encode_assignment(res)
            p = pod(f"p{step}", size, gpus=gpus, node=res.node, phase="Running", annotations=ann)
            c.upsert_pod(_with_cpu(p, cpu))
            placed.append(f"default/p{step}")
        elif roll < 0.75 and placed:
            c.delete_pod(placed.pop(rng.randrange(len(placed))))
        elif roll < 0.9:
            c.upsert_pod(_cpu_pod(f"cpu{step}", rng.choice(names), rng.choice(["2", "6"])))
    assert kept.builds == 1 and kept._frag.memo  # one measure throughout, its scores kept
    assert check_invariant(c.ledger) == []
