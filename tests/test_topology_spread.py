"""Topology spread constraints as kube-scheduler's PodTopologySpread filter reads them
(`extender.topology_spread`), and live repacking's check of a plan's final state with them.

The cluster and the verdicts are those tests/e2e/test_topology_spread_e2e.py checks against a real
kube-scheduler 1.36 (1.20 knows neither `minDomains`, the node inclusion policies nor
`matchLabelKeys`): zones z1 (3 replicas), z2 (1, plus one being deleted and one in another
namespace), z3 (empty, tainted), z4 (1, another pool), and a node with no zone label.
"""

from __future__ import annotations

from typing import Any

import pytest
from builders import assigned, gpu_node, pod

from extender.demand import pod_demand
from extender.ledger import Reservation
from extender.repack_policy import (
    MOVABLE,
    Controller,
    PlannedMove,
    plan_target_problem,
)
from extender.target_rules import schedulable_on
from extender.topology_spread import spread_problem

HOST = "kubernetes.io/hostname"
GIB = 1 << 30
DEDICATED = {"key": "dedicated", "value": "gpu", "effect": "NoSchedule"}


def _node(name: str, labels: dict[str, str], taint: dict[str, str] | None = None) -> dict[str, Any]:
    spec = {"taints": [taint]} if taint else {}
    return {"metadata": {"name": name, "labels": {HOST: name, **labels}}, "spec": spec}


NODES = {
    "s1": _node("s1", {"zone": "z1"}),
    "s2": _node("s2", {"zone": "z1"}),
    "s3": _node("s3", {"zone": "z2"}),
    "s4": _node("s4", {"zone": "z3"}, DEDICATED),
    "s5": _node("s5", {}),
    "s6": _node("s6", {"zone": "z4", "pool": "other"}),
}


def _pod(name: str, labels: dict[str, str], ns: str = "default", **meta: Any) -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": ns, "labels": labels, **meta}, "spec": {}}


R1, R2 = {"app": "llm", "rev": "r1"}, {"app": "llm", "rev": "r2"}
RUNNING = [
    (_pod("llm-a", R1), "s1"),
    (_pod("llm-b", R1), "s1"),
    (_pod("llm-c", R2), "s2"),
    (_pod("llm-d", R1), "s3"),
    (_pod("llm-t", R1, deletionTimestamp="2026-01-01T00:00:00Z"), "s3"),
    (_pod("llm-o", R1, ns="other"), "s3"),
    (_pod("llm-e", R1), "s5"),
    (_pod("llm-f", R1), "s6"),
]
LLM = {"matchLabels": {"app": "llm"}}


def _spread(key: str, skew: int, selector: Any = LLM, **extra: Any) -> dict[str, Any]:
    c: dict[str, Any] = {"maxSkew": skew, "topologyKey": key, "whenUnsatisfiable": "DoNotSchedule"}
    return {**c, **({"labelSelector": selector} if selector is not None else {}), **extra}


def _zones(*zones: str) -> dict[str, Any]:
    expr = {"key": "zone", "operator": "In", "values": list(zones)}
    terms = [{"matchExpressions": [expr]}]
    return {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": terms}
        }
    }


def _probe(
    labels: dict[str, str],
    constraints: list[dict[str, Any]],
    affinity: dict[str, Any] | None = None,
) -> dict[str, Any]:
    p = _pod("probe", labels)
    p["spec"] = {
        "topologySpreadConstraints": constraints,
        "tolerations": [{"key": "dedicated", "operator": "Exists"}],
    }
    if affinity:
        p["spec"]["affinity"] = affinity
    return p


LL = {"app": "llm"}


def _allowed(probe: dict[str, Any]) -> list[str]:
    """The nodes kube-scheduler would let the probe onto: its taints and node affinity, then its
    spread."""
    return [
        n
        for n in NODES
        if (schedulable_on(probe, NODES[n]) or spread_problem(probe, n, RUNNING, NODES)) is None
    ]


