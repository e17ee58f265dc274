"""volume_rules: where a pod's bound claims let it run (the e2e test puts each case beside a real
kube-scheduler; these pin the reading down without one)."""

from __future__ import annotations

from typing import Any

import pytest

from extender.target_rules import node_masks, schedulable_on
from extender.volume_rules import Storage, claim_keys, volume_refusal

#: what the PV controller sets on a claim once it is bound
BIND_COMPLETED = "pv.kubernetes.io/bind-completed"

ZONE = "topology.kubernetes.io/zone"
BETA_ZONE = "failure-domain.beta.kubernetes.io/zone"


def node(name: str, **labels: str) -> dict[str, Any]:
    return {"metadata": {"name": name, "labels": {"kubernetes.io/hostname": name, **labels}}}


def pod(*claims: str, namespace: str = "ml") -> dict[str, Any]:
    volumes: list[dict[str, Any]] = [{"name": "scratch", "emptyDir": {}}]
    volumes += [{"name": c, "persistentVolumeClaim": {"claimName": c}} for c in claims]
    return {"metadata": {"name": "p", "namespace": namespace}, "spec": {"volumes": volumes}}


def claim(name: str, volume: str | None, *, bound: bool = True, **meta: Any) -> dict[str, Any]:
    annotations = {BIND_COMPLETED: "yes"} if bound else {}
    return {
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": name, "namespace": "ml", "annotations": annotations, **meta},
        "spec": {"volumeName": volume} if volume else {},
    }


def volume(name: str, labels: dict[str, str] | None = None, **terms: list[Any]) -> dict[str, Any]:
    spec: dict[str, Any] = {}
    if terms:
        spec["nodeAffinity"] = {"required": {"nodeSelectorTerms": terms["terms"]}}
    return {
        "kind": "PersistentVolume",
        "metadata": {"name": name, "labels": labels or {}},
        "spec": spec,
    }


def expr(key: str, *values: str) -> dict[str, Any]:
    return {"key": key, "operator": "In", "values": list(values)}


def test_claim_keys_are_the_pods_claims_in_its_namespace() -> None:
    p = pod("a", "b")
    p["spec"]["volumes"].append({"name": "e", "ephemeral": {"volumeClaimTemplate": {}}})
    p["spec"]["volumes"].append({"name": "n", "persistentVolumeClaim": {}})
    assert claim_keys(p) == ["ml/a", "ml/b", "ml/"]
    assert claim_keys({"metadata": {"name": "q"}, "spec": {}}) == []


def test_a_local_volume_keeps_the_pod_on_its_node() -> None:
    storage = Storage.from_objects(
        [
            claim("data", "pv"),
            volume("pv", terms=[{"matchExpressions": [expr("kubernetes.io/hostname", "a")]}]),
        ]
    )
    assert volume_refusal(pod("data"), node("a"), storage) is None
    assert volume_refusal(pod("data"), node("b"), storage) == (
        "node b is outside the node affinity of volume pv"
    )


def test_any_term_of_the_volumes_affinity_will_do_and_its_fields_do_not_count() -> None:
    terms = [
        {"matchExpressions": [expr(ZONE, "z2")], "matchFields": [expr("metadata.name", "a")]},
        {"matchFields": [expr("metadata.name", "nowhere")]},
    ]
    storage = Storage.from_objects([claim("data", "pv"), volume("pv", terms=terms)])
    # the second term is fields alone: matched on labels only, it holds everywhere
    assert volume_refusal(pod("data"), node("c"), storage) is None
    only_first = Storage.from_objects([claim("data", "pv"), volume("pv", terms=terms[:1])])
    assert volume_refusal(pod("data"), node("a", **{ZONE: "z1"}), only_first) is not None
    assert volume_refusal(pod("data"), node("b", **{ZONE: "z2"}), only_first) is None


