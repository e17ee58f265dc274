"""Where kube-scheduler can bind a pod's claims that wait for their first consumer, read as its
VolumeBinding filter reads them. Pure (no I/O).

A claim of a `WaitForFirstConsumer` StorageClass names no volume until kube-scheduler places its
pod: a new StatefulSet replica's, say, which is what a blocked pod often is. kube-scheduler passes
a node only if every such claim gets a volume there:
- an existing PersistentVolume of the claim's class that is free (phase `Available`, bound to no
  other claim, not being deleted), large enough, of the claim's volume mode and access modes,
  matching the claim's label selector and reaching the node by its node affinity; or one already
  bound to this claim by its `claimRef`, if it reaches the node. Each volume serves one claim,
  the claims taken smallest request first, each the smallest volume that fits;
- else a new volume of the class, if the class has a provisioner (not
  `kubernetes.io/no-provisioner`, the class of statically made local volumes), its
  `allowedTopologies` admit the node and, where the provisioner is a CSI driver that reports its
  capacity (`CSIDriver.spec.storageCapacity`), one of its CSIStorageCapacity objects for the
  class reaches the node (`nodeTopology`) with room for the claim (`maximumVolumeSize`, else
  `capacity`): a local-disk driver such as TopoLVM then places a claim only where the disk has
  room.

A claim that already names a node (`volume.kubernetes.io/selected-node`: kube-scheduler chose it
and a provisioner is at work) passes only that node.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from fractions import Fraction
from typing import Any

from extender.label_selector import SelectorError, selector_matches
from extender.node_rules import selector_terms_hold
from extender.object_fields import field, items, labels, mapping, meta, namespace, spec
from extender.quantity import QuantityError, parse_quantity

__all__ = [
    "NO_PROVISIONER",
    "Unread",
    "SELECTED_NODE",
    "binding_refusal",
    "claim_class",
    "default_class",
    "matching_volume",
    "volume_class",
    "waits_for_consumer",
]

#: the provisioner of a class whose volumes are only made by hand
NO_PROVISIONER = "kubernetes.io/no-provisioner"
#: set on a claim once kube-scheduler chose the node its volume is provisioned for
SELECTED_NODE = "volume.kubernetes.io/selected-node"
#: the annotation that makes a StorageClass the default for claims that name none
DEFAULT_CLASS = "storageclass.kubernetes.io/is-default-class"
#: the class annotation that came before `storageClassName`, still read first
_BETA_CLASS = "volume.beta.kubernetes.io/storage-class"
_REQUEST = ("spec", "resources", "requests", "storage")


class Unread(Exception):
    """Something the decision needs was not read."""


def _class_of(obj: Mapping[str, Any]) -> str:
    """A claim's or a volume's class: the beta annotation first, then `spec.storageClassName`, as
    upstream's `GetPersistentVolumeClaimClass` and `GetPersistentVolumeClass` read them."""
    annotated = mapping(meta(obj).get("annotations")).get(_BETA_CLASS)
    if annotated is not None:
        return str(annotated)
    named = spec(obj).get("storageClassName")
    return named if isinstance(named, str) else ""


def claim_class(claim: Mapping[str, Any]) -> str:
    """The StorageClass a PersistentVolumeClaim asks for ("" for none)."""
    return _class_of(claim)


def volume_class(volume: Mapping[str, Any]) -> str:
    """The StorageClass a PersistentVolume belongs to ("" for none)."""
    return _class_of(volume)


def default_class(classes: Mapping[str, Mapping[str, Any]]) -> str:
    """The class the DefaultStorageClass admission gives a claim that names none: the newest of
    those marked default, or none."""
    marked = [
        (str(meta(c).get("creationTimestamp") or ""), name)
        for name, c in classes.items()
        if mapping(meta(c).get("annotations")).get(DEFAULT_CLASS) == "true"
    ]
    return max(marked)[1] if marked else ""