@pytest.mark.parametrize(
    ("probe", "allowed"),
    [
        # z3 (empty) is the emptiest domain: with maxSkew 1 only it takes one more replica
        pytest.param(_probe(LL, [_spread("zone", 1)]), "s4", id="zone-1"),
        # the replica being deleted and the one in another namespace are not counted in z2
        pytest.param(_probe(LL, [_spread("zone", 3)]), "s3 s4 s6", id="zone-3"),
        pytest.param(_probe(LL, [_spread(HOST, 1)]), "s4", id="host-1"),
        # node affinity (Honor) leaves z1 and z2 as the domains: z2 is the emptiest
        pytest.param(_probe(LL, [_spread("zone", 1)], _zones("z1", "z2")), "s3", id="z1-z2"),
        # fewer domains than minDomains: the emptiest counts as 0
        pytest.param(
            _probe(LL, [_spread("zone", 1, minDomains=3)], _zones("z1", "z2")), "", id="min-dom"
        ),
        pytest.param(
            _probe(LL, [_spread("zone", 1, nodeAffinityPolicy="Ignore")], _zones("z1", "z2")),
            "",
            id="ignore-affinity",
        ),
        pytest.param(_probe({"app": "other"}, [_spread("zone", 1)]), "s3 s4 s6", id="not-self"),
        # only rev r2 counts: z1 holds one, the other zones none
        pytest.param(
            _probe({"app": "llm", "rev": "r2"}, [_spread("zone", 1, matchLabelKeys=["rev"])]),
            "s3 s4 s6",
            id="match-label-keys",
        ),
        pytest.param(_probe(LL, [_spread("zone", 3), _spread(HOST, 1)]), "s4", id="two"),
        pytest.param(_probe(LL, [_spread("zone", 1, selector=None)]), "s1 s2 s3 s4 s6", id="null"),
        pytest.param(
            _probe(LL, [{**_spread("zone", 1), "whenUnsatisfiable": "ScheduleAnyway"}]),
            "s1 s2 s3 s4 s5 s6",
            id="schedule-anyway",
        ),
    ],
)
def test_spread_refuses_the_nodes_kube_scheduler_refuses(
    probe: dict[str, Any], allowed: str
) -> None:
    assert _allowed(probe) == allowed.split()


def test_taints_count_only_when_the_constraint_honours_them() -> None:
    untolerating = _probe(LL, [_spread("zone", 1, nodeTaintsPolicy="Honor")])
    untolerating["spec"].pop("tolerations")
    # z3's only node repels the pod: without it the emptiest zones hold one replica
    assert _allowed(untolerating) == ["s3", "s6"]
    # by default the empty z3 still counts, and only it may take one more
    untolerating["spec"]["topologySpreadConstraints"][0].pop("nodeTaintsPolicy")
    assert _allowed(untolerating) == []
    assert spread_problem(untolerating, "s4", RUNNING, NODES) is None


def test_the_problem_says_which_domain_and_by_how_much() -> None:
    probe = _probe(LL, [_spread("zone", 1)])
    assert spread_problem(probe, "s1", RUNNING, NODES) == (
        "node s1: its zone z1 would hold 4 more matching pods than the emptiest domain, "
        "over its maxSkew 1"
    )
    assert spread_problem(probe, "s5", RUNNING, NODES) == (
        "node s5 has no zone label its topology spread needs"
    )
    odd = _probe(LL, [_spread("zone", 1, {"matchExpressions": [{"key": "a", "operator": "Gt"}]})])
    assert "cannot be read" in (spread_problem(odd, "s4", RUNNING, NODES) or "")


def _replica(name: str, node: str) -> dict[str, Any]:
    """A movable replica of Deployment llm, spread over zones with maxSkew 1."""
    ann = {MOVABLE: "true", **assigned(node, "0", 8)}
    p = pod(name, "8Gi", node=node, uid=name, annotations=ann, phase="Running")
    p["metadata"]["labels"] = {"app": "llm"}
    p["spec"]["topologySpreadConstraints"] = [_spread("zone", 1)]
    return p


def test_a_plan_may_not_leave_a_replica_with_no_zone_it_may_use() -> None:
    nodes = {n: gpu_node(n, count=1) for n in ("a", "b", "c")}
    for name, zone in (("a", "z1"), ("b", "z2"), ("c", "z1")):
        nodes[name]["metadata"]["labels"]["zone"] = zone
    pods = {f"default/{n}": _replica(n, node) for n, node in (("r1", "a"), ("r2", "b"))}
    blocked = pod("p", "16Gi", uid="p")
    on_b = Reservation(pod_demand(blocked).pod, "b", ("0",), (16 * GIB,))

    def move(name: str, source: str, target: str) -> PlannedMove:
        d = pod_demand(pods[f"default/{name}"])
        res = Reservation(d.pod, source, ("0",), (8 * GIB,))
        to = Reservation(d.pod, target, ("0",), (8 * GIB,))
        return PlannedMove(d.pod, d, res, to, Controller("ReplicaSet", "llm", "rs-llm"))

    # r2 from z2 to z1 beside r1: z1 would hold 2, z2 none
    assert plan_target_problem(nodes, pods, blocked, on_b, [move("r2", "b", "c")]) == (
        "node c: its zone z1 would hold 2 more matching pods than the emptiest domain, "
        "over its maxSkew 1",
        "default/r2",
    )
    # r1 from a to c stays in z1: the spread is as it was
    assert plan_target_problem(nodes, pods, blocked, on_b, [move("r1", "a", "c")]) is None
