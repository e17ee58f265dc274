"""CSI attach limits, read as kube-scheduler's NodeVolumeLimits filter reads them. Pure (no I/O).

A cloud block disk (EBS, Persistent Disk, Azure Disk) is attached to the node its pod runs on,
and a node takes only so many: the CSI driver reports how many in the node's CSINode
(`spec.drivers[].allocatable.count`). A moved pod's new copy attaches its volumes where the plan
sends it, so a move must not take that node past its limit: kube-scheduler would keep the copy
off it, and the copy would wait for a node the plan never meant.

Counted per driver, each volume once (`driver/volumeHandle`), as kube-scheduler counts them:
- a claim bound to a CSI volume (`spec.csi` of its PersistentVolume): that volume;
- a claim not bound yet: a volume of its StorageClass's provisioner, one per claim;
- a generic ephemeral volume of a pod sent to a node: likewise (its new copy gets a new claim);
- on the node: the volumes of the pods already there, and those of the VolumeAttachments that
  name it that no pod there uses, each under its attacher (kube-scheduler counts them since 1.32,
  so that a disk still detaching from a pod gone counts; vramsched counts them on every
  version). A pod that brings back a volume only an attachment holds adds it again, as
  kube-scheduler counts it.

In-tree disks (`awsElasticBlockStore`, `gcePersistentDisk`, `azureDisk`, `cinder`), as volumes,
as a StorageClass's provisioner or inline in the pod, count as the CSI driver they migrated to,
under its handle (`csi_migration`), on nodes that have a CSINode.

A pod is refused when, for a driver its volumes use, the node's volumes of that driver and the
new ones exceed the limit. Volumes of other kinds (hostPath, NFS, local), inline CSI volumes and
drivers the CSINode gives no count are not limited. What was not read (a claim, a volume, a
list) refuses: vramsched cannot count it; so does an inline in-tree disk that names no disk, as
kube-scheduler's filter fails on it.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from extender.csi_migration import (
    Untranslatable,
    csi_driver,
    in_tree_plugin,
    translate_inline,
    translate_volume,
)
from extender.delayed_binding import claim_class, default_class
from extender.node_rules import node_name
from extender.object_fields import field, items, mapping, meta, spec
from extender.volume_rules import Storage, pod_claims

__all__ = ["attach_refusal", "limits", "needs_counting"]


class _Unreadable(Exception):
    """Something the count needs was not read."""


def limits(csinode: Mapping[str, Any] | None) -> dict[str, int]:
    """Per CSI driver, the volumes the node takes (drivers without a count take any number)."""
    out: dict[str, int] = {}
    for driver in items(spec(csinode).get("drivers")):
        count = field(driver, "allocatable", "count")
        name = mapping(driver).get("name")
        if isinstance(name, str) and isinstance(count, int) and not isinstance(count, bool):
            out[name] = count
    return out


def _provisioned(class_name: str, key: str, storage: Storage) -> tuple[str, str] | None:
    """The volume a claim not bound yet will get: (driver, a name of its own), or None when its
    class is unknown (kube-scheduler does not count it then)."""
    if not class_name:
        return None
    if storage.classes is None:
        raise _Unreadable("the StorageClasses could not be read")
    # a StorageClass keeps its fields at the top level, not under `spec`
    provisioner = mapping(storage.classes.get(class_name)).get("provisioner")
    if not isinstance(provisioner, str) or not provisioner:
        return None
    driver = csi_driver(provisioner)
    return driver, f"{driver}/claim {key}"


def _bound_volume(
    name: str, storage: Storage, whose: str, *, migrated: bool = True
) -> tuple[str, str] | None:
    """(driver, volume) of PersistentVolume `name`: its `spec.csi`, or with `migrated` the CSI
    driver an in-tree disk migrated to; None when it is neither."""
    read, volume = storage.volume(name)
    if not read:
        raise _Unreadable(f"volume {name} of {whose} could not be read")
    if volume is None:
        return None
    csi = mapping(spec(volume).get("csi"))
    driver, handle = csi.get("driver"), csi.get("volumeHandle")
    if not isinstance(driver, str) or not isinstance(handle, str):
        if not migrated:
            return None
        try:
            driver, handle = translate_volume(volume) or (None, None)
        except Untranslatable:  # kube-scheduler does not count it either
            return None
        if driver is None:
            return None
    return driver, f"{driver}/{handle}"


def _claim_volume(key: str, storage: Storage, arriving: bool) -> tuple[str, str] | None:
    """The CSI volume a claim stands for, or None where kube-scheduler counts none."""
    read, claim = storage.claim(key)
    if not read:
        raise _Unreadable(f"claim {key} could not be read")
    if claim is None:
        if arriving:
            raise _Unreadable(f"claim {key} does not exist")
        return None  # kube-scheduler skips a missing claim of a pod already there
    claim_spec = spec(claim)
    volume = str(claim_spec.get("volumeName") or "")
    if volume:
        read, pv = storage.volume(volume)
        if not read or pv is not None:
            return _bound_volume(volume, storage, f"claim {key}")
    # not bound yet, or to a volume that is not there: counted by its class
    name = claim_class(claim)
    return _provisioned(name, key, storage)


def _pod_volumes(
    pod: Mapping[str, Any], storage: Storage, arriving: bool
) -> Iterator[tuple[str, str]]:
    """(driver, volume) for every counted volume of the pod. An arriving pod's generic
    ephemeral volume is a new one of its template's class: its new copy gets a claim of its own."""
    for key, template in pod_claims(pod):
        if template is not None and arriving:
            class_name = claim_class({"spec": template})
            if not class_name and storage.classes is not None:
                class_name = default_class(storage.classes)
            found = _provisioned(class_name, f"{key} (new)", storage)
        else:
            found = _claim_volume(key, storage, arriving and template is None)
        if found is not None:
            yield found