def waits_for_consumer(claim: Mapping[str, Any], classes: Mapping[str, Mapping[str, Any]]) -> bool:
    """Whether a claim that names no volume waits for kube-scheduler to place its pod: its class
    exists and binds `WaitForFirstConsumer`. Any other unbound claim keeps kube-scheduler from
    placing the pod anywhere (its PreFilter), so no extender is asked."""
    name = claim_class(claim)
    return bool(name) and mapping(classes.get(name)).get("volumeBindingMode") == (
        "WaitForFirstConsumer"
    )


def _storage(obj: Any, *path: str) -> Fraction | None:
    """A storage quantity (0 where absent, as upstream reads a missing one); None if unreadable."""
    value = field(obj, *path)
    if value is None:
        return Fraction(0)
    try:
        return parse_quantity(value)
    except QuantityError:
        return None


def _bound_to(volume: Mapping[str, Any], claim: Mapping[str, Any]) -> bool:
    """Whether the volume's `claimRef` names this claim (and its UID, if the ref has one)."""
    ref = mapping(spec(volume).get("claimRef"))
    if not ref:
        return False
    if ref.get("name") != meta(claim).get("name") or ref.get("namespace") != namespace(claim):
        return False
    return not ref.get("uid") or ref.get("uid") == meta(claim).get("uid")


def _mode(obj: Mapping[str, Any]) -> str:
    mode = spec(obj).get("volumeMode")
    return mode if isinstance(mode, str) else "Filesystem"


def matching_volume(
    claim: Mapping[str, Any],
    volumes: Iterable[Mapping[str, Any]],
    on: Mapping[str, str],
    taken: Iterable[str] = (),
) -> Mapping[str, Any] | None:
    """The volume kube-scheduler would bind the claim to on a node with labels `on`, of
    `volumes` (every PersistentVolume of the claim's class) less those `taken` by the pod's other
    claims; None if none would do. `SelectorError` for a claim selector upstream cannot read."""
    wanted = _storage(claim, *_REQUEST)
    selector = spec(claim).get("selector")
    modes = {str(m) for m in items(spec(claim).get("accessModes"))}
    excluded = set(taken)
    best: tuple[Fraction, Mapping[str, Any]] | None = None
    for volume in volumes:
        if str(meta(volume).get("name") or "") in excluded:
            continue
        if spec(volume).get("claimRef") is not None and not _bound_to(volume, claim):
            continue
        size = _storage(volume, "spec", "capacity", "storage")
        if wanted is None or size is None or size < wanted or _mode(volume) != _mode(claim):
            continue
        if meta(volume).get("deletionTimestamp"):
            continue
        required = mapping(mapping(spec(volume).get("nodeAffinity")).get("required"))
        reaches = not required or selector_terms_hold(
            items(required.get("nodeSelectorTerms")), on, ""
        )
        if _bound_to(volume, claim):
            return volume if reaches else None
        if field(volume, "status", "phase") != "Available":
            continue
        if selector is not None and not selector_matches(selector, labels(volume)):
            continue
        if volume_class(volume) != claim_class(claim) or not reaches:
            continue
        if not modes <= {str(m) for m in items(spec(volume).get("accessModes"))}:
            continue
        if best is None or size < best[0]:
            best = (size, volume)
    return None if best is None else best[1]


def _expression_holds(expression: Any, on: Mapping[str, str]) -> bool:
    """`key In values` of a topology selector (no values: an error upstream, so it fails)."""
    values = {str(v) for v in items(mapping(expression).get("values"))}
    return bool(values) and on.get(str(mapping(expression).get("key"))) in values


def _topology_holds(terms: Any, on: Mapping[str, str]) -> bool:
    """A class's `allowedTopologies`: none admits every node; else some term whose expressions
    all hold (a term without any admits no node)."""
    terms = items(terms)
    if not terms:
        return True
    for term in terms:
        expressions = items(mapping(term).get("matchLabelExpressions"))
        if expressions and all(_expression_holds(e, on) for e in expressions):
            return True
    return False


