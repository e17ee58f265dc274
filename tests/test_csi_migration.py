"""In-tree volumes translated to the CSI driver and handle kube-scheduler counts them under
(`csi_migration`); how the counts use them is `tests/test_attach_limits.py`."""

from __future__ import annotations

from typing import Any

import pytest

from extender.csi_migration import (
    MIGRATED_PLUGINS,
    Untranslatable,
    csi_driver,
    in_tree_plugin,
    migrated_affinity,
    migrated_on,
    translate_inline,
    translate_volume,
)


def pv(source: dict[str, Any], **labels: str) -> dict[str, Any]:
    return {"metadata": {"name": "pv", "labels": labels}, "spec": dict(source)}


@pytest.mark.parametrize(
    ("volume_id", "handle"),
    [("vol-1", "vol-1"), ("aws://us-east-1a/vol-1", "vol-1"), ("aws:///vol-1", "vol-1")],
)
def test_an_ebs_volume_id_is_the_bare_volume(volume_id: str, handle: str) -> None:
    source = {"awsElasticBlockStore": {"volumeID": volume_id}}
    assert translate_volume(pv(source)) == ("ebs.csi.aws.com", handle)
    assert translate_inline({"name": "d", **source}) == ("ebs.csi.aws.com", handle)


def test_a_persistent_disk_handle_carries_its_zone_or_region() -> None:
    source = {"gcePersistentDisk": {"pdName": "pd-1"}}
    zonal = "projects/UNSPECIFIED/zones/us-central1-a/disks/pd-1"
    assert translate_volume(pv(source, **{"topology.kubernetes.io/zone": "us-central1-a"})) == (
        "pd.csi.storage.gke.io",
        zonal,
    )
    # the beta label comes first
    beta = {"failure-domain.beta.kubernetes.io/zone": "us-central1-a"}
    assert translate_volume(pv(source, **beta, **{"topology.kubernetes.io/zone": "x-y-z"}))[1] == (
        zonal
    )
    regional = {"topology.kubernetes.io/zone": "us-central1-a__us-central1-b"}
    assert translate_volume(pv(source, **regional))[1] == (
        "projects/UNSPECIFIED/regions/us-central1/disks/pd-1"
    )
    unknown = "projects/UNSPECIFIED/zones/UNSPECIFIED/disks/pd-1"
    assert translate_volume(pv(source))[1] == unknown
    assert translate_inline({"name": "d", **source})[1] == unknown


def test_azure_and_cinder_disks_keep_their_ids() -> None:
    uri = "/subscriptions/s/resourceGroups/r/providers/Microsoft.Compute/disks/d1"
    azure = {"azureDisk": {"diskName": "d1", "diskURI": uri}}
    assert translate_volume(pv(azure)) == ("disk.csi.azure.com", uri)
    cinder = {"cinder": {"volumeID": "c-1"}}
    assert translate_volume(pv(cinder)) == ("cinder.csi.openstack.org", "c-1")


def test_other_kinds_are_not_translated() -> None:
    assert translate_volume(pv({"csi": {"driver": "x", "volumeHandle": "h"}})) is None
    assert translate_volume(pv({"nfs": {"server": "s", "path": "/"}})) is None
    assert translate_inline({"name": "d", "emptyDir": {}}) is None
    assert translate_inline({"name": "d", "persistentVolumeClaim": {"claimName": "c"}}) is None


@pytest.mark.parametrize(
    ("source", "labels"),
    [
        ({"awsElasticBlockStore": {"volumeID": "aws://zone/not-a-volume"}}, {}),
        ({"awsElasticBlockStore": {}}, {}),
        ({"awsElasticBlockStore": "vol-1"}, {}),  # malformed: a cluster file is not validated
        ({"gcePersistentDisk": {"pdName": "p"}}, {"topology.kubernetes.io/zone": "a__b"}),
        (
            {"gcePersistentDisk": {"pdName": "p"}},
            {"topology.kubernetes.io/zone": "us-east1-a__us-west1-a"},
        ),
        ({"azureDisk": {"diskName": "d"}}, {}),
    ],
)
def test_a_disk_that_cannot_be_named_is_untranslatable(
    source: dict[str, Any], labels: dict[str, str]
) -> None:
    with pytest.raises(Untranslatable):
        translate_volume(pv(source, **labels))


