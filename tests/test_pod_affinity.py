"""Required inter-pod (anti-)affinity as kube-scheduler's InterPodAffinity filter reads it
(`extender.pod_affinity`), and live repacking's check of a plan's final state with it.

The cluster and the expected verdicts are those tests/e2e/test_pod_affinity_e2e.py checks against
a real kube-scheduler (1.20 and 1.36): 4 nodes in two zones and none, 5 running pods in two
namespaces, two of them with anti-affinity of their own.
"""

from __future__ import annotations

from typing import Any

import pytest
from builders import assigned, gpu_node, pod

from extender.demand import pod_demand
from extender.ledger import Reservation
from extender.pod_affinity import affinity_problem
from extender.repack_policy import MOVABLE, Controller, PlannedMove, plan_target_problem

HOST = "kubernetes.io/hostname"
GIB = 1 << 30
LABELS = {
    "n1": {HOST: "n1", "zone": "z1"},
    "n2": {HOST: "n2", "zone": "z1"},
    "n3": {HOST: "n3", "zone": "z2"},
    "n4": {HOST: "n4"},
}


def _pod(
    name: str, labels: dict[str, str], affinity: dict[str, Any] | None = None, ns: str = "default"
) -> dict[str, Any]:
    spec: dict[str, Any] = {"containers": [{"name": "c"}]}
    if affinity:
        spec["affinity"] = affinity
    return {"metadata": {"name": name, "namespace": ns, "labels": labels}, "spec": spec}


def _rules(kind: str, *terms: dict[str, Any]) -> dict[str, Any]:
    return {kind: {"requiredDuringSchedulingIgnoredDuringExecution": list(terms)}}


def _term(selector: dict[str, Any] | None, key: str = HOST, **extra: Any) -> dict[str, Any]:
    return {"topologyKey": key, **extra, **({"labelSelector": selector} if selector else {})}


WEB = {"matchLabels": {"app": "web"}}
CACHE = {"matchLabels": {"app": "cache"}}
BATCH = {"matchLabels": {"team": "batch"}}

RUNNING = [
    (_pod("web-1", {"app": "web", "tier": "front"}), "n1"),
    (_pod("guard", {"app": "guard"}, _rules("podAntiAffinity", _term(BATCH))), "n2"),
    (_pod("db-1", {"app": "db"}, _rules("podAntiAffinity", _term(BATCH, "zone"))), "n3"),
    (_pod("web-other", {"app": "web"}, ns="other"), "n3"),
    (_pod("web-2", {"app": "web"}), "n4"),
]

NOT_WEB_OR_DB = {"matchExpressions": [{"key": "app", "operator": "NotIn", "values": ["web", "db"]}]}


@pytest.mark.parametrize(
    ("labels", "affinity", "allowed"),
    [
        pytest.param({}, None, "n1 n2 n3 n4", id="plain"),
        # guard keeps batch off its host, db-1 off its zone
        pytest.param({"team": "batch"}, None, "n1 n4", id="batch"),
        # web-other is in another namespace: a term selects the pod's own by default
        pytest.param({}, _rules("podAntiAffinity", _term(WEB)), "n2 n3", id="anti-web-host"),
        # n4 has no zone label: the term does not apply there, though web-2 runs on it
        pytest.param(
            {}, _rules("podAntiAffinity", _term(WEB, "zone")), "n3 n4", id="anti-web-zone"
        ),
        # web-2's node has no zone: it counts for no zone, and n4 lacks the label the term needs
        pytest.param({}, _rules("podAffinity", _term(WEB, "zone")), "n1 n2", id="with-web-zone"),
        pytest.param({}, _rules("podAffinity", _term(WEB)), "n1 n4", id="with-web-host"),
        # no pod matches: the first of a group that attracts itself may go anywhere with the label
        pytest.param(
            {"app": "cache"}, _rules("podAffinity", _term(CACHE)), "n1 n2 n3 n4", id="first-host"
        ),
        pytest.param(
            {"app": "cache"}, _rules("podAffinity", _term(CACHE, "zone")), "n1 n2 n3", id="first-z"
        ),
        pytest.param({}, _rules("podAffinity", _term(CACHE)), "", id="cache-unlabelled"),
        pytest.param(
            {},
            _rules("podAntiAffinity", _term(WEB, namespaces=["other"])),
            "n1 n2 n4",
            id="anti-web-in-other",
        ),
        pytest.param(
            {},
            _rules("podAntiAffinity", _term(WEB, namespaceSelector={})),
            "n2",
            id="anti-web-everywhere",
        ),
        # a pod counts only when it matches every term: web-2 has no tier
        pytest.param(
            {},
            _rules("podAffinity", _term(WEB), _term({"matchLabels": {"tier": "front"}})),
            "n1",
            id="with-web-and-front",
        ),
        pytest.param(
            {}, _rules("podAntiAffinity", _term(NOT_WEB_OR_DB)), "n1 n3 n4", id="anti-notin"
        ),
        pytest.param({}, _rules("podAntiAffinity", _term(None)), "n1 n2 n3 n4", id="no-selector"),
        pytest.param(
            {"team": "batch"},
            _rules("podAffinity", _term(WEB, "zone")),
            "n1",
            id="batch-with-web-zone",
        ),
    ],
)
def test_pods_go_where_kube_scheduler_lets_them(
    labels: dict[str, str], affinity: dict[str, Any] | None, allowed: str
) -> None:
    probe = _pod("probe", labels, affinity)
    ours = [n for n in LABELS if affinity_problem(probe, n, RUNNING, LABELS) is None]
    assert ours == allowed.split()


