"""In-tree volumes translated to the CSI driver and handle kube-scheduler counts them under
(`csi_migration`); how the counts use them is `tests/test_attach_limits.py`."""

from __future__ import annotations

from typing import Any

import pytest

from extender.csi_migration import Untranslatable, csi_driver, translate_inline, translate_volume


def pv(source: dict[str, Any], **labels: str) -> dict[str, Any]:
    return {"metadata": {"name": "pv", "labels": labels}, "spec": source}


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
