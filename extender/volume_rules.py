"""Where a pod's PersistentVolumeClaims let it run, read as kube-scheduler's VolumeBinding and
VolumeZone filters read them. Pure (no I/O).

A moved pod's new copy mounts the same claims, so it may only go where their volumes reach: a
local volume's node, a zonal disk's zone. Live repacking reads the claims and volumes of the pods
it may move (`Storage`) and keeps each to the nodes `volume_refusal` passes.

What is checked, for every `persistentVolumeClaim` volume of the pod:
- the claim exists and is not being deleted, and the volume it names (`spec.volumeName`) exists;
- the volume's required node affinity matches the node's labels (VolumeBinding; matched on labels
  only, as `CheckNodeAffinity` does, so a `matchFields` requirement is not applied);
- the volume's zone and region labels (`topology.kubernetes.io/zone`, its beta name, and the
  region pair; a value may list zones joined by `__`) hold a value the node has, on a node that
  has any of those labels (VolumeZone; a beta label on the volume matches the node's GA label,
  as kube-scheduler does since 1.21).

A volume of an in-tree type migrated to CSI (`awsElasticBlockStore`, ...) is judged, on a node
whose CSINode lists its plugin as migrated, by its node affinity translated to the CSI driver
(`csi_migration.migrated_affinity`: its zone must be on the driver's zone label); elsewhere as it
is. So such a volume needs the CSINodes read (`Storage.csinodes`), or it refuses.

A claim that names no volume yet, of a class that waits for the first consumer, is bound where
kube-scheduler places the pod: to a free volume that reaches the node, or to one its class
provisions there with room (`delayed_binding`; this needs the StorageClasses, every
PersistentVolume and, for provisioned claims, the CSIDrivers and CSIStorageCapacities read). One
that must be bound first (an Immediate class, or none) fails kube-scheduler's PreFilter on every
node, so no extender sees the pod, and sets no bound here; a running pod's claims are bound.

A generic ephemeral volume is judged as the new claim its template makes (a moved pod's new copy
gets a claim of its own; the template's class, else the default one): bound where the pod is
placed if its class waits for the first consumer, else made before the pod is placed, wherever
its class provisions, which is not judged. CSI attach limits depend on the other pods on the
node: `attach_limits` counts them, with the lists `Storage` also carries.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from extender.csi_migration import Untranslatable, in_tree_plugin, migrated_affinity, migrated_on
from extender.delayed_binding import (
    binding_refusal,
    claim_class,
    default_class,
    waits_for_consumer,
)
from extender.node_rules import node_labels, node_name, selector_terms_hold
from extender.object_fields import items, labels, mapping, meta, namespace, spec

__all__ = [
    "ATTACH_KINDS",
    "ATTACH_LISTS",
    "CAPACITY_KINDS",
    "CAPACITY_LISTS",
    "Storage",
    "claim_keys",
    "pod_claims",
    "volume_refusal",
]

_BETA_ZONE = "failure-domain.beta.kubernetes.io/zone"
_BETA_REGION = "failure-domain.beta.kubernetes.io/region"
_ZONE = "topology.kubernetes.io/zone"
_REGION = "topology.kubernetes.io/region"
#: VolumeZone's labels, in its order, and the GA name a beta one is also matched under
_TOPOLOGY = (_BETA_ZONE, _BETA_REGION, _ZONE, _REGION)
_GA = {_BETA_ZONE: _ZONE, _BETA_REGION: _REGION}


def pod_claims(pod: Mapping[str, Any]) -> Iterator[tuple[str, Mapping[str, Any] | None]]:
    """Per claim the pod mounts, in order: its `namespace/name` (a volume naming no claim gives
    `namespace/`; a generic ephemeral volume's claim is `<pod>-<volume>`), and for an ephemeral
    volume its claim template's spec (None for a `persistentVolumeClaim` volume)."""
    ns, pod_name = namespace(pod), str(meta(pod).get("name") or "")
    for volume in items(spec(pod).get("volumes")):
        volume = mapping(volume)
        claim = volume.get("persistentVolumeClaim")
        if isinstance(claim, Mapping):
            yield f"{ns}/{claim.get('claimName') or ''}", None
        elif volume.get("ephemeral") is not None:
            template = spec(mapping(volume["ephemeral"]).get("volumeClaimTemplate"))
            yield f"{ns}/{pod_name}-{volume.get('name') or ''}", template


def claim_keys(pod: Mapping[str, Any]) -> list[str]:
    """`namespace/name` of every claim the pod mounts through `persistentVolumeClaim` volumes, in
    order; a volume naming no claim gives `namespace/`."""
    return [key for key, template in pod_claims(pod) if template is None]


#: the kinds `Storage.from_objects` reads, beside claims and volumes: what CSI attach limits need
#: (`attach_limits`), each with the API's plural for it
ATTACH_LISTS = {
    "CSINode": "csinodes",
    "VolumeAttachment": "volumeattachments",
    "StorageClass": "storageclasses",
}
ATTACH_KINDS = tuple(ATTACH_LISTS)
#: the kinds beside every PersistentVolume that where a waiting claim binds needs
#: (`delayed_binding`): whether a CSI driver reports its capacity, and the capacity it reports
CAPACITY_LISTS = {"CSIDriver": "csidrivers", "CSIStorageCapacity": "csistoragecapacities"}
CAPACITY_KINDS = tuple(CAPACITY_LISTS)


@dataclass(frozen=True)
class Storage:
    """The claims and volumes read for a set of pods, by `namespace/name` and by name. A key
    mapped to None was read and does not exist; a key absent was not read (the check refuses: it
    cannot tell), unless `complete` says the maps hold every claim and volume there is.

    `volumes_listed` says the volumes map holds every PersistentVolume there is (listed for
    claims that wait for their first consumer), though not every claim.

    For CSI attach limits (`attach_limits`), the cluster's CSINodes by name, its
    VolumeAttachments and its StorageClasses by name, and for claims that wait for their pod
    (`delayed_binding`) its CSIDrivers by name and its CSIStorageCapacities, each listed in
    full, or None where that list was not read."""

    claims: Mapping[str, Mapping[str, Any] | None] = field(default_factory=dict)
    volumes: Mapping[str, Mapping[str, Any] | None] = field(default_factory=dict)
    complete: bool = False
    volumes_listed: bool = False
    csinodes: Mapping[str, Mapping[str, Any]] | None = None
    attachments: Sequence[Mapping[str, Any]] | None = None
    classes: Mapping[str, Mapping[str, Any]] | None = None
    drivers: Mapping[str, Mapping[str, Any]] | None = None
    capacities: Sequence[Mapping[str, Any]] | None = None

    @classmethod
    def from_objects(
        cls,
        objects: Iterable[Mapping[str, Any]],
        listed: Iterable[str] = ATTACH_KINDS + CAPACITY_KINDS,
    ) -> Storage:
        """From full lists of PersistentVolumeClaims and PersistentVolumes, and of the kinds of
        `ATTACH_KINDS` and `CAPACITY_KINDS` in `listed` (other kinds are skipped): a claim or
        volume not among them does not exist. Such a kind not in `listed` stays unread."""
        claims: dict[str, Mapping[str, Any] | None] = {}
        volumes: dict[str, Mapping[str, Any] | None] = {}
        csinodes: dict[str, Mapping[str, Any]] = {}
        attachments: list[Mapping[str, Any]] = []
        classes: dict[str, Mapping[str, Any]] = {}
        drivers: dict[str, Mapping[str, Any]] = {}
        capacities: list[Mapping[str, Any]] = []
        for obj in objects:
            kind, called = obj.get("kind"), str(meta(obj).get("name") or "")
            if kind == "PersistentVolumeClaim":
                claims[f"{namespace(obj)}/{called}"] = obj
            elif kind == "PersistentVolume":
                volumes[called] = obj
            elif kind == "CSINode":
                csinodes[called] = obj
            elif kind == "VolumeAttachment":
                attachments.append(obj)
            elif kind == "StorageClass":
                classes[called] = obj
            elif kind == "CSIDriver":
                drivers[called] = obj
            elif kind == "CSIStorageCapacity":
                capacities.append(obj)
        kinds = set(listed)
        return cls(
            claims,
            volumes,
            complete=True,
            csinodes=csinodes if "CSINode" in kinds else None,
            attachments=attachments if "VolumeAttachment" in kinds else None,
            classes=classes if "StorageClass" in kinds else None,
            drivers=drivers if "CSIDriver" in kinds else None,
            capacities=capacities if "CSIStorageCapacity" in kinds else None,
        )

    def claim(self, key: str) -> tuple[bool, Mapping[str, Any] | None]:
        """(whether it was read, the claim or None)."""
        return (self.complete or key in self.claims, self.claims.get(key))

    def volume(self, name: str) -> tuple[bool, Mapping[str, Any] | None]:
        return (self.complete or name in self.volumes, self.volumes.get(name))

    def every_volume(self) -> list[Mapping[str, Any]] | None:
        """Every PersistentVolume, or None where they were not all read."""
        if not (self.complete or self.volumes_listed):
            return None
        return [v for v in self.volumes.values() if v is not None]


def _zones(value: str) -> set[str] | None:
    """A topology label's value as VolumeZone reads it: zones joined by `__`, each trimmed; None
    (the label is ignored) where one is empty."""
    zones = [z.strip() for z in value.split("__")]
    return None if any(not z for z in zones) else set(zones)


def _zone_refusal(volume: Mapping[str, Any], on: Mapping[str, str]) -> str | None:
    if not any(k in on for k in _TOPOLOGY):
        return None  # a node without zone labels takes any volume (a one-zone cluster)
    pv_labels = labels(volume)
    for key in _TOPOLOGY:
        if key not in pv_labels:
            continue
        zones = _zones(pv_labels[key])
        if zones is None:
            continue
        value = on.get(key, on.get(_GA.get(key, key)))
        if value is None or value not in zones:
            return f"{key} {pv_labels[key]}"
    return None


def volume_refusal(pod: Mapping[str, Any], node: Mapping[str, Any], storage: Storage) -> str | None:
    """Why the pod's claims keep it off `node`, or None (see the module docstring)."""
    on, called = node_labels(node), node_name(node)
    waiting: list[tuple[str, Mapping[str, Any]]] = []
    for key in claim_keys(pod):
        read, claim = storage.claim(key)
        if not read:
            return f"its claim {key} could not be read"
        if claim is None:
            return f"its claim {key} does not exist"
        if meta(claim).get("deletionTimestamp"):
            return f"its claim {key} is being deleted"
        pv = str(spec(claim).get("volumeName") or "")
        if not pv:
            waiting.append((key, claim))  # bound where kube-scheduler places the pod
            continue
        read, volume = storage.volume(pv)
        if not read:
            return f"volume {pv} of its claim {key} could not be read"
        if volume is None:
            return f"volume {pv} of its claim {key} does not exist"
        required = mapping(mapping(spec(volume).get("nodeAffinity")).get("required"))
        plugin = in_tree_plugin(volume)
        if plugin is not None:
            if storage.csinodes is None:
                return f"volume {pv} of its claim {key} is in-tree and the CSINodes were not read"
            if migrated_on(storage.csinodes.get(called), plugin):
                try:
                    required = migrated_affinity(volume)
                except Untranslatable as exc:
                    return f"volume {pv} of its claim {key} cannot be migrated to CSI: {exc}"
        if required and not selector_terms_hold(items(required.get("nodeSelectorTerms")), on, ""):
            return f"node {called} is outside the node affinity of volume {pv}"
        zone = _zone_refusal(volume, on)
        if zone is not None:
            return f"node {called} is outside volume {pv}'s {zone}"
    templates = [(key, t) for key, t in pod_claims(pod) if t is not None]
    if not waiting and not templates:
        return None
    return _waiting_refusal(waiting, templates, called, on, storage)


def _new_claim(
    key: str, template: Mapping[str, Any], classes: Mapping[str, Mapping[str, Any]]
) -> dict[str, Any]:
    """The claim an ephemeral volume's template makes (`key` is `namespace/name`), with the
    default class where the template names none, as the DefaultStorageClass admission sets it."""
    namespace_, _, name = key.partition("/")
    claim_spec = dict(template)
    if claim_spec.get("storageClassName") is None:
        claim_spec["storageClassName"] = default_class(classes)
    return {"metadata": {"name": name, "namespace": namespace_}, "spec": claim_spec}


def _waiting_refusal(
    claims: list[tuple[str, Mapping[str, Any]]],
    templates: list[tuple[str, Mapping[str, Any]]],
    node: str,
    on: Mapping[str, str],
    storage: Storage,
) -> str | None:
    """Why the claims that name no volume yet, and the claims the pod's ephemeral volumes will
    make (`templates`, each judged as a new claim), cannot be bound on `node`
    (`delayed_binding`)."""
    named = [(k, c) for k, c in claims if claim_class(c)]
    if not named and not templates:
        return None  # kube-scheduler places the pod nowhere before they are bound
    if storage.classes is None:
        key = (named or templates)[0][0]
        return f"the StorageClasses its claim {key} needs could not be read"
    named += [(k, _new_claim(k, t, storage.classes)) for k, t in templates]
    waiting = [(k, c) for k, c in named if waits_for_consumer(c, storage.classes)]
    if not waiting:
        return None  # kube-scheduler places the pod nowhere before they are bound
    volumes = storage.every_volume()
    if volumes is None:
        return f"the PersistentVolumes its claim {waiting[0][0]} may bind to could not be read"
    return binding_refusal(
        waiting,
        volumes,
        storage.classes,
        node,
        on,
        drivers=storage.drivers,
        capacities=storage.capacities,
    )
