"""In-tree volume types as the CSI drivers they migrated to, read as Kubernetes'
csi-translation-lib reads them. Pure (no I/O).

Clusters created before CSI took over still hold PersistentVolumes of the in-tree types (an EKS
cluster's default `gp2` class provisions `awsElasticBlockStore` volumes to this day), and pods
may mount such disks inline. Since CSI migration, kube-scheduler counts those disks against the
attach limit of the driver that now attaches them, under the handle that driver knows them by,
so the same disk in CSI form, in-tree form or inline counts once.

Translated here, as upstream translates them for NodeVolumeLimits (which counts every migrated
type wherever the node has a CSINode):

| in-tree field | provisioner | CSI driver | handle |
|---|---|---|---|
| `awsElasticBlockStore` | `kubernetes.io/aws-ebs` | `ebs.csi.aws.com` | `volumeID` without `aws://<zone>/` |
| `gcePersistentDisk` | `kubernetes.io/gce-pd` | `pd.csi.storage.gke.io` | `projects/UNSPECIFIED/zones/<zone>/disks/<pdName>` |
| `azureDisk` | `kubernetes.io/azure-disk` | `disk.csi.azure.com` | `diskURI` |
| `cinder` | `kubernetes.io/cinder` | `cinder.csi.openstack.org` | `volumeID` |

A Persistent Disk's zone comes from its volume's zone label (the beta name first, then the GA
one); several zones joined by `__` make it regional (`projects/UNSPECIFIED/regions/<region>/...`);
none, and an inline disk, give `UNSPECIFIED`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from extender.object_fields import labels, mapping, spec

__all__ = ["Untranslatable", "csi_driver", "translate_inline", "translate_volume"]

#: in-tree volume field -> (in-tree provisioner, CSI driver)
_MIGRATED: dict[str, tuple[str, str]] = {
    "awsElasticBlockStore": ("kubernetes.io/aws-ebs", "ebs.csi.aws.com"),
    "gcePersistentDisk": ("kubernetes.io/gce-pd", "pd.csi.storage.gke.io"),
    "azureDisk": ("kubernetes.io/azure-disk", "disk.csi.azure.com"),
    "cinder": ("kubernetes.io/cinder", "cinder.csi.openstack.org"),
}
_DRIVER_OF = dict(_MIGRATED.values())

_BETA_ZONE = "failure-domain.beta.kubernetes.io/zone"
_ZONE = "topology.kubernetes.io/zone"
_UNSPECIFIED = "UNSPECIFIED"


class Untranslatable(ValueError):
    """An in-tree volume whose handle cannot be made: kube-scheduler does not count such a
    PersistentVolume, and refuses a pod with such an inline volume."""


def csi_driver(provisioner: str) -> str:
    """The driver a StorageClass's volumes are attached by: a migrated in-tree provisioner's CSI
    driver, else the provisioner itself."""
    return _DRIVER_OF.get(provisioner, provisioner)


def _ebs_handle(volume_id: str) -> str:
    """`aws://<zone>/vol-x`, `aws:///vol-x` and `vol-x` are one disk: `vol-x`."""
    if not volume_id.startswith("aws://"):
        return volume_id
    path = volume_id[len("aws://") :].partition("/")[2].strip("/")
    if not path.startswith("vol-") or "/" in path:
        raise Untranslatable(f"invalid format for AWS volume ({volume_id})")
    return path


def _pd_handle(pd_name: str, zone_label: str) -> str:
    """The Persistent Disk driver's ID for disk `pd_name`: it names the zone (or, for a disk in
    several zones, their one region), so the in-tree and CSI forms of a disk match."""
    zones = zone_label.split("__")
    if len(zones) == 1 and zones[0]:
        return f"projects/{_UNSPECIFIED}/zones/{zones[0]}/disks/{pd_name}"
    if len(zones) > 1:
        regions = set()
        for zone in zones:
            parts = zone.split("-")
            if len(parts) != 3:
                raise Untranslatable(f"zone {zone!r} is not <locale>-<region>-<zone>")
            regions.add("-".join(parts[:2]))
        if len(regions) != 1:
            raise Untranslatable(f"zones {zone_label!r} are not of one region")
        return f"projects/{_UNSPECIFIED}/regions/{regions.pop()}/disks/{pd_name}"
    return f"projects/{_UNSPECIFIED}/zones/{_UNSPECIFIED}/disks/{pd_name}"


def _text(source: Mapping[str, Any], key: str) -> str:
    """A string field, or "" (a cluster file is not validated)."""
    value = source.get(key)
    return value if isinstance(value, str) else ""


def _translate(source: Mapping[str, Any], zone: str) -> tuple[str, str] | None:
    """(driver, handle) of the first migrated in-tree field of a volume source (a PV's spec or a
    pod's volume); `zone` is the volume's zone label, for a Persistent Disk's handle."""
    for key, (_, driver) in _MIGRATED.items():
        if source.get(key) is None:
            continue
        fields = mapping(source[key])
        if key == "awsElasticBlockStore":
            handle = _ebs_handle(_text(fields, "volumeID"))
        elif key == "gcePersistentDisk":
            pd_name = _text(fields, "pdName")
            handle = _pd_handle(pd_name, zone) if pd_name else ""
        elif key == "azureDisk":
            handle = _text(fields, "diskURI")
        else:
            handle = _text(fields, "volumeID")
        if not handle:
            raise Untranslatable(f"its {key} volume names no disk")
        return driver, handle
    return None


def translate_volume(pv: Mapping[str, Any]) -> tuple[str, str] | None:
    """(CSI driver, volume handle) of a PersistentVolume of a migrated in-tree type, None for any
    other; `Untranslatable` when it is of one but names no disk."""
    on = labels(pv)
    return _translate(spec(pv), on.get(_BETA_ZONE) or on.get(_ZONE) or "")


def translate_inline(volume: Mapping[str, Any]) -> tuple[str, str] | None:
    """The same for a pod's inline volume (`spec.volumes[]`); a disk inline has no zone."""
    return _translate(mapping(volume), "")
