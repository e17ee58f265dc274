"""Live repacking against a scripted API (tests/kube_fakes.py) and the real repack planner: which
pods may move, the move budget, the plan checked on the live ledger, evictions (dry run first,
PodDisruptionBudget refusals, a refusal part way), the Events, and the holds that keep the freed
GPUs for the blocked pod and the re-created ones, with the ledger's invariant after every step.

The clusters are two single-GPU time-sliced nodes (24Gi, 4 replicas): with one GPU per node the
device plugin's bound equals per-GPU books, so what fits is plain arithmetic in each test.
"""

from __future__ import annotations

import asyncio
import copy
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest
from builders import assigned, gpu_node, pod
from kube_fakes import FakeApi
from prometheus_client import CollectorRegistry, generate_latest

from extender.cli import build_parser
from extender.cluster import ClusterState, check_cluster
from extender.demand import PodRef, pod_demand
from extender.inventory import ReplicaPolicy
from extender.ledger import Reservation, check_invariant
from extender.live.api_client import ApiError
from extender.live.gate import live_service
from extender.live.nominating import NominatingPlanSource
from extender.live.repack import RepackCollector, Repacker
from extender.live.source import LiveSource
from extender.planner.model import SEQUENTIAL_RULE
from extender.planner.repack import plan_repack
from extender.repack_holds import HOLD_SUFFIX
from extender.repack_policy import (
    ABANDONED_REASON,
    MOVABLE,
    NOMINATED,
    REASON,
    Controller,
    MoveBudget,
    PlannedMove,
    final_state_problem,
    movable,
    nominated_outcome,
    plan_target_problem,
    replaces,
)
from extender.scheduler_profile import SchedulerProfile
from extender.target_rules import room_problem, schedulable_on
from extender.wire import ExtenderArgs, ExtenderBindingArgs

#: what the PV controller sets on a claim once it is bound
BIND_COMPLETED = "pv.kubernetes.io/bind-completed"

GIB = 1 << 30
NODES = ["a", "b"]


# ----- pods ---------------------------------------------------------------------------------------


def owned(p: dict[str, Any], kind: str, name: str, uid: str, hash_: str = "") -> dict[str, Any]:
    p["metadata"]["ownerReferences"] = [
        {"apiVersion": "apps/v1", "kind": kind, "name": name, "uid": uid, "controller": True}
    ]
    if hash_:
        p["metadata"]["labels"] = {"pod-template-hash": hash_}
    return p


def bound(
    name: str, gib: int, node: str, *, consent: bool = False, device: str = "0"
) -> dict[str, Any]:
    ann = {**assigned(node, device, gib), **({MOVABLE: "true"} if consent else {})}
    return pod(name, f"{gib}Gi", node=node, uid=name, annotations=ann, phase="Running")


def web(name: str, gib: int, node: str | None, *, consent: bool = True) -> dict[str, Any]:
    """A pod of Deployment web (ReplicaSet web-abc)."""
    if node is None:
        p = pod(name, f"{gib}Gi", uid=name, annotations={MOVABLE: "true"} if consent else {})
    else:
        p = bound(name, gib, node, consent=consent)
    return owned(p, "ReplicaSet", "web-abc", "rs-web", "abc")


def fragmented(consent: bool = True) -> list[dict[str, Any]]:
    """a: 12 fixed + 4 movable (8 free); b: 6 fixed + 4 movable (14 free). A 16Gi pod fits
    nowhere; moving b's 4Gi pod to a (then 4 free) makes b's 18Gi free: one move, the only one."""
    return [
        bound("f1", 12, "a"),
        web("m1", 4, "a", consent=consent),
        bound("f2", 6, "b"),
        web("m2", 4, "b", consent=consent),
        pod("p", "16Gi", uid="p"),
    ]


def two_moves() -> list[dict[str, Any]]:
    """a: 14 fixed (10 free); b: 4 fixed + two movable 5Gi (10 free). An 18Gi pod needs both
    movable pods of b moved to a."""
    return [
        bound("f1", 14, "a"),
        bound("f2", 4, "b"),
        web("m2", 5, "b"),
        web("m3", 5, "b"),
        pod("p", "18Gi", uid="p"),
    ]


# ----- a live cluster on the scripted API ----------------------------------------------------------


class Evictions:
    """The Eviction API: records (name, dry run); `refuse[name]` answers that status to every call
    for the pod, `refuse_real[name]` to the real (not dry-run) ones only; `before[(name, dry
    run)]` runs once before such a call is answered. The preconditions are checked against the
    pod in the API (409), as the API server does. An accepted eviction marks the pod terminating
    in the API, as a graceful deletion does."""

    def __init__(self, api: FakeApi) -> None:
        self.api = api
        self.calls: list[tuple[str, bool]] = []
        self.bodies: list[dict[str, Any]] = []
        self.refuse: dict[str, int] = {}
        self.refuse_real: dict[str, int] = {}
        self.before: dict[tuple[str, bool], Callable[[], None]] = {}

    def __call__(self, namespace: str, name: str, body: Any, dry_run: bool) -> None:
        self.calls.append((name, dry_run))
        self.bodies.append(copy.deepcopy(dict(body)))
        if (hook := self.before.pop((name, dry_run), None)) is not None:
            hook()
        stored = self.api.pods.get(f"{namespace}/{name}")
        if stored is None:
            raise ApiError(404, "NotFound", f'pods "{name}" not found')
        preconditions = (body.get("deleteOptions") or {}).get("preconditions") or {}
        for field, want in preconditions.items():
            if want != stored["metadata"].get(field):
                raise ApiError(409, "Conflict", f"the {field} in the precondition does not match")
        status = self.refuse.get(name) or (None if dry_run else self.refuse_real.get(name))
        if status:
            raise ApiError(
                status,
                "TooManyRequests",
                "Cannot evict pod as it would violate the pod's disruption budget.",
            )
        if not dry_run:
            self.api.pods[f"{namespace}/{name}"]["metadata"]["deletionTimestamp"] = "now"

    def real(self) -> list[str]:
        return [n for n, dry in self.calls if not dry]


class World:
    """Nodes a and b, the pods, a synced live service with repacking on, and a clock to move."""

    def __init__(
        self,
        pods: list[dict[str, Any]],
        *,
        per_gpu: int = 3,
        per_minute: int = 6,
        leader: Callable[[], bool | None] = lambda: True,
        open_cost: float = 0.0,
        profile: SchedulerProfile | None = None,
        nodes: list[str] = NODES,
        node_gpus: int = 1,
        repack: bool = True,
        preempt: bool = False,
    ) -> None:
        self.nodes = list(nodes)
        self.api = FakeApi()
        self.cluster = ClusterState(replica_policy=ReplicaPolicy.DISTRIBUTED)
        self.source = LiveSource(self.cluster, api=self.api)
        self.source.apply(
            "nodes",
            "replace",
            [gpu_node(n, count=node_gpus, memory_mib=24 * 1024, replicas=4) for n in self.nodes],
        )
        self.source.apply("pods", "replace", copy.deepcopy(pods))
        for p in pods:
            self.api.add_pod(p)
        self.base, self.offset = time.monotonic(), 0.0
        self.evictions = Evictions(self.api)
        self.planned = 0
        #: the keyword arguments of every plan asked for
        self.plan_kw: list[dict[str, Any]] = []
        self.repacker = Repacker(
            self.cluster,
            self.api,
            self.evictions,
            plan=self._plan,
            budget=MoveBudget(per_gpu, per_minute, clock=self.clock),
            leader=leader,
            clock=self.clock,
            after=1.0,
            retry=10.0,
            eviction_retry=0.0,
            retry_interval=0.0,
            hold_ttl=30.0,
            release_slack=10.0,
            open_cost=open_cost,
            profile=profile,
            repack=repack,
            preempt=preempt,
        )
        self.plans = NominatingPlanSource(self.repacker)
        self.service = live_service(
            self.cluster, self.source, planner=self.plans, nominations=self.plans
        ).service

    def _plan(self, *args: Any, **kw: Any) -> Any:
        self.planned += 1
        self.plan_kw.append(kw)
        return plan_repack(*args, **kw)

    def clock(self) -> float:
        """time.monotonic() moved by `offset`: the ledger's own expiry reads time.monotonic()."""
        return self.base + self.offset

    def filter(self, key: str) -> tuple[list[str], dict[str, str]]:
        out = self.service.filter(ExtenderArgs(Pod=self.cluster.pod(key), NodeNames=self.nodes))
        return list(out.NodeNames or []), dict(out.FailedAndUnresolvableNodes or {})

    async def bind(self, key: str, node: str) -> str:
        p = self.cluster.pod(key)
        assert p is not None
        meta = p["metadata"]
        args = ExtenderBindingArgs(
            PodName=meta["name"], PodNamespace="default", PodUID=meta["uid"], Node=node
        )
        result = await self.service.bind(args)
        self.watch(key)  # the watch brings the bound pod back
        return result.Error or ""

    def watch(self, key: str) -> None:
        self.source.apply("pods", "MODIFIED", copy.deepcopy(self.api.pods[key]))

    def gone(self, key: str) -> None:
        """The moved pod's kubelet finished: the pod leaves the API (and the ledger)."""
        p = self.api.pods.pop(key)
        self.source.apply("pods", "DELETED", p)

    def recreate(self, moved: str, name: str) -> str:
        """The controller's new pod for `moved`: its template, no node, no assignment."""
        p = copy.deepcopy(self.api.pods[moved])
        p["metadata"].update(name=name, uid=name)
        p["metadata"].pop("deletionTimestamp", None)
        p["metadata"]["annotations"].pop("vramsched.io/assignment", None)
        p["spec"].pop("nodeName", None)
        p["status"] = {"phase": "Pending"}
        self.api.add_pod(p)
        self.source.apply("pods", "ADDED", copy.deepcopy(p))
        return f"default/{name}"

    def held(self) -> dict[str, tuple[str, tuple[str, ...]]]:
        return {r.key: (r.node, r.device_ids) for r in self.cluster.ledger.reservations()}

    def assert_sound(self) -> None:
        """The invariant, with the plan's holds counted as the pods they stand for."""
        run = self.repacker.run
        live = self.cluster.live_pod_keys() | (run.hold_keys() if run is not None else set())
        assert check_invariant(self.cluster.ledger, live) == []

    async def events(self) -> list[dict[str, Any]]:
        await self.repacker.events.drain()
        return self.api.events

    async def step(self, advance: float = 0.0) -> None:
        self.offset += advance
        await self.repacker.step()
        self.assert_sound()


