"""CSI attach limits (`attach_limits.attach_refusal`) on hand-built objects; the same rule against
a real kube-scheduler is `tests/e2e/test_attach_limits_e2e.py`."""

from __future__ import annotations

from typing import Any

import pytest

from extender.attach_limits import attach_refusal, limits, needs_counting
from extender.volume_rules import Storage

A, B = "a.csi.example.com", "b.csi.example.com"
NODE = {"metadata": {"name": "n1"}}


def csinode(name: str, **counts: int | None) -> dict[str, Any]:
    drivers = []
    for driver, count in counts.items():
        entry: dict[str, Any] = {"name": driver.replace("_", "."), "nodeID": name}
        if count is not None:
            entry["allocatable"] = {"count": count}
        drivers.append(entry)
    return {"kind": "CSINode", "metadata": {"name": name}, "spec": {"drivers": drivers}}


def volume(name: str, driver: str | None = A) -> dict[str, Any]:
    source: dict[str, Any] = (
        {"csi": {"driver": driver, "volumeHandle": f"h-{name}"}}
        if driver
        else {"hostPath": {"path": f"/tmp/{name}"}}
    )
    return {"kind": "PersistentVolume", "metadata": {"name": name}, "spec": source}


def claim(name: str, pv: str | None, klass: str | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {}
    if pv is not None:
        spec["volumeName"] = pv
    if klass is not None:
        spec["storageClassName"] = klass
    meta = {"name": name, "namespace": "default"}
    return {"kind": "PersistentVolumeClaim", "metadata": meta, "spec": spec}


def storage_class(name: str, provisioner: str, default: bool = False) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name}
    if default:
        meta["annotations"] = {"storageclass.kubernetes.io/is-default-class": "true"}
    return {"kind": "StorageClass", "metadata": meta, "provisioner": provisioner}


def attachment(pv: str, node: str = "n1", driver: str = A) -> dict[str, Any]:
    spec = {"attacher": driver, "nodeName": node, "source": {"persistentVolumeName": pv}}
    return {"kind": "VolumeAttachment", "metadata": {"name": f"va-{pv}"}, "spec": spec}


def pod(name: str, *claims: str, ephemeral: dict[str, Any] | None = None) -> dict[str, Any]:
    volumes: list[dict[str, Any]] = [
        {"name": f"v{i}", "persistentVolumeClaim": {"claimName": c}} for i, c in enumerate(claims)
    ]
    if ephemeral is not None:
        volumes.append({"name": "scratch", "ephemeral": {"volumeClaimTemplate": ephemeral}})
    return {"metadata": {"name": name, "namespace": "default"}, "spec": {"volumes": volumes}}


def scene(*extra: dict[str, Any], limit: int | None = 1) -> Storage:
    """Node n1 takes `limit` volumes of driver A and one of B; PVs pa1..pa3 (A), pb1 (B), ph
    (hostPath), each with a claim c-<pv>."""
    pvs = [volume("pa1"), volume("pa2"), volume("pa3"), volume("pb1", B), volume("ph", None)]
    claims = [claim(f"c-{v['metadata']['name']}", v["metadata"]["name"]) for v in pvs]
    objects = [csinode("n1", a_csi_example_com=limit, b_csi_example_com=1), *pvs, *claims]
    return Storage.from_objects([*objects, *extra])


def test_limits_read_counts_and_skip_drivers_without_one() -> None:
    assert limits(csinode("n1", a_csi_example_com=3, b_csi_example_com=None)) == {A: 3}
    assert limits(None) == {}
    # a count of the wrong type is no count (a cluster file is not validated)
    assert limits({"spec": {"drivers": [{"name": A, "allocatable": {"count": "3"}}]}}) == {}


def test_a_new_volume_past_the_limit_is_refused() -> None:
    why = attach_refusal(NODE, [pod("holder", "c-pa1")], [pod("p", "c-pa2")], scene())
    assert why == f"node n1 attaches at most 1 volume(s) of {A} and would hold 2"


def test_a_volume_already_there_counts_once() -> None:
    assert attach_refusal(NODE, [pod("holder", "c-pa1")], [pod("p", "c-pa1")], scene()) is None