def _room_refusal(
    claim: Mapping[str, Any],
    class_name: str,
    provisioner: str,
    on: Mapping[str, str],
    drivers: Mapping[str, Mapping[str, Any]] | None,
    capacities: Sequence[Mapping[str, Any]] | None,
) -> bool:
    """Whether the provisioner, a CSI driver that reports its capacity, has no room for the
    claim that reaches the node (upstream's `hasEnoughCapacity`). `Unread` where the CSIDrivers
    or the CSIStorageCapacities it needs were not read."""
    if field(claim, *_REQUEST) is None:
        return False  # nothing asked, nothing to check
    if drivers is None:
        raise Unread("the CSIDrivers could not be read")
    if field(drivers.get(provisioner), "spec", "storageCapacity") is not True:
        return False
    if capacities is None:
        raise Unread("the CSIStorageCapacities could not be read")
    wanted = _storage(claim, *_REQUEST)
    if wanted is None:
        return True
    for capacity in map(mapping, capacities):
        if capacity.get("storageClassName") != class_name:
            continue
        room = capacity.get("maximumVolumeSize")
        if room is None:
            room = capacity.get("capacity")
        try:
            # both as whole bytes, rounded up, as `Quantity.Value()` gives them
            if room is None or math.ceil(parse_quantity(room)) < math.ceil(wanted):
                continue
        except QuantityError:
            continue
        topology = capacity.get("nodeTopology")
        try:
            if topology is not None and selector_matches(topology, on):
                return False
        except SelectorError:
            continue  # upstream logs it and skips the object
    return True


def binding_refusal(
    claims: Sequence[tuple[str, Mapping[str, Any]]],
    volumes: Iterable[Mapping[str, Any]],
    classes: Mapping[str, Mapping[str, Any]],
    node: str,
    on: Mapping[str, str],
    *,
    drivers: Mapping[str, Mapping[str, Any]] | None = None,
    capacities: Sequence[Mapping[str, Any]] | None = None,
) -> str | None:
    """Why kube-scheduler cannot bind the claims (`namespace/name`, claim), each waiting for its
    first consumer, on node `node` with labels `on`; or None. `volumes`: every PersistentVolume;
    `drivers`: the CSIDrivers by name, `capacities`: every CSIStorageCapacity (None where not
    read: a claim that needs them refuses)."""
    by_class: dict[str, list[Mapping[str, Any]]] = {}
    for volume in volumes:
        by_class.setdefault(volume_class(volume), []).append(volume)
    taken: set[str] = set()
    # the smallest request first, as upstream sorts them
    order = sorted(claims, key=lambda kc: _storage(kc[1], *_REQUEST) or Fraction(0))
    for key, claim in order:
        chosen = mapping(meta(claim).get("annotations")).get(SELECTED_NODE)
        if chosen is not None and chosen != node:
            return f"its claim {key} is being provisioned for node {chosen}"
        name = claim_class(claim)
        if chosen is None:
            try:
                found = matching_volume(claim, by_class.get(name, []), on, taken)
            except SelectorError as exc:
                return f"its claim {key} has a selector kube-scheduler cannot read: {exc}"
            if found is not None:
                taken.add(str(meta(found).get("name") or ""))
                continue
        cls = mapping(classes.get(name))
        provisioner = cls.get("provisioner")
        if not isinstance(provisioner, str) or not provisioner or provisioner == NO_PROVISIONER:
            return f"no volume of class {name} on node {node} is free for its claim {key}"
        if not _topology_holds(cls.get("allowedTopologies"), on):
            return f"class {name} of its claim {key} does not provision on node {node}"
        try:
            full = _room_refusal(claim, name, provisioner, on, drivers, capacities)
        except Unread as exc:
            return f"its claim {key} cannot be judged: {exc}"
        if full:
            return f"{provisioner} reports no room on node {node} for its claim {key}"
    return None
