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

On a node whose CSINode lists a type's in-tree plugin as migrated (`migrated_on`), VolumeBinding
also judges a PersistentVolume of that type by its translated node affinity (`migrated_affinity`):
its zone requirement, or else its zone label, names the driver's own zone label (EBS
`topology.ebs.csi.aws.com/zone`, Persistent Disk `topology.gke.io/zone`, Cinder
`topology.cinder.csi.openstack.org/zone`), which the driver's node plugin sets. A node without
that label cannot take the volume there. An Azure Disk volume's node affinity is kept as it is
(kube-scheduler 1.36 places one with a zone label on a node with only the GA zone label).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from extender.object_fields import items, labels, mapping, meta, spec

__all__ = [
    "MIGRATED_PLUGINS",
    "Untranslatable",
    "csi_driver",
    "in_tree_plugin",
    "migrated_affinity",
    "migrated_on",
    "translate_inline",
    "translate_volume",
]

#: in-tree volume field -> (in-tree plugin, which is also its provisioner; CSI driver; the
#: driver's zone label its volumes' zones are translated to, None where they are not)
_MIGRATED: dict[str, tuple[str, str, str | None]] = {
    "awsElasticBlockStore": (
        "kubernetes.io/aws-ebs",
        "ebs.csi.aws.com",
        "topology.ebs.csi.aws.com/zone",
    ),
    "gcePersistentDisk": ("kubernetes.io/gce-pd", "pd.csi.storage.gke.io", "topology.gke.io/zone"),
    "azureDisk": ("kubernetes.io/azure-disk", "disk.csi.azure.com", None),
    "cinder": (
        "kubernetes.io/cinder",
        "cinder.csi.openstack.org",
        "topology.cinder.csi.openstack.org/zone",
    ),
}
_DRIVER_OF = {plugin: driver for plugin, driver, _ in _MIGRATED.values()}

#: the CSINode annotation listing, comma-separated, the in-tree plugins whose volumes the node's
#: kubelet hands to their CSI drivers
MIGRATED_PLUGINS = "storage.alpha.kubernetes.io/migrated-plugins"

_BETA_ZONE = "failure-domain.beta.kubernetes.io/zone"
_ZONE = "topology.kubernetes.io/zone"
_BETA_REGION = "failure-domain.beta.kubernetes.io/region"
_REGION = "topology.kubernetes.io/region"
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
    for key, (_, driver, _) in _MIGRATED.items():
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


def in_tree_plugin(pv: Mapping[str, Any]) -> str | None:
    """The in-tree plugin of a PersistentVolume of a migrated type (`kubernetes.io/aws-ebs`, ...),
    None for any other."""
    source = spec(pv)
    return next((p for key, (p, _, _) in _MIGRATED.items() if source.get(key) is not None), None)


def migrated_on(csinode: Mapping[str, Any] | None, plugin: str) -> bool:
    """Whether a node's CSINode (None: it has none) lists `plugin` as migrated: only there does
    VolumeBinding judge the plugin's volumes by their translated node affinity. The list is read
    as upstream reads it, split at commas with nothing trimmed."""
    listed = mapping(meta(csinode).get("annotations")).get(MIGRATED_PLUGINS)
    return isinstance(listed, str) and plugin in listed.split(",")


def _requirements(term: Any) -> list[dict[str, Any]]:
    """A node selector term's `matchExpressions`, each copied (a malformed one as an empty one)."""
    return [dict(mapping(r)) for r in items(mapping(term).get("matchExpressions"))]


def _values(terms: list[dict[str, Any]], key: str) -> set[str]:
    """Every value the terms' requirements on `key` list."""
    return {
        str(v)
        for t in terms
        for r in t["matchExpressions"]
        if r.get("key") == key
        for v in items(r.get("values"))
    }


def _rename(terms: list[dict[str, Any]], old: str, new: str) -> None:
    for term in terms:
        for requirement in term["matchExpressions"]:
            if requirement.get("key") == old:
                requirement["key"] = new


def migrated_affinity(pv: Mapping[str, Any]) -> dict[str, Any]:
    """The `spec.nodeAffinity.required` of an in-tree PersistentVolume translated to its CSI
    driver, as csi-translation-lib translates it: the zone label in use (GA before beta, node
    affinity before the volume's labels) becomes the driver's zone label in every requirement;
    where no requirement lists a zone, the volume's zone label's zones (joined by `__`) are
    required of the driver's label in every term; a beta region requirement becomes the GA one.
    An Azure Disk volume's is left as it is. Empty where nothing is required.

    `Untranslatable` where upstream's translation fails (an EBS volume ID or Persistent Disk
    zones it cannot read; also a volume naming no disk, which the API server does not store):
    kube-scheduler then refuses the volume on every node it is migrated on. `ValueError` for a
    volume of no migrated type (see `in_tree_plugin`)."""
    kind = next((k for k in _MIGRATED if spec(pv).get(k) is not None), None)
    if kind is None:
        raise ValueError("not a volume of a migrated in-tree type")
    translate_volume(pv)
    required = mapping(mapping(spec(pv).get("nodeAffinity")).get("required"))
    zone_key = _MIGRATED[kind][2]
    if zone_key is None:
        return dict(required)
    raw_terms = items(required.get("nodeSelectorTerms"))
    terms = [{**mapping(t), "matchExpressions": _requirements(t)} for t in raw_terms]
    on = labels(pv)
    used = {str(r.get("key")) for t in terms for r in t["matchExpressions"]}
    if _ZONE in used or (_BETA_ZONE not in used and (_ZONE in on or _BETA_ZONE not in on)):
        zone, region = _ZONE, _REGION
    else:
        zone, region = _BETA_ZONE, _BETA_REGION
    if _values(terms, zone):
        _rename(terms, zone, zone_key)
    elif zone in on:
        zones = sorted({z.strip() for z in on[zone].split("__")} - {""})
        if zones:
            terms = terms or [{"matchExpressions": []}]
            for term in terms:
                term["matchExpressions"].append(
                    {"key": zone_key, "operator": "In", "values": zones}
                )
    if region == _BETA_REGION and _values(terms, region):
        _rename(terms, region, _REGION)
    if not terms and not required:
        return {}
    return {**required, "nodeSelectorTerms": terms}