def test_room_left_under_the_limit() -> None:
    storage = scene(limit=2)
    assert attach_refusal(NODE, [pod("holder", "c-pa1")], [pod("p", "c-pa2")], storage) is None
    # two pods sent to one node are counted together
    both = [pod("p", "c-pa2"), pod("q", "c-pa3")]
    assert attach_refusal(NODE, [pod("holder", "c-pa1")], both, storage) is not None


def test_other_drivers_and_other_volumes_are_not_limited_by_it() -> None:
    storage = scene()
    holder = [pod("holder", "c-pa1")]
    assert attach_refusal(NODE, holder, [pod("p", "c-pb1")], storage) is None
    assert attach_refusal(NODE, holder, [pod("p", "c-ph")], storage) is None
    assert attach_refusal(NODE, holder, [pod("p")], storage) is None


def test_no_count_or_no_csinode_sets_no_limit() -> None:
    storage = scene(limit=None)
    assert attach_refusal(NODE, [pod("holder", "c-pa1")], [pod("p", "c-pa2")], storage) is None
    other = {"metadata": {"name": "n2"}}  # no CSINode at all
    assert attach_refusal(other, [pod("holder", "c-pa1")], [pod("p", "c-pa2")], scene()) is None


def test_volume_attachments_on_the_node_count() -> None:
    storage = scene(attachment("pa1"), limit=1)
    assert attach_refusal(NODE, [], [pod("p", "c-pa2")], storage) is not None
    # the attachment of a volume a pod there uses is the same volume
    storage = scene(attachment("pa1"), limit=2)
    assert attach_refusal(NODE, [pod("holder", "c-pa1")], [pod("p", "c-pa2")], storage) is None
    # one on another node does not count here
    storage = scene(attachment("pa1", node="n2"), limit=1)
    assert attach_refusal(NODE, [], [pod("p", "c-pa2")], storage) is None
    # a volume only an attachment holds, brought back by a pod, counts twice (kube-scheduler)
    assert attach_refusal(NODE, [], [pod("p", "c-pa1")], scene(attachment("pa1"), limit=2)) is None
    assert attach_refusal(NODE, [], [pod("p", "c-pa1")], scene(attachment("pa1"), limit=1))
    # an attachment counts under its attacher, whatever its volume's driver
    storage = scene(attachment("pa1", driver=B), limit=1)
    assert attach_refusal(NODE, [], [pod("p", "c-pa2")], storage) is None
    assert attach_refusal(NODE, [], [pod("p", "c-pb1")], storage) is not None


def test_claims_not_bound_count_as_new_volumes_of_their_class() -> None:
    sc = storage_class("fast", A)
    storage = scene(sc, claim("c-new", None, "fast"), claim("c-new2", None, "fast"), limit=2)
    assert attach_refusal(NODE, [pod("holder", "c-pa1")], [pod("p", "c-new")], storage) is None
    why = attach_refusal(NODE, [pod("holder", "c-pa1")], [pod("p", "c-new", "c-new2")], storage)
    assert why == f"node n1 attaches at most 2 volume(s) of {A} and would hold 3"
    # a class that is not there, or no class: not counted, as kube-scheduler does
    storage = scene(claim("c-lost-class", None, "gone"), claim("c-no-class", None))
    holder = [pod("holder", "c-pa1")]
    assert attach_refusal(NODE, holder, [pod("p", "c-lost-class", "c-no-class")], storage) is None


def test_an_ephemeral_volume_of_a_moved_pod_is_a_new_one() -> None:
    template = {"spec": {"storageClassName": "fast"}}
    storage = scene(storage_class("fast", A))
    moved = pod("p", ephemeral=template)
    assert attach_refusal(NODE, [pod("holder", "c-pa1")], [moved], storage) is not None
    assert attach_refusal(NODE, [], [moved], storage) is None
    # a template naming no class gets the default one
    storage = scene(storage_class("slow", B), storage_class("fast", A, default=True))
    assert attach_refusal(NODE, [pod("holder", "c-pa1")], [pod("p", ephemeral={})], storage)