@pytest.fixture
async def world() -> Any:
    made: list[World] = []

    def make(*args: Any, **kw: Any) -> World:
        w = World(*args, **kw)
        made.append(w)
        return w

    yield make
    for w in made:
        await w.repacker.stop()


# ----- the rules -----------------------------------------------------------------------------------


def test_only_consenting_pods_whose_controller_recreates_them_are_movable() -> None:
    assert movable(web("m", 4, "a")) == Controller("ReplicaSet", "web-abc", "rs-web", "abc")
    sts = owned(bound("db-0", 4, "a", consent=True), "StatefulSet", "db", "sts-db")
    assert movable(sts) == Controller("StatefulSet", "db", "sts-db")
    refused = {
        "no consent": web("m", 4, "a", consent=False),
        "consent not exactly true": owned(
            pod("x", "4Gi", node="a", annotations={MOVABLE: "True"}), "ReplicaSet", "r", "u"
        ),
        "bare pod": bound("x", 4, "a", consent=True),
        "job": owned(bound("x", 4, "a", consent=True), "Job", "j", "u"),
        "daemonset": owned(bound("x", 4, "a", consent=True), "DaemonSet", "d", "u"),
        "pending": web("m", 4, None),
    }
    terminating = web("m", 4, "a")
    terminating["metadata"]["deletionTimestamp"] = "now"
    refused["terminating"] = terminating
    # a claim does not stop a move: where its volume reaches is checked for the target
    with_claim = copy.deepcopy(sts)
    with_claim["spec"]["volumes"] = [{"name": "d", "persistentVolumeClaim": {"claimName": "d"}}]
    assert movable(with_claim) == Controller("StatefulSet", "db", "sts-db")
    for what, p in refused.items():
        assert isinstance(movable(p), str), what


def test_a_recreated_pod_is_recognised_by_controller_and_template_or_name() -> None:
    rs = Controller("ReplicaSet", "web-abc", "rs-web", "abc")
    moved = PodRef("default", "m2", "m2")
    assert replaces(rs, moved, web("web-new", 4, None))
    other_template = owned(pod("n", "4Gi"), "ReplicaSet", "web-def", "rs-web", "def")
    assert not replaces(rs, moved, other_template)
    assert not replaces(rs, moved, owned(pod("n", "4Gi"), "ReplicaSet", "x", "rs-other", "abc"))
    sts = Controller("StatefulSet", "db", "sts-db")
    same_name = owned(pod("m2", "4Gi", uid="new"), "StatefulSet", "db", "sts-db")
    assert replaces(sts, moved, same_name)
    assert not replaces(
        sts, moved, owned(pod("m2", "4Gi", uid="m2"), "StatefulSet", "db", "sts-db")
    )
    assert not replaces(sts, moved, owned(pod("db-1", "4Gi"), "StatefulSet", "db", "sts-db"))


def test_the_budget_caps_moves_per_gpu_asked_per_pod_and_per_minute() -> None:
    budget = MoveBudget(2, 10)
    assert [budget.allowance(g) for g in (0, 1, 4)] == [2, 2, 8]  # a GPU share counts as one
    assert MoveBudget(2, 6).allowance(4) == 6  # the minute's cap still holds
    capped = MoveBudget(2, 10, per_pod=5)
    assert [capped.allowance(g) for g in (1, 2, 3)] == [2, 4, 5]
    with pytest.raises(ValueError):
        MoveBudget(2, 10, per_pod=-1)


def test_the_budget_caps_moves_per_pod_and_per_minute() -> None:
    now = [0.0]
    budget = MoveBudget(3, 5, clock=lambda: now[0])
    assert budget.allowance() == 3
    budget.spend(3)
    assert budget.allowance() == 2 and budget.next_move_in() == 0
    now[0] = 30.0
    budget.spend(2)
    assert budget.allowance() == 0
    assert budget.next_move_in() == pytest.approx(30.0)
    now[0] = 60.0  # the first three leave the window
    assert budget.recent() == 2 and budget.allowance() == 3
    assert budget.spent == 5
    with pytest.raises(ValueError):
        MoveBudget(-1, 1)


def test_a_target_must_pass_kube_schedulers_own_rules() -> None:
    node = gpu_node("a", count=1)
    p = web("m", 4, "b")
    assert schedulable_on(p, node) is None
    p["spec"]["nodeSelector"] = {"pool": "big"}
    assert "nodeSelector" in (schedulable_on(p, node) or "")
    node["metadata"]["labels"]["pool"] = "big"
    assert schedulable_on(p, node) is None
    p["spec"]["affinity"] = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["x"]}]}
                ]
            }
        }
    }
    assert "affinity" in (schedulable_on(p, node) or "")
    node["metadata"]["labels"]["zone"] = "x"
    assert schedulable_on(p, node) is None
    node["spec"] = {"taints": [{"key": "gpu", "value": "big", "effect": "NoSchedule"}]}
    assert "taint" in (schedulable_on(p, node) or "")
    p["spec"]["tolerations"] = [{"key": "gpu", "operator": "Exists"}]
    assert schedulable_on(p, node) is None
    node["spec"]["unschedulable"] = True
    assert "cordoned" in (schedulable_on(p, node) or "")


def _asking(p: dict[str, Any], requests: dict[str, str]) -> dict[str, Any]:
    """`p` with its container also asking `requests` (as requests and limits)."""
    res = p["spec"]["containers"][0]["resources"]
    res["requests"].update(requests)
    res["limits"].update(requests)
    return p