def test_in_tree_provisioners_name_their_csi_drivers() -> None:
    assert csi_driver("kubernetes.io/aws-ebs") == "ebs.csi.aws.com"
    assert csi_driver("kubernetes.io/gce-pd") == "pd.csi.storage.gke.io"
    assert csi_driver("kubernetes.io/azure-disk") == "disk.csi.azure.com"
    assert csi_driver("kubernetes.io/cinder") == "cinder.csi.openstack.org"
    assert csi_driver("ebs.csi.aws.com") == "ebs.csi.aws.com"
    assert csi_driver("kubernetes.io/no-provisioner") == "kubernetes.io/no-provisioner"


EBS_ZONE = "topology.ebs.csi.aws.com/zone"
ZONE = "topology.kubernetes.io/zone"
BETA_ZONE = "failure-domain.beta.kubernetes.io/zone"
REGION = "topology.kubernetes.io/region"
BETA_REGION = "failure-domain.beta.kubernetes.io/region"


def req(key: str, *values: str) -> dict[str, Any]:
    return {"key": key, "operator": "In", "values": list(values)}


def with_affinity(volume: dict[str, Any], *terms: list[dict[str, Any]]) -> dict[str, Any]:
    terms_ = [{"matchExpressions": t} for t in terms]
    volume["spec"]["nodeAffinity"] = {"required": {"nodeSelectorTerms": terms_}}
    return volume


def terms_of(translated: dict[str, Any]) -> list[list[dict[str, Any]]]:
    return [t["matchExpressions"] for t in translated["nodeSelectorTerms"]]


EBS = {"awsElasticBlockStore": {"volumeID": "vol-1"}}


def test_a_zone_label_becomes_a_requirement_on_the_drivers_zone_label() -> None:
    assert terms_of(migrated_affinity(pv(EBS, **{ZONE: "z1"}))) == [[req(EBS_ZONE, "z1")]]
    # zones joined by `__`, trimmed, deduplicated and sorted, as upstream's addTopology does
    assert terms_of(migrated_affinity(pv(EBS, **{BETA_ZONE: "z2__ z1__z2__"}))) == [
        [req(EBS_ZONE, "z1", "z2")]
    ]
    # added to every term the volume already has
    volume = with_affinity(pv(EBS, **{ZONE: "z1"}), [req("rack", "a")], [req("rack", "b")])
    assert terms_of(migrated_affinity(volume)) == [
        [req("rack", "a"), req(EBS_ZONE, "z1")],
        [req("rack", "b"), req(EBS_ZONE, "z1")],
    ]
    # nothing required, nothing added: no zone, or a label naming none
    assert migrated_affinity(pv(EBS)) == {}
    assert migrated_affinity(pv(EBS, **{ZONE: "__"})) == {}


def test_a_zone_requirement_is_renamed_and_the_label_then_ignored() -> None:
    volume = with_affinity(pv(EBS, **{ZONE: "z9"}), [req(ZONE, "z1"), req(REGION, "r1")])
    assert terms_of(migrated_affinity(volume)) == [[req(EBS_ZONE, "z1"), req(REGION, "r1")]]
    # the beta pair, where no GA zone is required: the region becomes the GA one
    volume = with_affinity(pv(EBS), [req(BETA_ZONE, "z1"), req(BETA_REGION, "r1")])
    assert terms_of(migrated_affinity(volume)) == [[req(EBS_ZONE, "z1"), req(REGION, "r1")]]
    # a GA zone required wins: the beta zone requirement is left as it is
    volume = with_affinity(pv(EBS), [req(ZONE, "z1")], [req(BETA_ZONE, "z2")])
    assert terms_of(migrated_affinity(volume)) == [[req(EBS_ZONE, "z1")], [req(BETA_ZONE, "z2")]]
    # the volume is not changed
    assert volume["spec"]["nodeAffinity"]["required"]["nodeSelectorTerms"][0] == {
        "matchExpressions": [req(ZONE, "z1")]
    }