@pytest.mark.parametrize(
    ("pv_labels", "node_labels", "fits"),
    [
        ({ZONE: "z1"}, {ZONE: "z1"}, True),
        ({ZONE: "z1"}, {ZONE: "z2"}, False),
        ({ZONE: "z1__z2"}, {ZONE: "z2"}, True),
        ({ZONE: " z1 __z3"}, {ZONE: "z1"}, True),
        ({ZONE: "z1____z2"}, {ZONE: "z3"}, True),  # an empty zone: the label is ignored
        ({ZONE: "z1"}, {}, True),  # a node without zone labels takes any volume
        ({ZONE: "z1"}, {"topology.kubernetes.io/region": "r1"}, False),
        ({BETA_ZONE: "z1"}, {ZONE: "z1"}, True),  # beta on the volume, GA on the node
        ({ZONE: "z1"}, {BETA_ZONE: "z1"}, False),  # not the other way round
        ({"other": "x"}, {ZONE: "z1"}, True),
    ],
)
def test_zone_labels_are_read_as_volumezone_reads_them(
    pv_labels: dict[str, str], node_labels: dict[str, str], fits: bool
) -> None:
    storage = Storage.from_objects([claim("data", "pv"), volume("pv", pv_labels)])
    refusal = volume_refusal(pod("data"), node("n", **node_labels), storage)
    assert (refusal is None) == fits, refusal


@pytest.mark.parametrize(
    ("objects", "why"),
    [
        ([], "its claim ml/data does not exist"),
        (
            [claim("data", "pv", deletionTimestamp="2026-01-01T00:00:00Z"), volume("pv")],
            "is being deleted",
        ),
        ([claim("data", "pv")], "volume pv of its claim ml/data does not exist"),
    ],
)
def test_a_claim_that_is_gone_or_going_keeps_the_pod_off_every_node(
    objects: list[dict[str, Any]], why: str
) -> None:
    refusal = volume_refusal(pod("data"), node("a"), Storage.from_objects(objects))
    assert refusal is not None and why in refusal


def test_a_claim_not_bound_yet_sets_no_bound_and_a_named_volume_is_checked() -> None:
    """A claim naming no volume is bound where kube-scheduler places the pod (a waiting pod's
    claim of a WaitForFirstConsumer class): no bound. One naming a volume before the PV controller
    finished binding is held to that volume, as kube-scheduler holds a pre-bound claim."""
    local = volume("pv", terms=[{"matchExpressions": [expr("kubernetes.io/hostname", "a")]}])
    unbound = Storage.from_objects([claim("data", None, bound=False)])
    assert volume_refusal(pod("data"), node("b"), unbound) is None
    pre_bound = Storage.from_objects([claim("data", "pv", bound=False), local])
    assert volume_refusal(pod("data"), node("a"), pre_bound) is None
    assert volume_refusal(pod("data"), node("b"), pre_bound) is not None


def test_what_was_not_read_refuses_and_what_was_read_as_absent_does_not_exist() -> None:
    p = pod("data")
    assert volume_refusal(p, node("a"), Storage()) == "its claim ml/data could not be read"
    assert volume_refusal(p, node("a"), Storage({"ml/data": None})) == (
        "its claim ml/data does not exist"
    )
    read = Storage({"ml/data": claim("data", "pv")})
    assert volume_refusal(p, node("a"), read) == "volume pv of its claim ml/data could not be read"
    assert (
        volume_refusal(
            p, node("a"), Storage({"ml/data": claim("data", "pv")}, {"pv": volume("pv")})
        )
        is None
    )
    # a pod without claims needs nothing read
    assert volume_refusal(pod(), node("a"), Storage()) is None


def test_every_claim_must_reach_the_node() -> None:
    storage = Storage.from_objects(
        [
            claim("a", "pv-a"),
            claim("b", "pv-b"),
            volume("pv-a", {ZONE: "z1"}),
            volume("pv-b", terms=[{"matchExpressions": [expr("kubernetes.io/hostname", "n2")]}]),
        ]
    )
    assert volume_refusal(pod("a"), node("n1", **{ZONE: "z1"}), storage) is None
    refusal = volume_refusal(pod("a", "b"), node("n1", **{ZONE: "z1"}), storage)
    assert refusal == "node n1 is outside the node affinity of volume pv-b"


