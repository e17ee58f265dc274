"""Claims that wait for their first consumer, bound as kube-scheduler's VolumeBinding binds them
(`delayed_binding`); the e2e test against a real kube-scheduler is
`tests/e2e/test_volume_rules_e2e.py`."""

from __future__ import annotations

from typing import Any

import pytest

from extender.delayed_binding import (
    binding_refusal,
    claim_class,
    matching_volume,
    volume_class,
    waits_for_consumer,
)

HOST = "kubernetes.io/hostname"
ZONE = "topology.kubernetes.io/zone"


def claim(
    name: str = "data", size: str = "2Gi", cls: str = "local", **fields: Any
) -> dict[str, Any]:
    spec = {
        "storageClassName": cls,
        "accessModes": ["ReadWriteOnce"],
        "resources": {"requests": {"storage": size}},
        **fields,
    }
    return {"metadata": {"name": name, "namespace": "ml", "uid": f"uid-{name}"}, "spec": spec}


def volume(
    name: str, size: str = "10Gi", node: str = "n1", cls: str = "local", **fields: Any
) -> dict[str, Any]:
    term = {"matchExpressions": [{"key": HOST, "operator": "In", "values": [node]}]}
    spec = {
        "storageClassName": cls,
        "capacity": {"storage": size},
        "accessModes": ["ReadWriteOnce"],
        "nodeAffinity": {"required": {"nodeSelectorTerms": [term]}},
        **fields,
    }
    return {"metadata": {"name": name}, "spec": spec, "status": {"phase": "Available"}}


def on(node: str, **labels: str) -> dict[str, str]:
    return {HOST: node, **labels}


def judge(
    claims: list[tuple[str, dict[str, Any]]],
    volumes: list[dict[str, Any]],
    classes: dict[str, dict[str, Any]],
    node: str,
    labels: dict[str, str],
    **lists: Any,
) -> str | None:
    """`binding_refusal` in a cluster whose CSI drivers report no capacity, unless `lists` say."""
    lists = {"drivers": {}, "capacities": [], **lists}
    return binding_refusal(claims, volumes, classes, node, labels, **lists)


WAIT = "WaitForFirstConsumer"
CLASSES = {
    "local": {"provisioner": "kubernetes.io/no-provisioner", "volumeBindingMode": WAIT},
    "any": {"provisioner": "ebs.csi.aws.com", "volumeBindingMode": WAIT},
    "z1": {
        "provisioner": "ebs.csi.aws.com",
        "volumeBindingMode": WAIT,
        "allowedTopologies": [{"matchLabelExpressions": [{"key": ZONE, "values": ["z1"]}]}],
    },
    "now": {"provisioner": "ebs.csi.aws.com", "volumeBindingMode": "Immediate"},
}


def test_the_smallest_free_volume_that_fits_and_reaches_the_node_is_chosen() -> None:
    volumes = [volume("big", "20Gi"), volume("small", "5Gi"), volume("tiny", "1Gi")]
    assert matching_volume(claim(), volumes, on("n1"))["metadata"]["name"] == "small"
    assert matching_volume(claim(size="30Gi"), volumes, on("n1")) is None
    assert matching_volume(claim(), volumes, on("n2")) is None  # none reaches n2
    # a volume another claim of the pod took is not chosen again
    assert matching_volume(claim(), volumes, on("n1"), {"small"})["metadata"]["name"] == "big"


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"status": {"phase": "Bound"}}, "not free"),
        ({"status": {"phase": "Released"}}, "not free"),
        ({"metadata": {"name": "v", "deletionTimestamp": "2026-01-01T00:00:00Z"}}, "going"),
        ({"spec": {"claimRef": {"name": "other", "namespace": "ml"}}}, "another claim's"),
        ({"spec": {"storageClassName": "other"}}, "another class"),
        ({"spec": {"volumeMode": "Block"}}, "another volume mode"),
        ({"spec": {"accessModes": ["ReadOnlyMany"]}}, "not the claim's access mode"),
        ({"metadata": {"name": "v", "labels": {"tier": "slow"}}}, "outside the selector"),
    ],
)
def test_a_volume_that_is_not_free_or_does_not_suit_the_claim_is_not_chosen(
    change: dict[str, Any], why: str
) -> None:
    base = volume("v")
    base["metadata"]["labels"] = {"tier": "fast"}
    wanted = claim(selector={"matchLabels": {"tier": "fast"}})
    assert matching_volume(wanted, [base], on("n1")) is base
    changed = {
        **base,
        **{k: {**base.get(k, {}), **v} for k, v in change.items()},
    }
    assert matching_volume(wanted, [changed], on("n1")) is None, why