def test_an_ephemeral_volume_of_a_pod_there_is_its_claim() -> None:
    # the claim of pod `holder`'s volume `scratch` is `holder-scratch`, bound to pa1
    storage = scene(claim("holder-scratch", "pa1"))
    holder = pod("holder", ephemeral={"spec": {}})
    assert attach_refusal(NODE, [holder], [pod("p", "c-pa2")], storage) is not None
    assert attach_refusal(NODE, [holder], [pod("p", "c-pa1")], storage) is None


def test_a_missing_claim_of_a_pod_there_is_not_counted() -> None:
    assert attach_refusal(NODE, [pod("holder", "c-gone")], [pod("p", "c-pa1")], scene()) is None


@pytest.mark.parametrize(
    ("storage", "why"),
    [
        (Storage(claims={"default/c-pa2": claim("c-pa2", "pa2")}), "volume pa2 of claim"),
        (Storage(), "claim default/c-pa2 could not be read"),
        (
            Storage.from_objects([volume("pa2"), claim("c-pa2", "pa2")], listed=()),
            "the CSINodes could not be read",
        ),
        (
            Storage.from_objects(
                [csinode("n1", a_csi_example_com=2), volume("pa2"), claim("c-pa2", "pa2")],
                listed=("CSINode",),
            ),
            "the VolumeAttachments could not be read",
        ),
    ],
)
def test_what_was_not_read_refuses(storage: Storage, why: str) -> None:
    refusal = attach_refusal(NODE, [], [pod("p", "c-pa2")], storage)
    assert refusal is not None and why in refusal, refusal
    assert refusal.startswith("its volumes cannot be counted against node n1's attach limits")


def test_nothing_to_count_needs_nothing_read() -> None:
    assert attach_refusal(NODE, [pod("holder", "c-x")], [pod("p")], Storage()) is None


EBS, PD = "ebs.csi.aws.com", "pd.csi.storage.gke.io"


def in_tree(name: str, source: dict[str, Any], **labels: str) -> dict[str, Any]:
    """A PersistentVolume of an in-tree type, as clusters made before CSI migration hold them."""
    meta: dict[str, Any] = {"name": name, "labels": labels}
    return {"kind": "PersistentVolume", "metadata": meta, "spec": source}


def with_inline(name: str, *sources: dict[str, Any]) -> dict[str, Any]:
    """A pod that mounts in-tree disks inline, no claim."""
    volumes = [{"name": f"d{i}", **s} for i, s in enumerate(sources)]
    return {"metadata": {"name": name, "namespace": "default"}, "spec": {"volumes": volumes}}


def migrated_scene(*extra: dict[str, Any], ebs: int = 1) -> Storage:
    """n1 takes `ebs` EBS disks and one Persistent Disk; pv e-held is the in-tree EBS disk
    vol-held (claim c-e-held), e-new another, csi-held the CSI form of vol-held, g-held a zonal
    in-tree Persistent Disk."""
    pvs = [
        in_tree("e-held", {"awsElasticBlockStore": {"volumeID": "aws://us-east-1a/vol-held"}}),
        in_tree("e-new", {"awsElasticBlockStore": {"volumeID": "vol-new"}}),
        {
            "kind": "PersistentVolume",
            "metadata": {"name": "csi-held"},
            "spec": {"csi": {"driver": EBS, "volumeHandle": "vol-held"}},
        },
        in_tree(
            "g-held",
            {"gcePersistentDisk": {"pdName": "pd-held"}},
            **{"topology.kubernetes.io/zone": "us-central1-a"},
        ),
        {
            "kind": "PersistentVolume",
            "metadata": {"name": "g-csi"},
            "spec": {
                "csi": {
                    "driver": PD,
                    "volumeHandle": "projects/UNSPECIFIED/zones/us-central1-a/disks/pd-held",
                }
            },
        },
        in_tree("g-new", {"gcePersistentDisk": {"pdName": "pd-new"}}),
    ]
    claims = [claim(f"c-{v['metadata']['name']}", v["metadata"]["name"]) for v in pvs]
    counts = {"ebs_csi_aws_com": ebs, "pd_csi_storage_gke_io": 1}
    return Storage.from_objects([csinode("n1", **counts), *pvs, *claims, *extra])