def _inline_volumes(pod: Mapping[str, Any]) -> Iterator[tuple[str, str]]:
    """(driver, volume) of the pod's inline in-tree disks, counted as their CSI driver's."""
    for volume in items(spec(pod).get("volumes")):
        try:
            found = translate_inline(mapping(volume))
        except Untranslatable as exc:
            name = mapping(volume).get("name")
            raise _Unreadable(
                f"inline volume {name} of pod {meta(pod).get('name')}: {exc}"
            ) from exc
        if found is not None:
            yield found[0], f"{found[0]}/{found[1]}"


def _has_inline(pod: Mapping[str, Any]) -> bool:
    """Whether the pod mounts an in-tree disk inline (one that names no disk counts: it refuses)."""
    try:
        return any(True for _ in _inline_volumes(pod))
    except _Unreadable:
        return True


def _counted_kind(volume: Mapping[str, Any]) -> bool:
    """Whether a volume is of a kind attach limits may count: CSI, or an in-tree disk migrated to
    it. A malformed one of those kinds is too: reading the lists for it costs little, and the
    volume rules want the CSINodes for any in-tree volume (`volume_rules`)."""
    return spec(volume).get("csi") is not None or in_tree_plugin(volume) is not None


def needs_counting(pods: Sequence[Mapping[str, Any]], storage: Storage) -> bool:
    """Whether pods sent to a node may have volumes to count against its attach limits: an
    ephemeral volume, an inline in-tree disk, or a claim not known to be bound to a volume of a
    kind not counted. Only then does `attach_refusal` need the node's CSINode, its pods' claims
    and the lists."""
    for pod in pods:
        if _has_inline(pod):
            return True
        for key, template in pod_claims(pod):
            if template is not None:
                return True
            _, found = storage.claim(key)
            pv = str(spec(found).get("volumeName") or "")
            _, bound = storage.volume(pv) if pv else (False, None)
            if bound is None or _counted_kind(bound):
                return True
    return False


def _attached(node: str, storage: Storage) -> Iterator[tuple[str, str]]:
    """(driver, volume) of every VolumeAttachment that names the node."""
    if storage.attachments is None:
        raise _Unreadable("the VolumeAttachments could not be read")
    for va in storage.attachments:
        va_spec = spec(va)
        driver = va_spec.get("attacher")
        if va_spec.get("nodeName") != node or not isinstance(driver, str):
            continue
        source = mapping(va_spec.get("source"))
        pv = source.get("persistentVolumeName")
        if isinstance(pv, str) and pv:
            # kube-scheduler reads an attachment's volume as CSI only: an in-tree disk's is not
            # counted (checked against 1.36)
            whose = f"VolumeAttachment {meta(va).get('name')}"
            found = _bound_volume(pv, storage, whose, migrated=False)
            if found is not None:  # named by its attacher, as kube-scheduler names it
                yield driver, f"{driver}/{found[1].partition('/')[2]}"
            continue
        handle = field(source, "inlineVolumeSpec", "csi", "volumeHandle")
        if isinstance(handle, str):
            yield driver, f"{driver}/{handle}"


def attach_refusal(
    node: Mapping[str, Any],
    staying: Sequence[Mapping[str, Any]],
    arriving: Sequence[Mapping[str, Any]],
    storage: Storage,
) -> str | None:
    """Why kube-scheduler's NodeVolumeLimits would keep one of `arriving` off `node`, with
    `staying` (the pods still there once the plan's moved pods have left) on it, or None."""
    name = node_name(node)
    try:
        new: dict[str, str] = {}
        for pod in arriving:
            new.update((v, d) for d, v in _pod_volumes(pod, storage, arriving=True))
        if not new and not any(_has_inline(pod) for pod in arriving):
            return None
        if storage.csinodes is None:
            raise _Unreadable("the CSINodes could not be read")
        csinode = storage.csinodes.get(name)
        if csinode is None:  # kube-scheduler then counts no in-tree disk, and has no limit
            return None
        for pod in arriving:
            new.update((v, d) for d, v in _inline_volumes(pod))
        caps = limits(csinode)
        if not caps.keys() & set(new.values()):
            return None
        there: dict[str, str] = {}
        for pod in staying:
            there.update((v, d) for d, v in _pod_volumes(pod, storage, arriving=False))
            there.update((v, d) for d, v in _inline_volumes(pod))
        attached = {v: d for d, v in _attached(name, storage) if v not in there}
    except _Unreadable as exc:
        return f"its volumes cannot be counted against node {name}'s attach limits: {exc}"
    for driver, cap in sorted(caps.items()):
        # a volume only an attachment holds is new all the same: kube-scheduler counts it twice
        added = [v for v, d in new.items() if d == driver and v not in there]
        if not added:
            continue
        count = len(added) + sum(d == driver for d in [*there.values(), *attached.values()])
        if count > cap:
            return (
                f"node {name} attaches at most {cap} volume(s) of {driver} and would hold {count}"
            )
    return None