def test_a_volume_bound_to_the_claim_is_the_one_even_if_not_free() -> None:
    """A volume whose `claimRef` names the claim (pre-bound by a user, or bound by the PV
    controller before the claim knows it) is its volume, whatever its phase; where it does not
    reach the node, no other will do."""
    ref = {"claimRef": {"name": "data", "namespace": "ml", "uid": "uid-data"}}
    mine = volume("mine", "1Gi", **ref)
    mine["status"]["phase"] = "Bound"
    other = volume("other", "10Gi")
    assert matching_volume(claim(size="1Gi"), [other, mine], on("n1")) is mine
    assert (
        matching_volume(claim(size="1Gi"), [mine, volume("elsewhere", node="n2")], on("n2")) is None
    )
    # a claimRef with another UID is another claim's, of the same name
    stale = volume("stale", **{"claimRef": {"name": "data", "namespace": "ml", "uid": "old"}})
    assert matching_volume(claim(), [stale], on("n1")) is None


def test_claims_are_matched_smallest_first_each_to_its_own_volume() -> None:
    """Two claims and two volumes: upstream takes the 1Gi claim first, which gets the 5Gi volume,
    so the 8Gi claim gets the 10Gi one. Taken largest first, the 8Gi claim would take the 10Gi
    volume all the same; with one volume only one claim fits."""
    claims = [("ml/big", claim("big", "8Gi")), ("ml/small", claim("small", "1Gi"))]
    volumes = [volume("v10", "10Gi"), volume("v5", "5Gi")]
    assert judge(claims, volumes, CLASSES, "n1", on("n1")) is None
    refusal = judge(claims, volumes[:1], CLASSES, "n1", on("n1"))
    assert refusal == "no volume of class local on node n1 is free for its claim ml/big"


def test_a_class_with_a_provisioner_provisions_where_its_topology_allows() -> None:
    wanted = [("ml/data", claim(cls="any"))]
    assert judge(wanted, [], CLASSES, "n1", on("n1")) is None
    zonal = [("ml/data", claim(cls="z1"))]
    assert judge(zonal, [], CLASSES, "n1", on("n1", **{ZONE: "z1"})) is None
    assert judge(zonal, [], CLASSES, "n2", on("n2", **{ZONE: "z2"})) == (
        "class z1 of its claim ml/data does not provision on node n2"
    )
    # a free volume of the class that reaches the node is bound first, wherever it provisions
    static = [volume("v", node="n2", cls="z1")]
    assert judge(zonal, static, CLASSES, "n2", on("n2", **{ZONE: "z2"})) is None


@pytest.mark.parametrize(
    ("topologies", "admits"),
    [
        ([], True),
        ([{"matchLabelExpressions": []}], False),
        ([{"matchLabelExpressions": [{"key": ZONE, "values": []}]}], False),
        ([{"matchLabelExpressions": [{"key": ZONE, "values": ["z2"]}]}], False),
        (
            [
                {"matchLabelExpressions": [{"key": ZONE, "values": ["z2"]}]},
                {"matchLabelExpressions": [{"key": ZONE, "values": ["z1", "z3"]}]},
            ],
            True,
        ),
        (
            [
                {
                    "matchLabelExpressions": [
                        {"key": ZONE, "values": ["z1"]},
                        {"key": "rack", "values": ["r1"]},
                    ]
                }
            ],
            False,
        ),
    ],
)
def test_allowed_topologies_are_read_as_upstream_reads_them(
    topologies: list[dict[str, Any]], admits: bool
) -> None:
    classes = {"c": {**CLASSES["any"], "allowedTopologies": topologies}}
    refusal = judge([("ml/d", claim(cls="c"))], [], classes, "n", on("n", **{ZONE: "z1"}))
    assert (refusal is None) == admits, refusal