def test_the_zone_in_use_is_ga_before_beta_and_affinity_before_labels() -> None:
    # a beta zone required with a GA zone label: the requirement's name is the one in use, and
    # it lists zones, so the label is not read
    volume = with_affinity(pv(EBS, **{ZONE: "z2"}), [req(BETA_ZONE, "z1")])
    assert terms_of(migrated_affinity(volume)) == [[req(EBS_ZONE, "z1")]]
    # both labels: the GA one is read
    both = migrated_affinity(pv(EBS, **{ZONE: "z1", BETA_ZONE: "z2"}))
    assert terms_of(both) == [[req(EBS_ZONE, "z1")]]
    # a zone requirement without values is not a zone: the label is added beside it
    volume = with_affinity(pv(EBS, **{ZONE: "z1"}), [{"key": ZONE, "operator": "Exists"}])
    assert terms_of(migrated_affinity(volume)) == [
        [{"key": ZONE, "operator": "Exists"}, req(EBS_ZONE, "z1")]
    ]


@pytest.mark.parametrize(
    ("source", "key"),
    [
        ({"gcePersistentDisk": {"pdName": "p"}}, "topology.gke.io/zone"),
        ({"cinder": {"volumeID": "c"}}, "topology.cinder.csi.openstack.org/zone"),
    ],
)
def test_each_driver_has_its_zone_label(source: dict[str, Any], key: str) -> None:
    assert terms_of(migrated_affinity(pv(source, **{ZONE: "z1"}))) == [[req(key, "z1")]]


def test_an_azure_disks_topology_is_kept_as_it_is() -> None:
    """kube-scheduler 1.36 places an Azure Disk volume labelled with a zone on a node with only
    the GA zone label, where its CSINode lists the plugin (tests/e2e/test_volume_rules_e2e.py)."""
    azure = {"azureDisk": {"diskName": "d", "diskURI": "u", "kind": "Managed"}}
    assert migrated_affinity(pv(azure, **{ZONE: "z1"})) == {}
    volume = with_affinity(pv(azure, **{ZONE: "z1"}), [req(ZONE, "z1")])
    assert terms_of(migrated_affinity(volume)) == [[req(ZONE, "z1")]]


def test_a_volume_upstream_cannot_translate_raises_and_another_type_is_an_error() -> None:
    with pytest.raises(Untranslatable):
        migrated_affinity(pv({"awsElasticBlockStore": {"volumeID": "aws://z1/bad"}}))
    with pytest.raises(ValueError, match="not a volume of a migrated"):
        migrated_affinity(pv({"csi": {"driver": "x", "volumeHandle": "h"}}))


def test_the_plugin_and_whether_a_node_migrated_it() -> None:
    assert in_tree_plugin(pv(EBS)) == "kubernetes.io/aws-ebs"
    assert in_tree_plugin(pv({"cinder": {"volumeID": "c"}})) == "kubernetes.io/cinder"
    assert in_tree_plugin(pv({"csi": {"driver": "x"}})) is None

    def csinode(listed: object) -> dict[str, Any]:
        return {"metadata": {"name": "n", "annotations": {MIGRATED_PLUGINS: listed}}}

    both = csinode("kubernetes.io/gce-pd,kubernetes.io/aws-ebs")
    assert migrated_on(both, "kubernetes.io/aws-ebs")
    assert not migrated_on(both, "kubernetes.io/cinder")
    # split at commas, nothing trimmed, as upstream reads it
    assert not migrated_on(
        csinode("kubernetes.io/gce-pd, kubernetes.io/aws-ebs"), "kubernetes.io/aws-ebs"
    )
    assert not migrated_on(csinode(None), "kubernetes.io/aws-ebs")
    assert not migrated_on({"metadata": {"name": "n"}}, "kubernetes.io/aws-ebs")
    assert not migrated_on(None, "kubernetes.io/aws-ebs")