def test_the_problem_names_the_rule_and_the_pod() -> None:
    batch = _pod("probe", {"team": "batch"})
    assert affinity_problem(batch, "n2", RUNNING, LABELS) == (
        f"node n2: pod default/guard's anti-affinity excludes it from its {HOST}"
    )
    anti = _pod("probe", {}, _rules("podAntiAffinity", _term(WEB)))
    assert affinity_problem(anti, "n1", RUNNING, LABELS) == (
        f"node n1: a pod its anti-affinity excludes runs in its {HOST}"
    )
    near = _pod("probe", {}, _rules("podAffinity", _term(WEB, "zone")))
    assert affinity_problem(near, "n4", RUNNING, LABELS) == (
        "node n4 has no zone label its pod affinity needs"
    )
    assert affinity_problem(near, "n3", RUNNING, LABELS) == (
        "node n3: no pod its affinity asks for runs in the same domain"
    )


def test_terms_that_cannot_be_read_are_a_problem_and_unknown_namespaces_the_strict_reading() -> (
    None
):
    odd = {"matchExpressions": [{"key": "app", "operator": "Gt", "values": ["1"]}]}
    bad = _pod("probe", {}, _rules("podAntiAffinity", _term(odd)))
    assert "'Gt' is not one of" in (affinity_problem(bad, "n2", RUNNING, LABELS) or "")
    broken = _pod(
        "probe", {}, {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": ["x"]}}
    )
    assert "cannot be read" in (affinity_problem(broken, "n2", RUNNING, LABELS) or "")
    # a namespaceSelector with conditions needs namespace labels the ledger does not have:
    # anti-affinity then covers every namespace, affinity only the namespaces listed
    picked = {"matchLabels": {"team": "ml"}}
    anti = _pod("probe", {}, _rules("podAntiAffinity", _term(WEB, namespaceSelector=picked)))
    assert [n for n in LABELS if affinity_problem(anti, n, RUNNING, LABELS) is None] == ["n2"]
    near = _pod("probe", {}, _rules("podAffinity", _term(WEB, namespaceSelector=picked)))
    assert [n for n in LABELS if affinity_problem(near, n, RUNNING, LABELS) is None] == []


def _replica(name: str, node: str | None) -> dict[str, Any]:
    """A movable replica of Deployment llm, kept one per node by required anti-affinity."""
    ann = {MOVABLE: "true", **(assigned(node, "0", 8) if node else {})}
    p = pod(name, "8Gi", node=node, uid=name, annotations=ann, phase="Running")
    p["metadata"]["labels"] = {"app": "llm"}
    p["spec"]["affinity"] = _rules("podAntiAffinity", _term({"matchLabels": {"app": "llm"}}, HOST))
    return p


def _move(pods: dict[str, Any], name: str, source: str, target: str) -> PlannedMove:
    d = pod_demand(pods[f"default/{name}"])
    held = Reservation(d.pod, source, ("0",), (8 * GIB,))
    target_res = Reservation(d.pod, target, ("0",), (8 * GIB,))
    return PlannedMove(d.pod, d, held, target_res, Controller("ReplicaSet", "llm", "rs-llm"))


def test_a_plan_may_not_send_a_replica_where_its_anti_affinity_forbids() -> None:
    nodes = {n: gpu_node(n, count=1) for n in ("a", "b", "c")}
    for name, node in nodes.items():
        node["metadata"]["labels"][HOST] = name
    pods = {
        f"default/{p['metadata']['name']}": p for p in (_replica("r1", "a"), _replica("r2", "b"))
    }
    blocked = pod("p", "16Gi", uid="p")
    on_c = Reservation(pod_demand(blocked).pod, "c", ("0",), (16 * GIB,))
    # r2 to a, beside r1: its new copy would wait forever; r2 is the pod to leave out
    why = plan_target_problem(nodes, pods, blocked, on_c, [_move(pods, "r2", "b", "a")])
    assert why == (
        "node a: a pod its anti-affinity excludes runs in its kubernetes.io/hostname",
        "default/r2",
    )
    # r1 and r2 trading places: each leaves before the other arrives
    swap = [_move(pods, "r1", "a", "b"), _move(pods, "r2", "b", "a")]
    assert plan_target_problem(nodes, pods, blocked, on_c, swap) is None
    # two replicas sent to one node break the rule between themselves
    both = [_move(pods, "r1", "a", "c"), _move(pods, "r2", "b", "c")]
    assert plan_target_problem(nodes, pods, blocked, on_c, both) == (
        "node c: a pod its anti-affinity excludes runs in its kubernetes.io/hostname",
        "default/r1",
    )