def test_schedulable_on_and_the_masks_check_volumes_only_when_given_storage() -> None:
    storage = Storage.from_objects([claim("data", "pv"), volume("pv", {ZONE: "z1"})])
    nodes = {"a": node("a", **{ZONE: "z1"}), "b": node("b", **{ZONE: "z2"})}
    p = pod("data")
    assert schedulable_on(p, nodes["b"]) is None  # the simulator's call: no volumes known
    assert schedulable_on(p, nodes["b"], storage) == (f"node b is outside volume pv's {ZONE} z1")
    other = pod("data", namespace="elsewhere")  # the same claim name in another namespace
    masks = node_masks(nodes, {"ml/p": p, "elsewhere/p": other}, ["a", "b"], storage)
    assert masks("ml/p").tolist() == [True, False]
    assert masks("elsewhere/p").tolist() == [False, False]  # its claim does not exist
    assert node_masks(nodes, {"ml/p": p}, ["a", "b"])("ml/p").tolist() == [True, True]


EBS_ZONE = "topology.ebs.csi.aws.com/zone"
MIGRATED = "storage.alpha.kubernetes.io/migrated-plugins"


def csinode(name: str, *plugins: str) -> dict[str, Any]:
    annotations = {MIGRATED: ",".join(plugins)} if plugins else {}
    return {"kind": "CSINode", "metadata": {"name": name, "annotations": annotations}}


def ebs(name: str, volume_id: str = "vol-1", **labels: str) -> dict[str, Any]:
    pv = volume(name, labels)
    pv["spec"]["awsElasticBlockStore"] = {"volumeID": volume_id}
    return pv


def test_a_migrated_in_tree_volume_needs_its_drivers_zone_label() -> None:
    """On a node whose CSINode lists the plugin as migrated, an EBS volume in zone z1 needs the
    EBS driver's zone label z1 (VolumeBinding, translated), and the node's own zone labels must
    still hold z1 if it has any (VolumeZone). Elsewhere only the zone labels are read."""
    objects = [
        claim("data", "pv"),
        ebs("pv", **{ZONE: "z1"}),
        *(csinode(n, "kubernetes.io/aws-ebs") for n in ("both", "ga", "driver", "elsewhere")),
        csinode("plain"),
    ]
    storage = Storage.from_objects(objects)
    nodes = {
        "both": node("both", **{ZONE: "z1", EBS_ZONE: "z1"}),
        "ga": node("ga", **{ZONE: "z1"}),
        "driver": node("driver", **{EBS_ZONE: "z1"}),
        "elsewhere": node("elsewhere", **{ZONE: "z2", EBS_ZONE: "z1"}),
        "plain": node("plain", **{ZONE: "z1"}),  # a CSINode that lists nothing
        "none": node("none", **{ZONE: "z1"}),  # no CSINode at all
    }
    verdicts = {n: volume_refusal(pod("data"), v, storage) for n, v in nodes.items()}
    assert verdicts == {
        "both": None,
        "ga": "node ga is outside the node affinity of volume pv",
        "driver": None,
        "elsewhere": f"node elsewhere is outside volume pv's {ZONE} z1",
        "plain": None,
        "none": None,
    }


def test_an_in_tree_volume_needs_the_csinodes_read_and_a_translatable_id() -> None:
    objects = [claim("data", "pv"), ebs("pv", volume_id="aws://z1/not-a-volume")]
    unread = Storage.from_objects(objects, listed=())
    assert volume_refusal(pod("data"), node("a"), unread) == (
        "volume pv of its claim ml/data is in-tree and the CSINodes were not read"
    )
    storage = Storage.from_objects([*objects, csinode("a", "kubernetes.io/aws-ebs")])
    refusal = volume_refusal(pod("data"), node("a"), storage)
    assert refusal is not None and refusal.startswith(
        "volume pv of its claim ml/data cannot be migrated to CSI: invalid format"
    )
    # where the plugin is not migrated, the volume is used as it is
    assert volume_refusal(pod("data"), node("b"), storage) is None


DEFAULT = "storageclass.kubernetes.io/is-default-class"
LOCAL = {
    "kind": "StorageClass",
    "metadata": {"name": "local"},
    "provisioner": "kubernetes.io/no-provisioner",
    "volumeBindingMode": "WaitForFirstConsumer",
}


