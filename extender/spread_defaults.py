"""The topology spread constraints a scheduler profile gives a pod that states none. Pure (no I/O).

With `defaultingType: List` (`scheduler_profile`), kube-scheduler's PodTopologySpread applies the
profile's default constraints to every pod without `topologySpreadConstraints` of its own. Each
selects the pods that look like this one (`helper.DefaultSelector`):

- the labels of every Service in the pod's namespace whose selector matches the pod, merged;
- and, when a ReplicationController, ReplicaSet or StatefulSet controls the pod and is found,
  its selector: a ReplicationController's labels merged in, a ReplicaSet's or StatefulSet's
  requirements added;
- a pod that no Service selects and no such controller owns gets no default constraint.

A model's Deployment behind a Service thus spreads its replicas by the profile's rule without
stating it. Live repacking checks a plan with these as it checks a pod's own constraints.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from extender.object_fields import items, labels, mapping, meta, name, namespace, spec

__all__ = ["SPREAD_LISTS", "SpreadDefaults", "controller_ref", "wants_defaults"]

#: the kinds the default selectors are made of, each with the API's plural for it
SPREAD_LISTS = {
    "Service": "services",
    "ReplicationController": "replicationcontrollers",
    "ReplicaSet": "replicasets",
    "StatefulSet": "statefulsets",
}

#: the controllers whose selector kube-scheduler adds: (apiVersion, kind)
_CONTROLLERS = {
    ("v1", "ReplicationController"),
    ("apps/v1", "ReplicaSet"),
    ("apps/v1", "StatefulSet"),
}


def controller_ref(pod: Mapping[str, Any]) -> tuple[str, str, str] | None:
    """(kind, namespace, name) of the ReplicationController, ReplicaSet or StatefulSet that
    controls the pod, or None (another controller, or none)."""
    for ref in items(meta(pod).get("ownerReferences")):
        ref = mapping(ref)
        if ref.get("controller") is True:
            pair = (str(ref.get("apiVersion") or ""), str(ref.get("kind") or ""))
            if pair in _CONTROLLERS and ref.get("name"):
                return pair[1], namespace(pod), str(ref["name"])
            return None
    return None


def wants_defaults(pod: Mapping[str, Any]) -> bool:
    """Whether the profile's default constraints are the pod's: it states none of its own."""
    return not items(spec(pod).get("topologySpreadConstraints"))


@dataclass(frozen=True)
class SpreadDefaults:
    """The profile's `DoNotSchedule` default constraints, with what their selectors are made of:
    every Service (of the namespaces read) and the controllers by (kind, namespace, name)."""

    constraints: tuple[Mapping[str, Any], ...]
    services: Sequence[Mapping[str, Any]] = ()
    controllers: Mapping[tuple[str, str, str], Mapping[str, Any]] = field(default_factory=dict)

    @classmethod
    def from_objects(
        cls, constraints: tuple[Mapping[str, Any], ...], objects: Iterable[Mapping[str, Any]]
    ) -> SpreadDefaults:
        """The defaults with `objects` of the `SPREAD_LISTS` kinds, each naming its "kind" (as a
        cluster file holds them, or as listed with the kind added)."""
        services, controllers = [], {}
        for o in objects:
            kind = str(o.get("kind"))
            if kind == "Service":
                services.append(o)
            elif kind in SPREAD_LISTS:
                controllers[kind, namespace(o), name(o)] = o
        return cls(constraints, services, controllers)

    def selector(self, pod: Mapping[str, Any]) -> dict[str, Any] | None:
        """The label selector the defaults count with for `pod`, or None when it would be empty
        (then the pod has no default constraint)."""
        own, ns = labels(pod), namespace(pod)
        merged: dict[str, str] = {}
        for svc in self.services:
            wanted = spec(svc).get("selector")
            if namespace(svc) != ns or not isinstance(wanted, Mapping) or not wanted:
                continue  # a Service without a selector selects no pod
            if all(own.get(str(k)) == str(v) for k, v in wanted.items()):
                merged.update({str(k): str(v) for k, v in wanted.items()})
        expressions: list[dict[str, Any]] = []
        ref = controller_ref(pod)
        owner = self.controllers.get(ref) if ref is not None else None
        if ref is not None and owner is not None:
            chosen = spec(owner).get("selector")
            if ref[0] == "ReplicationController":
                merged.update({str(k): str(v) for k, v in mapping(chosen).items()})
            elif isinstance(chosen, Mapping):
                # a ReplicaSet's or StatefulSet's requirements are added to the Services' labels
                for k, v in mapping(chosen.get("matchLabels")).items():
                    expressions.append({"key": str(k), "operator": "In", "values": [str(v)]})
                expressions += [dict(mapping(e)) for e in items(chosen.get("matchExpressions"))]
        if not merged and not expressions:
            return None
        return {"matchLabels": merged, "matchExpressions": expressions}

    def for_pod(self, pod: Mapping[str, Any]) -> list[dict[str, Any]]:
        """The default constraints `pod` gets, each with its selector; [] for a pod that states
        its own constraints or whose selector would be empty."""
        if not self.constraints or not wants_defaults(pod):
            return []
        selector = self.selector(pod)
        if selector is None:
            return []
        return [{**c, "labelSelector": selector} for c in self.constraints]