def test_in_tree_disks_count_as_the_csi_driver_they_migrated_to() -> None:
    storage = migrated_scene()
    holder = [pod("holder", "c-e-held", "c-g-held")]
    why = attach_refusal(NODE, holder, [pod("p", "c-e-new")], storage)
    assert why == f"node n1 attaches at most 1 volume(s) of {EBS} and would hold 2"
    assert attach_refusal(NODE, holder, [pod("p", "c-g-new")], storage) is not None
    assert attach_refusal(NODE, holder, [pod("p", "c-e-new")], migrated_scene(ebs=2)) is None
    # the same disk in CSI form, or in-tree with its zone spelled into the handle, counts once
    assert attach_refusal(NODE, holder, [pod("p", "c-csi-held")], storage) is None
    assert attach_refusal(NODE, holder, [pod("p", "c-g-csi")], storage) is None


def test_inline_in_tree_disks_count_on_nodes_with_a_csinode() -> None:
    storage = migrated_scene()
    holder = [pod("holder", "c-e-held")]
    new = with_inline("p", {"awsElasticBlockStore": {"volumeID": "vol-inline"}})
    assert attach_refusal(NODE, holder, [new], storage) is not None
    assert attach_refusal(NODE, [], [new], storage) is None
    # `aws://<zone>/vol-held` inline is the disk the holder's volume holds
    same = with_inline("p", {"awsElasticBlockStore": {"volumeID": "aws://us-east-1a/vol-held"}})
    assert attach_refusal(NODE, holder, [same], storage) is None
    # a pod there that holds a disk inline counts it too
    assert attach_refusal(NODE, [new], [pod("p", "c-e-new")], storage) is not None
    # no CSINode: kube-scheduler counts no in-tree disk there
    assert attach_refusal({"metadata": {"name": "n2"}}, holder, [new], storage) is None


def test_an_inline_disk_that_names_no_disk_refuses_where_counted() -> None:
    bad = with_inline("p", {"awsElasticBlockStore": {"volumeID": "aws://us-east-1a/not-a-volume"}})
    why = attach_refusal(NODE, [], [bad], migrated_scene())
    assert why is not None and "inline volume d0 of pod p" in why, why
    assert attach_refusal({"metadata": {"name": "n2"}}, [], [bad], migrated_scene()) is None


def test_an_in_tree_class_provisions_for_its_csi_driver() -> None:
    sc = storage_class("gp2", "kubernetes.io/aws-ebs")
    storage = migrated_scene(sc, claim("c-unbound", None, "gp2"))
    why = attach_refusal(NODE, [pod("holder", "c-e-held")], [pod("p", "c-unbound")], storage)
    assert why == f"node n1 attaches at most 1 volume(s) of {EBS} and would hold 2"


def test_an_attachment_of_an_in_tree_volume_is_not_counted() -> None:
    # kube-scheduler reads an attachment's volume only as CSI (1.36, the e2e test)
    storage = migrated_scene(attachment("e-held", driver=EBS))
    assert attach_refusal(NODE, [], [pod("p", "c-e-new")], storage) is None
    # the CSI form of the same disk, attached, counts
    storage = migrated_scene(attachment("csi-held", driver=EBS))
    assert attach_refusal(NODE, [], [pod("p", "c-e-new")], storage) is not None


def test_needs_counting_sees_in_tree_disks() -> None:
    storage = migrated_scene(volume("ph", None), claim("c-ph", "ph"))
    assert needs_counting([pod("p", "c-e-new")], storage)
    assert needs_counting([with_inline("p", {"gcePersistentDisk": {"pdName": "x"}})], storage)
    assert not needs_counting([pod("p", "c-ph")], storage)
    assert not needs_counting([with_inline("p", {"emptyDir": {}})], storage)
    # an in-tree volume upstream cannot translate counts nothing, but its pod needs the CSINodes
    # read all the same: the volume rules refuse it where its plugin is migrated
    bad = in_tree("e-bad", {"awsElasticBlockStore": {"volumeID": "aws://z/not-a-volume"}})
    storage = migrated_scene(bad, claim("c-e-bad", "e-bad"))
    assert needs_counting([pod("p", "c-e-bad")], storage)