def test_a_claim_being_provisioned_for_a_node_allows_that_node_only() -> None:
    chosen = claim(cls="any")
    chosen["metadata"]["annotations"] = {"volume.kubernetes.io/selected-node": "n1"}
    assert judge([("ml/data", chosen)], [], CLASSES, "n1", on("n1")) is None
    assert judge([("ml/data", chosen)], [], CLASSES, "n2", on("n2")) == (
        "its claim ml/data is being provisioned for node n1"
    )
    # and is not matched to a free volume: it waits for its provisioner
    local = claim()
    local["metadata"]["annotations"] = {"volume.kubernetes.io/selected-node": "n1"}
    assert judge([("ml/data", local)], [volume("v")], CLASSES, "n1", on("n1")) == (
        "no volume of class local on node n1 is free for its claim ml/data"
    )


def test_classes_are_read_beta_annotation_first() -> None:
    beta = {"volume.beta.kubernetes.io/storage-class": "any"}
    both = claim(cls="local")
    both["metadata"]["annotations"] = beta
    assert claim_class(both) == "any"
    assert claim_class(claim(cls="local")) == "local"
    assert claim_class({"spec": {}}) == ""
    pv = volume("v", cls="local")
    pv["metadata"]["annotations"] = beta
    assert volume_class(pv) == "any"
    assert waits_for_consumer(both, CLASSES)
    assert not waits_for_consumer(claim(cls="now"), CLASSES)
    assert not waits_for_consumer(claim(cls="gone"), CLASSES)
    assert not waits_for_consumer(claim(cls=""), CLASSES)


def test_a_selector_upstream_cannot_read_refuses() -> None:
    odd = claim(selector={"matchExpressions": [{"key": "k", "operator": "Near"}]})
    refusal = judge([("ml/data", odd)], [volume("v")], CLASSES, "n1", on("n1"))
    assert refusal is not None and refusal.startswith("its claim ml/data has a selector")


TOPOLVM = "topolvm.io"


def capacity(size: str | None, zone: str | None = "z1", **more: Any) -> dict[str, Any]:
    """A CSIStorageCapacity of class `any` for the nodes in `zone` (None: no topology)."""
    found: dict[str, Any] = {"metadata": {"name": f"cap-{size}"}, "storageClassName": "any"}
    if size is not None:
        found["capacity"] = size
    if zone is not None:
        found["nodeTopology"] = {"matchLabels": {ZONE: zone}}
    return {**found, **more}


def test_a_driver_that_reports_capacity_provisions_only_where_it_has_room() -> None:
    """A CSI driver with `storageCapacity` (a local-disk one, TopoLVM say) provisions a claim
    only on a node one of its CSIStorageCapacity objects for the class reaches with room for it:
    `maximumVolumeSize` where set, else `capacity`, compared in whole bytes."""
    classes = {"any": {**CLASSES["any"], "provisioner": TOPOLVM}}
    tracked = {TOPOLVM: {"metadata": {"name": TOPOLVM}, "spec": {"storageCapacity": True}}}
    wanted = [("ml/data", claim(cls="any", size="2Gi"))]
    z1 = on("n1", **{ZONE: "z1"})

    def verdict(*capacities: dict[str, Any], drivers: Any = tracked) -> str | None:
        return judge(wanted, [], classes, "n1", z1, drivers=drivers, capacities=list(capacities))

    assert verdict(capacity("3Gi")) is None
    assert verdict(capacity("2Gi")) is None
    full = f"{TOPOLVM} reports no room on node n1 for its claim ml/data"
    assert verdict(capacity("1Gi")) == full
    assert verdict() == full
    assert verdict(capacity("3Gi", zone="z2")) == full  # reaches other nodes
    assert verdict(capacity("3Gi", zone=None)) == full  # reaches no node
    assert verdict(capacity("3Gi", storageClassName="other")) == full
    # the largest volume it can make counts before its total
    assert verdict(capacity("9Gi", maximumVolumeSize="1Gi")) == full
    assert verdict(capacity("1Gi", maximumVolumeSize="3Gi")) is None
    assert verdict(capacity("1Gi"), capacity("5Gi")) is None
    # a driver that does not report capacity, or no CSIDriver at all: no check
    assert verdict(drivers={TOPOLVM: {"spec": {"storageCapacity": False}}}) is None
    assert verdict(drivers={}) is None
    # what was not read refuses
    unread = judge(wanted, [], classes, "n1", z1, drivers=None)
    assert unread == "its claim ml/data cannot be judged: the CSIDrivers could not be read"
    unread = judge(wanted, [], classes, "n1", z1, drivers=tracked, capacities=None)
    assert unread == (
        "its claim ml/data cannot be judged: the CSIStorageCapacities could not be read"
    )