def test_a_target_must_have_room_for_what_the_plan_does_not_book() -> None:
    """The pod count and every resource other than CPU, memory and GPUs, as NodeResourcesFit
    counts them: the pods staying on the node plus the ones the plan sends there."""
    node = gpu_node("a", count=1)
    node["status"]["allocatable"].update(
        {"pods": "3", "ephemeral-storage": "10Gi", "example.com/nic": "2"}
    )
    staying = [bound("s1", 4, "a"), _asking(bound("s2", 4, "a"), {"ephemeral-storage": "6Gi"})]
    assert room_problem(node, staying, [web("m", 4, "b")]) is None
    two = [web("m", 4, "b"), web("n", 4, "b")]
    assert room_problem(node, staying, two) == "node a takes 3 pods and would hold 4"
    big = _asking(web("m", 4, "b"), {"ephemeral-storage": "5Gi"})
    assert room_problem(node, staying, [big]) == (
        f"node a has {4 * GIB} of ephemeral-storage free and the pods sent there ask {5 * GIB}"
    )
    assert (
        room_problem(node, staying, [_asking(web("m", 4, "b"), {"ephemeral-storage": "4Gi"})])
        is None
    )
    nic = _asking(web("m", 4, "b"), {"example.com/nic": "2"})
    assert room_problem(node, staying, [nic]) is None
    assert "example.com/nic" in (
        room_problem(
            node, [*staying[:1], _asking(bound("s3", 1, "a"), {"example.com/nic": "1"})], [nic]
        )
        or ""
    )
    # a resource the node does not list is one it has none of, as kube-scheduler counts it
    pages = _asking(web("m", 4, "b"), {"hugepages-2Mi": "1Gi"})
    assert "0 of hugepages-2Mi free" in (room_problem(node, staying, [pages]) or "")
    # CPU, memory and GPUs are the plan's own books: not counted again here
    heavy = _asking(web("m", 4, "b"), {"cpu": "500", "memory": "4Ti"})
    heavy["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] = "9"
    assert room_problem(node, staying, [heavy]) is None
    # a node with no allocatable at all (a hand-written cluster file) is checked for ports only
    bare = {"metadata": {"name": "a"}, "status": {}}
    assert room_problem(bare, staying, two) is None


def _binding(
    p: dict[str, Any], port: int, *, sidecar: bool = False, **extra: Any
) -> dict[str, Any]:
    """`p` binding host port `port` (in a sidecar when asked)."""
    spec = p["spec"]
    ports = [{"containerPort": port, "hostPort": port, **extra}]
    if sidecar:
        spec["initContainers"] = [{"name": "s", "restartPolicy": "Always", "ports": ports}]
    else:
        spec["containers"][0]["ports"] = ports
    return p


def test_a_target_must_have_the_host_ports_the_pods_sent_there_bind() -> None:
    node = gpu_node("a", count=1)
    staying = [_binding(bound("s1", 4, "a"), 8000, hostIP="10.0.0.1")]
    # every address conflicts with one, and one with every address; other IPs and UDP do not
    assert room_problem(node, staying, [_binding(web("m", 4, "b"), 8000)]) == (
        "node a has host port TCP 0.0.0.0:8000 taken"
    )
    assert (
        room_problem(node, staying, [_binding(web("m", 4, "b"), 8000, hostIP="10.0.0.2")]) is None
    )
    assert room_problem(node, staying, [_binding(web("m", 4, "b"), 8000, protocol="UDP")]) is None
    # a sidecar binds its port for the pod's life; a plain init container's ends before
    side = [_binding(bound("s2", 4, "a"), 9000, sidecar=True)]
    assert "9000 taken" in (room_problem(node, side, [_binding(web("m", 4, "b"), 9000)]) or "")
    side[0]["spec"]["initContainers"][0].pop("restartPolicy")
    assert room_problem(node, side, [_binding(web("m", 4, "b"), 9000)]) is None
    # two pods sent to one node may not bind the same port either
    two = [_binding(web("m", 4, "b"), 7000), _binding(web("n", 4, "b"), 7000)]
    assert room_problem(node, [], two) == "node a has host port TCP 0.0.0.0:7000 taken"


def test_a_plans_room_counts_the_pods_that_leave_and_blames_the_last_moved_pod() -> None:
    nodes = {n: gpu_node(n, count=1) for n in NODES}
    nodes["a"]["status"]["allocatable"]["pods"] = "2"
    pods = {
        f"default/{p['metadata']['name']}": p
        for p in (bound("f1", 4, "a"), web("m1", 4, "a"), web("m2", 4, "b"), web("m3", 4, "b"))
    }
    finished = bound("done", 4, "a")
    finished["status"]["phase"] = "Succeeded"  # kube-scheduler no longer counts it
    pods["default/done"] = finished
    blocked = pod("p", "16Gi", uid="p")
    demand = pod_demand(blocked)

    def move(name: str, source: str, target: str) -> PlannedMove:
        d = pod_demand(pods[f"default/{name}"])
        held = Reservation(d.pod, source, ("0",), (4 * GIB,))
        return PlannedMove(
            d.pod, d, held, replace(held, node=target), Controller("ReplicaSet", "x", "rs-x")
        )

    on_b = Reservation(demand.pod, "b", ("0",), (16 * GIB,))
    # m2 to a: a would hold f1, m1 and m2
    assert plan_target_problem(nodes, pods, blocked, on_b, [move("m2", "b", "a")]) == (
        "node a takes 2 pods and would hold 3",
        "default/m2",
    )
    # m1 leaves a as m2 arrives: still two
    swap = [move("m1", "a", "b"), move("m2", "b", "a")]
    assert plan_target_problem(nodes, pods, blocked, on_b, swap) is None
    # the blocked pod alone is too many for a: nobody to leave out
    on_a = Reservation(demand.pod, "a", ("0",), (16 * GIB,))
    assert plan_target_problem(nodes, pods, blocked, on_a, []) == (
        "node a takes 2 pods and would hold 3",
        None,
    )


@pytest.mark.parametrize(
    ("label", "op", "value", "holds"),
    [
        ("10", "Gt", "5", True),
        ("+10", "Gt", "5", True),
        ("-3", "Lt", "-2", True),
        ("10", "Lt", "5", False),
        ("1_0", "Gt", "5", False),  # int() read 10; Go's ParseInt refuses it
        ("\u0661\u0660", "Gt", "5", False),  # Arabic-Indic 10
        ("10", "Gt", "0x1", False),
        (str(1 << 63), "Gt", "5", False),  # beyond int64: a parse error in Go
        ("10", "Gt", "", False),
    ],
)
def test_gt_and_lt_read_integers_as_kube_scheduler_does(
    label: str, op: str, value: str, holds: bool
) -> None:
    node = gpu_node("a", count=1)
    node["metadata"]["labels"]["gen"] = label
    p = web("m", 4, "b")
    expr = {"key": "gen", "operator": op, "values": [value]}
    p["spec"]["affinity"] = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [{"matchExpressions": [expr]}]
            }
        }
    }
    assert (schedulable_on(p, node) is None) is holds