def waiting_claim(name: str, cls: str = "local") -> dict[str, Any]:
    """A claim that names no volume yet."""
    found = claim(name, None, bound=False)
    found["spec"] = {"storageClassName": cls, "resources": {"requests": {"storage": "1Gi"}}}
    return found


def free_local(name: str, node_name: str) -> dict[str, Any]:
    pv = volume(name, terms=[{"matchExpressions": [expr("kubernetes.io/hostname", node_name)]}])
    pv["spec"].update(storageClassName="local", capacity={"storage": "5Gi"})
    pv["status"] = {"phase": "Available"}
    return pv


def test_a_claim_that_waits_for_its_pod_binds_where_a_free_volume_reaches() -> None:
    storage = Storage.from_objects([waiting_claim("data"), free_local("pv", "a"), LOCAL])
    assert volume_refusal(pod("data"), node("a"), storage) is None
    assert volume_refusal(pod("data"), node("b"), storage) == (
        "no volume of class local on node b is free for its claim ml/data"
    )
    # bound claims are checked first, the waiting ones then together
    both = Storage.from_objects(
        [waiting_claim("data"), free_local("pv", "a"), LOCAL, claim("db", "pv-z"), volume("pv-z")]
    )
    assert volume_refusal(pod("db", "data"), node("a"), both) is None


def test_a_waiting_claim_needs_its_class_and_every_volume_read() -> None:
    p = pod("data")
    claims = {"ml/data": waiting_claim("data")}
    assert volume_refusal(p, node("a"), Storage(claims)) == (
        "the StorageClasses its claim ml/data needs could not be read"
    )
    classes = {"local": LOCAL}
    assert volume_refusal(p, node("a"), Storage(claims, classes=classes)) == (
        "the PersistentVolumes its claim ml/data may bind to could not be read"
    )
    listed = Storage(claims, {"pv": free_local("pv", "a")}, volumes_listed=True, classes=classes)
    assert volume_refusal(p, node("a"), listed) is None
    # a claim of no class, of an Immediate class or of a class that is gone sets no bound:
    # kube-scheduler places its pod nowhere until it is bound, so no extender is asked
    assert volume_refusal(pod("x"), node("a"), Storage({"ml/x": waiting_claim("x", "")})) is None
    immediate = {"local": {**LOCAL, "volumeBindingMode": "Immediate"}}
    assert volume_refusal(p, node("a"), Storage(claims, classes=immediate)) is None
    assert volume_refusal(p, node("a"), Storage(claims, classes={})) is None


def ephemeral_pod(template: dict[str, Any]) -> dict[str, Any]:
    """A pod of ml whose volume `scratch` is a generic ephemeral one of `template`."""
    p = pod()
    claim_template = {"volumeClaimTemplate": {"spec": template}}
    p["spec"]["volumes"] = [{"name": "scratch", "ephemeral": claim_template}]
    return p


def test_an_ephemeral_volume_is_judged_as_the_new_claim_its_template_makes() -> None:
    """A moved pod's new copy gets a new claim from the template: one of a class that waits for
    the pod is bound where it is placed, so only where a free volume reaches or its class
    provisions. A template that names no class gets the default one."""
    asks = {"resources": {"requests": {"storage": "1Gi"}}}
    local = ephemeral_pod({"storageClassName": "local", **asks})
    storage = Storage.from_objects([free_local("pv", "a"), LOCAL])
    assert volume_refusal(local, node("a"), storage) is None
    assert volume_refusal(local, node("b"), storage) == (
        "no volume of class local on node b is free for its claim ml/p-scratch"
    )
    unnamed = ephemeral_pod(asks)
    marked = {**LOCAL, "metadata": {"name": "local", "annotations": {DEFAULT: "true"}}}
    assert volume_refusal(unnamed, node("b"), Storage.from_objects([marked])) is not None
    assert volume_refusal(unnamed, node("b"), Storage.from_objects([LOCAL])) is None  # no default
    # made before the pod is placed, wherever its class provisions: not judged
    immediate = {**LOCAL, "volumeBindingMode": "Immediate"}
    assert volume_refusal(local, node("b"), Storage.from_objects([immediate])) is None
    assert volume_refusal(local, node("b"), Storage()) == (
        "the StorageClasses its claim ml/p-scratch needs could not be read"
    )