@pytest.mark.parametrize(
    ("terms", "holds"),
    [
        # An empty term selects no node (kube-scheduler drops it); it matched every node here,
        # so a move could re-create a pod on a node outside the other term's zone.
        ([{}, {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["y"]}]}], False),
        ([{"matchExpressions": []}], False),
        # matchFields on the node's name, as DaemonSet-style pods pin a node: it was never met.
        ([{"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["a"]}]}], True),
        ([{"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["b"]}]}], False),
        ([{"matchFields": [{"key": "metadata.name", "operator": "NotIn", "values": ["b"]}]}], True),
        (
            [{"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["a", "b"]}]}],
            False,
        ),
        (
            [
                {
                    "matchExpressions": [{"key": "zone", "operator": "In", "values": ["x"]}],
                    "matchFields": [{"key": "metadata.name", "operator": "NotIn", "values": ["a"]}],
                }
            ],
            False,
        ),
    ],
)
def test_node_selector_terms_match_as_kube_scheduler_matches_them(
    terms: list[dict[str, Any]], holds: bool
) -> None:
    node = gpu_node("a", count=1)
    node["metadata"]["labels"]["zone"] = "x"
    p = web("m", 4, "b")
    p["spec"]["affinity"] = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": terms}
        }
    }
    assert (schedulable_on(p, node) is None) is holds


def test_a_plan_is_checked_against_the_device_plugins_bound() -> None:
    """Per-GPU books would put the 16Gi pod on GPU 1 beside GPU 0's 12+8; the stock plugin
    (distributed) may stack any two of three pods on one GPU: 16+12 > 24."""
    c = ClusterState(replica_policy=ReplicaPolicy.DISTRIBUTED)
    c.load(
        [
            gpu_node("n", count=2, memory_mib=24 * 1024, replicas=4),
            bound("x", 12, "n"),
            pod("y", "8Gi", node="n", uid="y", annotations=assigned("n", "0", 8)),
            pod("p", "16Gi", uid="p"),
        ]
    )
    demand = pod_demand(c.pod("default/p") or {})
    on_gpu1 = Reservation(demand.pod, "n", ("1",), (16 * GIB,))
    assert "device plugin" in (final_state_problem(c.ledger, demand, on_gpu1, []) or "")
    exact = ClusterState()
    exact.load(list(c.nodes.values()) + list(c.pods.values()))
    assert final_state_problem(exact.ledger, demand, on_gpu1, []) is None


def test_a_nominated_pod_is_offered_its_node_only_once_the_room_is_there() -> None:
    c = ClusterState(replica_policy=ReplicaPolicy.DISTRIBUTED)
    c.load([gpu_node(n, count=1, memory_mib=24 * 1024, replicas=4) for n in NODES])
    c.load(fragmented())
    demand = pod_demand(c.pod("default/p") or {})
    placement = Reservation(demand.pod, "b", ("0",), (16 * GIB,))
    waiting = nominated_outcome(c.ledger, demand, NODES, placement)
    assert waiting.feasible == [] and "waiting" in waiting.unresolvable["b"]
    assert "held for this pod on b" in waiting.unresolvable["a"]
    c.delete_pod("default/m2")
    ready = nominated_outcome(c.ledger, demand, NODES, placement)
    assert ready.feasible == ["b"] and list(ready.unresolvable) == ["a"]


# ----- the live loop ---------------------------------------------------------------------------------


async def test_repack_evicts_holds_the_freed_gpus_and_places_everyone_as_planned(
    world: Any,
) -> None:
    w = world(fragmented())
    assert w.filter("default/p")[0] == []  # filter found no node: the repacker hears of it
    await w.step()
    assert w.evictions.calls == []  # not before it waited `after` seconds
    await w.step(advance=1.5)
    # dry run, then the eviction, of the one pod the plan moves
    assert w.evictions.calls == [("m2", True), ("m2", False)]
    body = w.evictions.bodies[-1]
    assert body["kind"] == "Eviction" and body["deleteOptions"] == {"preconditions": {"uid": "m2"}}
    run = w.repacker.run
    assert run is not None and run.phase == "releasing"
    # a's free room was held for m2's new pod before anything else could take it
    assert w.held()[f"default/m2{HOLD_SUFFIX}"] == ("a", ("0",))
    # m2 is terminating and still holds b: the blocked pod waits, nowhere else
    assert w.filter("default/p") == (
        [],
        {
            "a": "vramsched repack: GPUs are held for this pod on b",
            "b": "vramsched repack: waiting for GPUs being freed on b",
        },
    )
    new = w.recreate("default/m2", "web-new")
    assert w.filter(new)[0] == ["a"]  # the hold moved to the new pod's key
    assert w.held()[new] == ("a", ("0",)) and f"default/m2{HOLD_SUFFIX}" not in w.held()
    assert await w.bind(new, "a") == ""
    w.assert_sound()
    w.gone("default/m2")
    w.assert_sound()
    # the freed GPU is the blocked pod's at once: another 16Gi pod cannot take it
    w.source.apply("pods", "ADDED", pod("other", "16Gi", uid="other"))
    assert w.filter("default/other")[0] == []
    assert w.held()["default/p"] == ("b", ("0",))
    await w.step()  # the loop annotates the pod: kube-scheduler retries it at once
    assert w.api.pods["default/p"]["metadata"]["annotations"][NOMINATED] == "b"
    assert w.filter("default/p")[0] == ["b"]
    assert await w.bind("default/p", "b") == ""
    await w.step()
    assert w.repacker.run is None
    last = w.repacker.last
    assert last is not None and last["phase"] == "done"
    assert last["outcome"] == "blocked pod placed; 1 of 1 re-created pods placed as planned"
    assert check_cluster(w.cluster) == []
    assert w.repacker.stats.moves == 1 and w.repacker.budget.spent == 1
    events = await w.events()
    repack = [e for e in events if e["reason"] == REASON]
    on_m2 = [e for e in repack if e["involvedObject"]["name"] == "m2"]
    assert len(on_m2) == 1 and on_m2[0]["involvedObject"]["uid"] == "m2"
    assert "to make room for pod default/p" in on_m2[0]["message"]
    assert "holds device 0 of a for the new one" in on_m2[0]["message"]
    assert [e["involvedObject"]["name"] for e in repack] == ["m2", "p"]
    assert "holds device 0 of b for it" in repack[1]["message"]


async def test_moved_pods_land_by_the_planners_measure_over_the_clusters_pods(
    world: Any,
) -> None:
    # as the simulator's planner+repack: the planner's one-pod rule on FGD's measure, weighed
    # by every pod of ours the cluster holds (the planner's mix), with --open-gpu-cost
    w = world(fragmented(), open_cost=0.25)
    assert w.filter("default/p")[0] == []
    await w.step(advance=1.5)
    assert w.evictions.real() == ["m2"]
    kw = w.plan_kw[-1]
    assert kw["place_rule"] == SEQUENTIAL_RULE
    frag = kw["frag"]
    assert frag.open_cost == 0.25
    # four running pods of 12, 4, 6 and 4 GiB and the blocked 16 GiB one: 4 kinds, 5 pods
    by_bytes = dict(zip(frag.w.need.tolist(), frag.w.count.tolist(), strict=True))
    assert by_bytes == {12 * GIB: 1, 4 * GIB: 2, 6 * GIB: 1, 16 * GIB: 1}
    assert w.cluster.demand_mix.total() == 5


async def test_a_pod_disruption_budget_refusing_the_dry_run_evicts_nothing(world: Any) -> None:
    w = world(fragmented())
    w.evictions.refuse["m2"] = 429
    w.filter("default/p")
    await w.step(advance=1.5)
    assert w.evictions.real() == [] and w.repacker.run is None
    # planned again without m2: no other plan exists
    assert w.planned == 2 and w.repacker.stats.refused == 1
    events = await w.events()
    assert len(events) == 1 and events[0]["involvedObject"]["name"] == "p"
    assert "PodDisruptionBudget allows no disruption now" in events[0]["message"]
    assert w.held() == {k: v for k, v in w.held().items() if HOLD_SUFFIX not in k}
    await w.step(advance=11)  # tried again after `retry`; the same reason is not repeated
    assert w.planned == 4 and len(await w.events()) == 1
    del w.evictions.refuse["m2"]  # the budget allows it now
    await w.step(advance=11)
    assert w.evictions.real() == ["m2"]


async def test_an_eviction_refused_part_way_abandons_the_plan_and_says_so(world: Any) -> None:
    w = world(two_moves())
    w.evictions.refuse_real["m3"] = 429  # the dry runs pass, the second eviction does not
    w.filter("default/p")
    await w.step(advance=1.5)
    assert w.evictions.real() == ["m2", "m3"]  # m3's refusal is final: eviction_retry is 0 here
    assert w.repacker.run is None and w.repacker.stats.abandoned == 1
    assert not [k for k in w.held() if HOLD_SUFFIX in k]  # the targets' holds are released
    events = await w.events()
    warning = [e for e in events if e["reason"] == ABANDONED_REASON]
    assert len(warning) == 1 and warning[0]["type"] == "Warning"
    assert warning[0]["involvedObject"]["name"] == "p"
    assert "abandoned after evicting 1 of 2 pod(s) (default/m2)" in warning[0]["message"]
    assert "still does not fit" in warning[0]["message"]
    # the evicted pod's controller re-creates it; it is placed as usual, anywhere it fits
    new = w.recreate("default/m2", "web-new")
    w.gone("default/m2")
    assert sorted(w.filter(new)[0]) == ["a", "b"]
    assert check_cluster(w.cluster) == []


def versioned(pods: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The pods as the API server hands them out: with a resourceVersion."""
    for p in pods:
        p["metadata"]["resourceVersion"] = "1"
    return pods


async def test_a_pod_whose_consent_is_withdrawn_after_the_dry_run_is_not_evicted(
    world: Any,
) -> None:
    """Its owner removes `movable` while the plan runs, after the dry runs passed: the plan is
    abandoned before that pod's eviction, whether the watch delivered the edit (m3 is read
    again before its eviction) or not yet (its Eviction names the version read, the API
    refuses it, and the pod read from the API no longer consents)."""
    for delivered in (True, False):
        w = world(versioned(two_moves()))

        def withdraw(w: Any = w, delivered: bool = delivered) -> None:
            del w.api.pods["default/m3"]["metadata"]["annotations"][MOVABLE]
            w.api.pods["default/m3"]["metadata"]["resourceVersion"] = "2"
            if delivered:
                w.watch("default/m3")

        w.evictions.before[("m2", False)] = withdraw
        w.filter("default/p")
        await w.step(advance=1.5)
        assert w.evictions.real() == ["m2"] if delivered else ["m2", "m3"]
        assert w.api.pods["default/m3"]["metadata"].get("deletionTimestamp") is None
        assert w.repacker.run is None and w.repacker.stats.abandoned == 1
        assert not [k for k in w.held() if HOLD_SUFFIX in k]
        warning = [e for e in await w.events() if e["reason"] == ABANDONED_REASON]
        assert len(warning) == 1
        assert "pod default/m3 may no longer move: not annotated" in warning[0]["message"]


async def test_a_moved_pod_updated_after_its_watch_copy_is_still_evicted(world: Any) -> None:
    """A status update the watch has not delivered yet: the Eviction's version is refused, the
    pod read from the API still consents, and it is evicted at that version."""
    w = world(versioned(two_moves()))

    def relabel() -> None:
        w.api.edit_pod("default", "m3", {"note": "status written"})

    w.evictions.before[("m2", False)] = relabel
    w.filter("default/p")
    await w.step(advance=1.5)
    assert w.evictions.real() == ["m2", "m3", "m3"]
    assert w.evictions.bodies[-1]["deleteOptions"] == {
        "preconditions": {"uid": "m3", "resourceVersion": "2"}
    }
    assert w.api.pods["default/m3"]["metadata"]["deletionTimestamp"] == "now"
    assert w.repacker.run is not None and w.repacker.run.phase == "releasing"


async def test_a_moved_pod_already_terminating_does_not_stop_the_plan(world: Any) -> None:
    """Its user deleted m3 while m2 was evicted: it is leaving anyway, so the plan goes on."""
    w = world(versioned(two_moves()))

    def deleted() -> None:
        w.api.edit_pod("default", "m3", {})
        w.api.pods["default/m3"]["metadata"]["deletionTimestamp"] = "by its user"
        w.watch("default/m3")

    w.evictions.before[("m2", False)] = deleted
    w.filter("default/p")
    await w.step(advance=1.5)
    assert w.evictions.real() == ["m2", "m3"]
    assert w.repacker.stats.abandoned == 0
    assert w.repacker.run is not None and w.repacker.run.phase == "releasing"


async def test_pods_without_consent_are_never_evicted(world: Any) -> None:
    w = world(fragmented(consent=False))
    w.filter("default/p")
    await w.step(advance=1.5)
    assert w.evictions.calls == [] and w.repacker.stats.none == 1
    (event,) = await w.events()
    assert event["message"].startswith("no repack now: no plan within 3 move(s)")


async def test_no_pod_is_evicted_for_a_target_without_a_pod_slot(world: Any) -> None:
    """The only plan moves m2 to a, which takes 2 pods and holds f1 and m1: kube-scheduler would
    keep m2's new pod off a, so nothing is evicted until a takes a third pod."""
    w = world(fragmented())
    full = gpu_node("a", count=1, memory_mib=24 * 1024, replicas=4)
    full["status"]["allocatable"]["pods"] = "2"
    w.source.apply("nodes", "MODIFIED", copy.deepcopy(full))
    w.filter("default/p")
    await w.step(advance=1.5)
    assert w.evictions.calls == [] and w.repacker.run is None
    # planned again without m2: no other plan exists
    assert w.planned == 2 and w.repacker.stats.refused == 1
    (event,) = await w.events()
    assert (
        "pod default/m2 may not move there: node a takes 2 pods and would hold 3"
        in (event["message"])
    )
    full["status"]["allocatable"]["pods"] = "3"
    full["metadata"]["resourceVersion"] = "2"
    w.source.apply("nodes", "MODIFIED", copy.deepcopy(full))
    await w.step(advance=11)
    assert w.evictions.real() == ["m2"]


def label_pools(w: World) -> None:
    """Label each node `pool=<its name>`, for pods kept to one node by a nodeSelector."""
    for name in NODES:
        labelled = gpu_node(name, count=1, memory_mib=24 * 1024, replicas=4)
        labelled["metadata"]["labels"]["pool"] = name
        labelled["metadata"]["resourceVersion"] = "2"
        w.source.apply("nodes", "MODIFIED", labelled)


def room_on_either_node() -> list[dict[str, Any]]:
    """a: 4 fixed + two movable 6Gi (8 free); b: 10 fixed + a movable 4Gi (10 free). Room for a
    14Gi pod is made on either node by one move: a 6Gi pod off a, or the 4Gi one off b."""
    return [
        bound("f1", 4, "a"),
        web("m1", 6, "a"),
        web("ma", 6, "a"),
        bound("f2", 10, "b"),
        web("m2", 4, "b"),
    ]


@pytest.mark.parametrize("pool", ["a", "b"])
async def test_the_blocked_pod_is_planned_only_onto_the_nodes_it_may_use(
    world: Any, pool: str
) -> None:
    """Room for the 14Gi pod can be made on either node with one move (a 6Gi pod off a, or the
    4Gi one off b). Kept to one node by its nodeSelector, the plan makes room there, whichever
    the planner would choose unasked."""
    p = pod("p", "14Gi", uid="p")
    p["spec"]["nodeSelector"] = {"pool": pool}
    w = world([*room_on_either_node(), p])
    label_pools(w)
    w.filter("default/p")
    await w.step(advance=1.5)
    evicted = w.evictions.real()
    assert len(evicted) == 1 and evicted[0] in ({"a": ("m1", "ma"), "b": ("m2",)}[pool])
    assert w.plan_kw[-1]["pod_nodes"].tolist() == [n == pool for n in NODES]


@pytest.mark.parametrize(("kept", "moved"), [("m2", "m3"), ("m3", "m2")])
async def test_moved_pods_are_planned_only_onto_the_nodes_they_may_use(
    world: Any, kept: str, moved: str
) -> None:
    """Either of b's two movable pods leaving makes room for the 14Gi pod there, each by one
    move to a. The one kept to b by its nodeSelector is never planned onto a: the one plan made
    moves the other."""
    pods = [bound("f1", 12, "a"), bound("f2", 6, "b"), web("m2", 4, "b"), web("m3", 2, "b")]
    pods.append(pod("p", "14Gi", uid="p"))
    for p in pods:
        if p["metadata"]["name"] == kept:
            p["spec"]["nodeSelector"] = {"pool": "b"}
    w = world(pods)
    label_pools(w)
    w.filter("default/p")
    await w.step(advance=1.5)
    assert w.evictions.real() == [moved] and w.planned == 1


#: a scheduler profile that spreads every pod by zone, as `--scheduler-config` reads it
ZONE_SPREAD = SchedulerProfile(
    default_spread=({"maxSkew": 1, "topologyKey": "zone", "whenUnsatisfiable": "DoNotSchedule"},)
)
WEB_RS = {
    "metadata": {"name": "web-abc", "namespace": "default"},
    "spec": {"selector": {"matchLabels": {"pod-template-hash": "abc"}}},
}


def zones(w: World) -> None:
    """Node a in zone z1, b in z2."""
    for name, zone in zip(NODES, ("z1", "z2"), strict=True):
        labelled = gpu_node(name, count=1, memory_mib=24 * 1024, replicas=4)
        labelled["metadata"]["labels"]["zone"] = zone
        labelled["metadata"]["resourceVersion"] = "2"
        w.source.apply("nodes", "MODIFIED", labelled)


async def test_a_move_keeps_the_profiles_default_spread(world: Any) -> None:
    """The only plan moves m2 next to m1, both of ReplicaSet web-abc: the profile's default
    spread (by the ReplicaSet's selector) keeps m2's new copy off zone z1, so nothing moves. Had
    the ReplicaSet not been found, kube-scheduler would give m2 no default constraint."""
    w = world(fragmented(), profile=ZONE_SPREAD)
    zones(w)
    w.api.namespaced = {"services": [], "replicasets": [WEB_RS]}
    w.filter("default/p")
    await w.step(advance=1.5)
    assert w.evictions.calls == [] and w.repacker.stats.refused == 1
    (event,) = await w.events()
    assert (
        "pod default/m2 may not move there: node a: its zone z1 would hold 2 more matching pods "
        "than the emptiest domain, over its maxSkew 1" in event["message"]
    )
    assert ("list_in", "replicasets", "default") in w.api.calls

    found = world(fragmented(), profile=ZONE_SPREAD)
    zones(found)
    found.api.namespaced = {"services": [], "replicasets": []}
    found.filter("default/p")
    await found.step(advance=1.5)
    assert found.evictions.real() == ["m2"]


async def test_the_default_spread_selectors_are_read_once_per_attempt(world: Any) -> None:
    """Each pod the dry run or the check refuses makes the attempt plan again, moving another pod
    of the same ReplicaSet: the Services and ReplicaSets are listed once for all three plans."""
    w = world([*room_on_either_node(), pod("p", "14Gi", uid="p")], profile=ZONE_SPREAD)
    zones(w)
    w.api.namespaced = {"services": [], "replicasets": [WEB_RS]}
    for name in ("m1", "ma", "m2"):
        w.evictions.refuse[name] = 429
    w.filter("default/p")
    await w.step(advance=1.5)
    assert w.evictions.real() == [] and w.planned == 3
    assert {name for name, _ in w.evictions.calls} == {"m1", "ma"}  # m2's plan: the spread
    lists = [c for c in w.api.calls if c[0] == "list_in"]
    assert sorted(lists) == [
        ("list_in", "replicasets", "default"),
        ("list_in", "services", "default"),
    ]
    await w.step(advance=11)  # the next attempt reads them afresh
    assert len([c for c in w.api.calls if c[0] == "list_in"]) == 4


async def test_unread_default_spread_selectors_move_nothing(world: Any) -> None:
    """Without the Services the profile's default spread selects by, no plan runs; without a
    profile that has one, they are not read at all."""
    w = world(fragmented(), profile=ZONE_SPREAD)
    zones(w)
    w.api.namespaced = {"replicasets": [WEB_RS]}  # Services: forbidden
    w.filter("default/p")
    await w.step(advance=1.5)
    assert w.evictions.calls == []
    (event,) = await w.events()
    assert event["message"] == (
        "no repack now: the services of namespace default that its default topology spread "
        "selects by could not be read (Forbidden)"
    )
    plain = world(fragmented())
    zones(plain)
    plain.filter("default/p")
    await plain.step(advance=1.5)
    assert plain.evictions.real() == ["m2"]
    assert not [c for c in plain.api.calls if c[0] == "list_in"]


def with_claim(w: World, p: dict[str, Any], pool: str) -> None:
    """Mount a claim on `p`, bound to a volume that only nodes labelled `pool=<pool>` reach. A
    running pod's change reaches the API and the watch; a new pod is the caller's to add."""
    claim = f"data-{p['metadata']['name']}"
    p["spec"]["volumes"] = [{"name": "data", "persistentVolumeClaim": {"claimName": claim}}]
    w.api.claims[f"default/{claim}"] = {
        "metadata": {"name": claim, "namespace": "default", "annotations": {BIND_COMPLETED: "yes"}},
        "spec": {"volumeName": f"pv-{claim}"},
    }
    term = {"matchExpressions": [{"key": "pool", "operator": "In", "values": [pool]}]}
    w.api.volumes[f"pv-{claim}"] = {
        "metadata": {"name": f"pv-{claim}"},
        "spec": {"nodeAffinity": {"required": {"nodeSelectorTerms": [term]}}},
    }
    if p["spec"].get("nodeName"):
        p["metadata"]["resourceVersion"] = "2"
        w.api.add_pod(p)
        w.source.apply("pods", "MODIFIED", copy.deepcopy(p))


@pytest.mark.parametrize(("kept", "moved"), [("m2", "m3"), ("m3", "m2")])
async def test_moved_pods_are_planned_only_where_their_volumes_reach(
    world: Any, kept: str, moved: str
) -> None:
    """As above, with the pod kept to b by its claim's volume (a local volume on b) instead of
    a nodeSelector: the claim and volume are read, and the one plan moves the other pod."""
    pods = [bound("f1", 12, "a"), bound("f2", 6, "b"), web("m2", 4, "b"), web("m3", 2, "b")]
    pods.append(pod("p", "14Gi", uid="p"))
    w = world(pods)
    label_pools(w)
    for p in pods:
        if p["metadata"]["name"] == kept:
            with_claim(w, p, "b")
    w.filter("default/p")
    await w.step(advance=1.5)
    assert w.evictions.real() == [moved] and w.planned == 1
    reads = [c for c in w.api.calls if c[0] in ("read_claim", "read_volume")]
    assert reads == [("read_claim", "default", f"data-{kept}"), ("read_volume", f"pv-data-{kept}")]


async def test_no_plan_names_the_movable_pods_their_rules_keep_in_place(world: Any) -> None:
    """The only move takes m2 off b, and its volume is on b alone: no plan, and the waiting pod
    is told which movable pod may go nowhere else (m1, free to move, is not named)."""
    pods = fragmented()
    w = world(pods)
    label_pools(w)
    m2 = next(p for p in pods if p["metadata"]["name"] == "m2")
    with_claim(w, m2, "b")
    w.filter("default/p")
    await w.step(advance=1.5)
    assert w.evictions.calls == [] and w.repacker.stats.none == 1
    (told,) = [e["message"] for e in await w.events()]
    assert told == (
        "no repack now: no plan within 3 move(s) of movable pods; 1 movable pod(s) may go to no "
        "other node by their node rules or volumes: default/m2"
    )


async def test_a_pod_whose_claim_cannot_be_read_is_not_moved(world: Any) -> None:
    """The only move takes m2 off b. Its claim's read is refused (no RBAC for it, say):
    vramsched cannot tell where the volume reaches, so nothing is evicted and the pod is told."""
    pods = fragmented()
    w = world(pods)
    m2 = next(p for p in pods if p["metadata"]["name"] == "m2")
    with_claim(w, m2, "a")  # a reaches it, but the read fails
    w.api.fail["read_claim"] = [ApiError(403, "Forbidden", "cannot get persistentvolumeclaims")]
    w.filter("default/p")
    await w.step(advance=1.5)
    assert w.evictions.calls == [] and w.repacker.stats.refused == 1
    (told,) = [e["message"] for e in await w.events()]
    assert told == (
        "no repack now: no plan within 3 move(s) of movable pods (left out: default/m2: "
        "its claim default/data-m2 could not be read (403 Forbidden))"
    )


#: the CSI driver of the attach-limit tests' disks
DISK = "disk.csi.example.com"


def with_disk(w: World, p: dict[str, Any]) -> None:
    """As `with_claim`, with a CSI disk that reaches every node: only attach limits bound it."""
    with_claim(w, p, "any")
    claim = p["spec"]["volumes"][0]["persistentVolumeClaim"]["claimName"]
    w.api.volumes[f"pv-{claim}"]["spec"] = {"csi": {"driver": DISK, "volumeHandle": claim}}


def attach_lists(w: World, limit: int) -> None:
    """Node a takes `limit` disks, b any number; no VolumeAttachments, no StorageClasses. Each
    list answers every attempt (a plan refused is made again)."""
    nodes = [
        {"metadata": {"name": n}, "spec": {"drivers": [{"name": DISK, "nodeID": n, **count}]}}
        for n, count in (("a", {"allocatable": {"count": limit}}), ("b", {}))
    ]
    for kind, found in (("csinodes", nodes), ("volumeattachments", []), ("storageclasses", [])):
        w.api.lists[kind] = [(found, "1")] * 4


@pytest.mark.parametrize("limit", [1, 2])
async def test_a_move_keeps_to_the_targets_attach_limit(world: Any, limit: int) -> None:
    """The only move takes m2 and its disk to a, where f1 holds a disk of the same driver. With
    room for two, m2 moves; with room for one, kube-scheduler would keep its new copy off a, so
    nothing is evicted and the waiting pod is told why."""
    pods = fragmented()
    w = world(pods)
    for p in pods:
        if p["metadata"]["name"] in ("f1", "m2"):
            with_disk(w, p)
    attach_lists(w, limit)
    w.filter("default/p")
    await w.step(advance=1.5)
    reads = [c[1:] for c in w.api.calls if c[0] in ("read_claim", "list") and c[1] != "pods"]
    assert ("default", "data-f1") in reads and ("csinodes",) in reads
    if limit == 2:
        assert w.evictions.real() == ["m2"]
        return
    assert w.evictions.calls == [] and w.repacker.stats.refused == 1
    (told,) = [e["message"] for e in await w.events()]
    assert told == (
        "no repack now: no plan within 3 move(s) of movable pods (left out: default/m2: "
        f"pod default/m2 may not move there: node a attaches at most 1 volume(s) of {DISK} and would hold 2)"
    )


EBS = "ebs.csi.aws.com"
MIGRATED = "storage.alpha.kubernetes.io/migrated-plugins"


def with_ebs_claim(w: World, p: dict[str, Any], volume_id: str, **labels: str) -> None:
    """As `with_claim`, bound to an in-tree EBS volume (with `labels`) that reaches every node."""
    with_claim(w, p, "any")
    claim = p["spec"]["volumes"][0]["persistentVolumeClaim"]["claimName"]
    pv = w.api.volumes[f"pv-{claim}"]
    pv["metadata"]["labels"] = labels
    pv["spec"] = {"awsElasticBlockStore": {"volumeID": volume_id}}


@pytest.mark.parametrize("limit", [1, 2])
async def test_in_tree_disks_count_against_their_csi_drivers_limit(world: Any, limit: int) -> None:
    """The same move with in-tree disks, as clusters older than CSI migration hold them: m2's
    claim is bound to an `awsElasticBlockStore` volume and f1 mounts an EBS disk inline. Both
    count against a's limit for `ebs.csi.aws.com`, the driver EBS migrated to."""
    pods = fragmented()
    w = world(pods)
    for p in pods:
        if p["metadata"]["name"] == "m2":
            with_ebs_claim(w, p, "aws://us-east-1a/vol-m2")
        if p["metadata"]["name"] == "f1":
            p["spec"]["volumes"] = [{"name": "d", "awsElasticBlockStore": {"volumeID": "vol-f1"}}]
            w.api.add_pod(p)
            p["metadata"]["resourceVersion"] = "2"
            w.source.apply("pods", "MODIFIED", copy.deepcopy(p))
    attach_lists(w, limit)
    for found, _ in w.api.lists["csinodes"]:
        for node in found:
            node["spec"]["drivers"][0]["name"] = EBS
    w.filter("default/p")
    await w.step(advance=1.5)
    if limit == 2:
        assert w.evictions.real() == ["m2"]
        return
    assert w.evictions.calls == [] and w.repacker.stats.refused == 1
    (told,) = [e["message"] for e in await w.events()]
    assert told.endswith(f"node a attaches at most 1 volume(s) of {EBS} and would hold 2)"), told


@pytest.mark.parametrize("driver_label", [True, False])
async def test_a_migrated_in_tree_volume_moves_only_where_its_drivers_zone_is(
    world: Any, driver_label: bool
) -> None:
    """m2's claim is bound to an in-tree EBS volume in zone z1, and a's CSINode lists the EBS
    plugin as migrated: kube-scheduler then wants a in z1 by the EBS driver's zone label, not
    only by `topology.kubernetes.io/zone`. Without that label m2 may stay only where it is, and
    no plan is made."""
    pods = fragmented()
    w = world(pods)
    for p in pods:
        if p["metadata"]["name"] == "m2":
            with_ebs_claim(w, p, "vol-m2", **{"topology.kubernetes.io/zone": "z1"})
    attach_lists(w, 2)
    for found, _ in w.api.lists["csinodes"]:
        for node in found:
            node["metadata"]["annotations"] = {MIGRATED: "kubernetes.io/aws-ebs"}
    for name in NODES:
        zoned = gpu_node(name, count=1, memory_mib=24 * 1024, replicas=4)
        zoned["metadata"]["labels"]["topology.kubernetes.io/zone"] = "z1"
        if driver_label:
            zoned["metadata"]["labels"]["topology.ebs.csi.aws.com/zone"] = "z1"
        zoned["metadata"]["resourceVersion"] = "2"
        w.source.apply("nodes", "MODIFIED", zoned)
    w.filter("default/p")
    await w.step(advance=1.5)
    if driver_label:
        assert w.evictions.real() == ["m2"]
        return
    assert w.evictions.calls == [] and w.repacker.stats.none == 1
    (told,) = [e["message"] for e in await w.events()]
    assert told == (
        "no repack now: no plan within 3 move(s) of movable pods; 1 movable pod(s) may go to no "
        "other node by their node rules or volumes: default/m2"
    )


async def test_unlisted_attach_limits_keep_a_disk_in_place(world: Any) -> None:
    """The same move, with the CSINodes not listable (no RBAC for them): vramsched cannot count
    the disks on a, so m2 is left out before any plan, and stays."""
    pods = fragmented()
    w = world(pods)
    for p in pods:
        if p["metadata"]["name"] == "m2":
            with_disk(w, p)
    w.filter("default/p")
    await w.step(advance=1.5)
    assert w.evictions.calls == [] and w.planned == 1
    (told,) = [e["message"] for e in await w.events()]
    assert told == (
        "no repack now: no plan within 3 move(s) of movable pods (left out: default/m2: its "
        "volumes cannot be counted against attach limits: the csinodes could not be listed "
        "(403 Forbidden))"
    )
    # read once, before planning: each list is asked for once
    assert [c[1] for c in w.api.calls if c[0] == "list" and c[1] != "pods"][-3:] == [
        "csinodes",
        "volumeattachments",
        "storageclasses",
    ]


async def test_the_blocked_pod_is_planned_only_where_its_volume_reaches(world: Any) -> None:
    """As the nodeSelector test above, with the blocked pod kept to b by its claim's volume."""
    p = pod("p", "14Gi", uid="p")
    w = world(room_on_either_node())
    label_pools(w)
    with_claim(w, p, "b")
    w.api.add_pod(p)
    w.source.apply("pods", "ADDED", copy.deepcopy(p))
    w.filter("default/p")
    await w.step(advance=1.5)
    assert w.evictions.real() == ["m2"]
    assert w.plan_kw[-1]["pod_nodes"].tolist() == [n == "b" for n in NODES]


def waiting_for_consumer(w: World, p: dict[str, Any], provisioner: str, volume_on: str) -> None:
    """Give the waiting pod `p` a claim of a WaitForFirstConsumer class of `provisioner` that
    names no volume yet, and the cluster one free local volume of that class on node `volume_on`
    (by its `pool` label). Each list answers every attempt."""
    p["spec"]["volumes"] = [{"name": "data", "persistentVolumeClaim": {"claimName": "data-p"}}]
    w.api.claims["default/data-p"] = {
        "metadata": {"name": "data-p", "namespace": "default"},
        "spec": {
            "storageClassName": "local",
            "accessModes": ["ReadWriteOnce"],
            "resources": {"requests": {"storage": "1Gi"}},
        },
    }
    term = {"matchExpressions": [{"key": "pool", "operator": "In", "values": [volume_on]}]}
    volume = {
        "metadata": {"name": f"local-{volume_on}"},
        "spec": {
            "storageClassName": "local",
            "capacity": {"storage": "10Gi"},
            "accessModes": ["ReadWriteOnce"],
            "nodeAffinity": {"required": {"nodeSelectorTerms": [term]}},
        },
        "status": {"phase": "Available"},
    }
    local = {
        "metadata": {"name": "local"},
        "provisioner": provisioner,
        "volumeBindingMode": "WaitForFirstConsumer",
    }
    for kind, found in (
        ("persistentvolumes", [volume]),
        ("csinodes", []),
        ("volumeattachments", []),
        ("storageclasses", [local]),
        ("csidrivers", []),
        ("csistoragecapacities", []),
    ):
        w.api.lists[kind] = [(found, "1")] * 4


@pytest.mark.parametrize(
    ("provisioner", "volume_on", "planned_on"),
    [
        ("ebs.csi.aws.com", "a", ["a", "b"]),  # provisioned wherever it is placed
        ("kubernetes.io/no-provisioner", "b", ["b"]),  # only the free local volume's node
        ("kubernetes.io/no-provisioner", "a", ["a"]),
    ],
)
async def test_a_waiting_pods_claim_that_waits_for_it_is_planned_where_it_can_bind(
    world: Any, provisioner: str, volume_on: str, planned_on: list[str]
) -> None:
    """A new StatefulSet replica's claim of a WaitForFirstConsumer class names no volume until
    kube-scheduler places the pod. It keeps the pod off no node its class can provision on; a
    class without a provisioner (local volumes made by hand) keeps it to the nodes a free volume
    of the class reaches. Only b can be freed for it (by moving m2)."""
    p = pod("p", "16Gi", uid="p")
    w = world(fragmented()[:-1])  # all but its own p, which mounts no claim
    label_pools(w)
    waiting_for_consumer(w, p, provisioner, volume_on)
    w.api.add_pod(p)
    w.source.apply("pods", "ADDED", copy.deepcopy(p))
    w.filter("default/p")
    await w.step(advance=1.5)
    assert w.plan_kw[-1]["pod_nodes"].tolist() == [n in planned_on for n in NODES]
    assert w.evictions.real() == (["m2"] if "b" in planned_on else [])
    assert ("list", "persistentvolumes") in w.api.calls


async def test_a_waiting_claim_without_the_volumes_listed_keeps_the_pod_unplanned(
    world: Any,
) -> None:
    """The same with the PersistentVolumes not listable (no RBAC for them): vramsched cannot tell
    where the claim binds, so no node is open to the pod and nothing is evicted."""
    p = pod("p", "16Gi", uid="p")
    w = world(fragmented()[:-1])
    label_pools(w)
    waiting_for_consumer(w, p, "kubernetes.io/no-provisioner", "b")
    del w.api.lists["persistentvolumes"]
    w.api.add_pod(p)
    w.source.apply("pods", "ADDED", copy.deepcopy(p))
    w.filter("default/p")
    await w.step(advance=1.5)
    assert w.evictions.calls == []
    (told,) = [e["message"] for e in await w.events()]
    assert told == (
        "no repack now: no plan within 3 move(s) of movable pods; the waiting pod may go to no "
        "node (on a: the PersistentVolumes its claim default/data-p may bind to could not be "
        "read)"
    )


async def test_the_cap_per_gpu_scales_with_the_gpus_the_pod_asks(world: Any) -> None:
    """One move per GPU: the 18Gi pod that needs two moves gets no plan; a pod of two GPUs is
    offered two moves (none helps here: every node has one GPU)."""
    w = world(two_moves(), per_gpu=1)
    w.filter("default/p")
    await w.step(advance=1.5)
    assert w.evictions.calls == [] and w.repacker.stats.none == 1
    (event,) = await w.events()
    assert event["message"].startswith("no repack now: no plan within 1 move(s)")
    w = world([*fragmented()[:-1], pod("pair", "4Gi", gpus=2, uid="pair")], per_gpu=1)
    w.filter("default/pair")
    await w.step(advance=1.5)
    assert w.evictions.calls == [] and w.planned == 1
    (event,) = await w.events()
    assert event["message"].startswith("no repack now: no plan within 2 move(s)")


async def test_the_per_minute_budget_holds_back_the_next_plan(world: Any) -> None:
    w = world(two_moves(), per_gpu=3, per_minute=1)
    w.filter("default/p")
    await w.step(advance=1.5)
    assert w.planned == 1 and w.evictions.real() == []  # two moves needed, one allowed
    w.repacker.budget.spend(1)
    await w.step(advance=11)
    assert w.planned == 1  # nothing left this minute: not even a plan is made
    await w.step(advance=60)
    assert w.planned == 2


async def test_only_the_leader_repacks(world: Any) -> None:
    w = world(fragmented(), leader=lambda: None)  # Lease not read yet: not known to lead
    w.filter("default/p")
    await w.step(advance=1.5)
    assert w.planned == 0 and w.evictions.calls == []


async def test_unused_holds_lapse_and_the_plan_ends(world: Any) -> None:
    w = world(fragmented())
    w.filter("default/p")
    await w.step(advance=1.5)
    w.gone("default/m2")
    w.filter("default/p")  # holds taken; nobody binds
    assert "default/p" in w.held() and f"default/m2{HOLD_SUFFIX}" in w.held()
    run = w.repacker.run
    assert run is not None
    await w.step(advance=run.deadline - w.clock() + run.ttl + 1)
    assert w.repacker.run is None
    assert w.repacker.last is not None and w.repacker.last["blockedOutcome"] == "lapsed"
    assert not [k for k in w.held() if HOLD_SUFFIX in k or k == "default/p"]
    assert check_cluster(w.cluster) == []


async def test_a_blocked_pod_edited_while_held_is_booked_at_its_new_size(world: Any) -> None:
    """The hold was sized for the model-memory the blocked pod asked when planned: once it asks
    more, the plan no longer stands for it, and its bind books what it asks now."""
    w = world(fragmented())
    w.filter("default/p")
    await w.step(advance=1.5)
    w.gone("default/m2")
    w.filter("default/p")
    assert w.cluster.ledger.reservation("default/p").bytes_per_device == (16 * GIB,)
    edited = copy.deepcopy(w.api.pods["default/p"])
    edited["metadata"]["annotations"]["vramsched.io/model-memory"] = "17Gi"
    w.api.pods["default/p"] = edited
    w.watch("default/p")
    assert w.filter("default/p")[0] == ["b"]  # 18 GiB free there, as for any pod
    assert w.repacker.run is not None and w.repacker.run.blocked_outcome == "changed"
    assert "default/p" not in w.held()  # the plan's hold for its old size is gone
    assert await w.bind("default/p", "b") == ""
    assert w.cluster.ledger.reservation("default/p").bytes_per_device == (17 * GIB,)
    w.assert_sound()


async def test_a_re_created_pod_edited_before_its_bind_is_booked_at_its_new_size(
    world: Any,
) -> None:
    w = world(fragmented())
    w.filter("default/p")
    await w.step(advance=1.5)
    new = w.recreate("default/m2", "web-new")
    assert w.filter(new)[0] == ["a"] and w.held()[new] == ("a", ("0",))
    w.api.pods[new]["metadata"]["annotations"]["vramsched.io/model-memory"] = "6Gi"
    w.watch(new)
    assert w.filter(new)[0] == ["a", "b"]  # no longer the plan's: placed as any pod is
    run = w.repacker.run
    assert run is not None and [t.outcome for t in run.targets] == ["changed"]
    assert new not in w.held()
    assert await w.bind(new, "a") == ""
    assert w.cluster.ledger.reservation(new).bytes_per_device == (6 * GIB,)
    w.assert_sound()


async def test_a_statefulset_pod_is_held_its_target_under_its_own_name(world: Any) -> None:
    pods = fragmented()
    pods[3] = owned(bound("db-0", 4, "b", consent=True), "StatefulSet", "db", "sts-db")
    w = world(pods)
    w.filter("default/p")
    await w.step(advance=1.5)
    assert w.evictions.real() == ["db-0"]
    w.gone("default/db-0")  # a StatefulSet re-creates only once the old pod is gone
    p = owned(
        pod("db-0", "4Gi", uid="db-0-new", annotations={MOVABLE: "true"}),
        "StatefulSet",
        "db",
        "sts-db",
    )
    w.api.add_pod(p)
    w.source.apply("pods", "ADDED", copy.deepcopy(p))
    assert w.filter("default/db-0")[0] == ["a"]
    held = w.cluster.ledger.reservation("default/db-0")
    assert held is not None and held.pod.uid == "db-0-new" and held.node == "a"
    assert await w.bind("default/db-0", "a") == ""
    assert await w.bind("default/p", "b") == ""
    await w.step()
    assert w.repacker.last is not None and w.repacker.last["phase"] == "done"


async def test_repack_metrics_and_state(world: Any) -> None:
    w = world(fragmented())
    w.filter("default/p")
    await w.step(advance=1.5)
    registry = CollectorRegistry()
    registry.register(RepackCollector(w.repacker))
    text = generate_latest(registry).decode()
    assert "vramsched_repack_moves_total 1.0" in text
    assert 'vramsched_repack_plans_total{outcome="started"} 1.0' in text
    assert "vramsched_repack_running 1.0" in text
    state = w.service.planner_state()
    assert state is not None and state["plans"] == 0  # no background planner here
    assert state["repack"]["running"]["moves"][0]["pod"] == "default/m2"
    assert state["repack"]["budget"] == {
        "perGpu": 3,
        "perPod": None,
        "perMinute": 6,
        "lastMinute": 1,
    }


def test_serve_flags() -> None:
    parser = build_parser()
    args = parser.parse_args(["serve"])
    assert args.repack is False
    assert (
        args.repack_max_moves_per_gpu,
        args.repack_max_moves_per_pod,
        args.repack_max_moves_per_minute,
    ) == (3, None, 6)
    args = parser.parse_args(["serve", "--repack", "--repack-max-moves-per-minute", "2"])
    assert args.repack and args.repack_max_moves_per_minute == 2
    with pytest.raises(SystemExit, match="needs live mode"):
        args.run(parser.parse_args(["serve", "--cluster", "x.yaml", "--repack"]))
    for flag in ("gpu", "pod", "minute"):
        with pytest.raises(SystemExit) as stop:
            parser.parse_args(["serve", f"--repack-max-moves-per-{flag}", "0"])
        assert stop.value.code == 2


def test_scheduler_config_is_read_before_the_server_starts(tmp_path: Any) -> None:
    """`--scheduler-config` names what is wrong and stops serve before anything runs."""
    parser = build_parser()
    config = tmp_path / "config.yaml"
    config.write_text(
        "apiVersion: kubescheduler.config.k8s.io/v1\nkind: KubeSchedulerConfiguration\n"
        "profiles: [{schedulerName: other}]\n"
    )
    live = ["serve", "--kubeconfig", str(tmp_path / "none"), "--scheduler-config"]
    with pytest.raises(SystemExit, match="is read by --repack and --preempt only"):
        args = parser.parse_args([*live, str(config)])
        args.run(args)
    with pytest.raises(SystemExit, match=r"config.yaml: no profile has schedulerName 'vramsched'"):
        args = parser.parse_args([*live, str(config), "--repack"])
        args.run(args)
    with pytest.raises(SystemExit, match=r"missing.yaml: No such file"):
        args = parser.parse_args([*live, str(tmp_path / "missing.yaml"), "--repack"])
        args.run(args)


def test_repack_leaves_the_service_alone_when_off() -> None:
    """Without nominations the service filters as before (the seam is optional)."""
    c = ClusterState(replica_policy=ReplicaPolicy.DISTRIBUTED)
    c.load([gpu_node(n, count=1, memory_mib=24 * 1024, replicas=4) for n in NODES])
    c.load(fragmented())
    api = FakeApi()
    src = LiveSource(c, api=api)
    service = live_service(c, src).service
    out = service.filter(ExtenderArgs(Pod=c.pod("default/p"), NodeNames=NODES))
    assert not out.NodeNames and set(out.FailedNodes or {}) == {"a", "b"}
    assert asyncio.iscoroutinefunction(service.bind)


async def test_a_moved_pod_that_never_leaves_abandons_the_plan(world: Any) -> None:
    """A kubelet that never confirms the deletion: the blocked pod never gets the GPU, and the
    plan is abandoned, saying which pod is still there, once the moved pods had to be gone."""
    w = world(fragmented())
    w.filter("default/p")
    await w.step(advance=1.5)
    run = w.repacker.run
    assert run is not None and run.leaving() == ["default/m2"]
    await w.step(advance=run.deadline - w.clock() - 1)
    assert w.repacker.run is run  # not yet
    await w.step(advance=2)
    assert w.repacker.run is None and w.repacker.stats.abandoned == 1
    assert not [k for k in w.held() if HOLD_SUFFIX in k]
    (warning,) = [e for e in await w.events() if e["reason"] == ABANDONED_REASON]
    assert "not all gone in time (still there: default/m2)" in warning["message"]
