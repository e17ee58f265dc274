"""Pod topology spread constraints that refuse a node (`whenUnsatisfiable: DoNotSchedule`), read as
kube-scheduler's PodTopologySpread filter reads them. Pure (no I/O).

Live repacking checks a plan's final state with it: moving one replica of a model spread over
zones or nodes can leave its re-created copy with no domain it may use.

For a pod P going to node N, for each such constraint (selector: `labelSelector`, plus P's own
value of each `matchLabelKeys` key):

- N must have the constraint's topology label;
- the pods counted are those in P's namespace, not being deleted, that the selector matches, on
  nodes that have every constraint's topology label and pass P's node affinity
  (`nodeAffinityPolicy`, default Honor) and, when asked (`nodeTaintsPolicy: Honor`; default
  Ignore), whose taints P tolerates; each such node's value is a domain, even with no pod;
- the pods in N's domain, plus one if P matches the selector, minus the fewest in any domain
  (0 while there are fewer domains than `minDomains`) may not exceed `maxSkew`.

A pod that states no constraint gets the scheduler profile's `DoNotSchedule` default ones
(`spread_defaults`, given as `defaults`; without, none: the system defaults are ScheduleAnyway
and refuse no node).

An empty selector (`{}`) counts every pod of the namespace. kube-scheduler 1.27 to 1.36 count none
with it (a short cut for null selectors that caught `{}` too; fixed upstream after 1.36), so there
vramsched is the stricter: it may keep a pod off a node that kube-scheduler would allow, never the
other way round.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from extender.label_selector import SelectorError, selector_matches
from extender.node_rules import node_affinity_refusal, node_labels, untolerated_taint
from extender.object_fields import items, labels, mapping, meta, namespace, spec
from extender.spread_defaults import SpreadDefaults

__all__ = ["spread_problem", "has_hard_spread"]


@dataclass(frozen=True)
class _Constraint:
    max_skew: int
    key: str
    selector: Mapping[str, Any] | None
    min_domains: int
    honor_affinity: bool
    honor_taints: bool


def _hard(pod: Mapping[str, Any], defaults: SpreadDefaults | None) -> Sequence[Mapping[str, Any]]:
    raw = items(spec(pod).get("topologySpreadConstraints"))
    if not raw and defaults is not None:
        return defaults.for_pod(pod)
    return [
        c for c in raw if isinstance(c, Mapping) and c.get("whenUnsatisfiable") == "DoNotSchedule"
    ]


def has_hard_spread(pod: Mapping[str, Any], defaults: SpreadDefaults | None = None) -> bool:
    """Whether the pod has a spread constraint that can refuse a node: its own, or else one of
    the profile's `defaults`."""
    return bool(_hard(pod, defaults))


def _constraints(pod: Mapping[str, Any], defaults: SpreadDefaults | None) -> list[_Constraint]:
    own = labels(pod)
    out = []
    for c in _hard(pod, defaults):
        selector = c.get("labelSelector")
        keys = [str(k) for k in items(c.get("matchLabelKeys")) if str(k) in own]
        if keys:
            # kube-scheduler adds P's value of each key to the selector (the API server may have
            # added it already: adding it twice selects the same pods)
            base = mapping(selector)
            selector = {
                "matchLabels": {**mapping(base.get("matchLabels")), **{k: own[k] for k in keys}},
                "matchExpressions": list(items(base.get("matchExpressions"))),
            }
        try:
            max_skew = int(c.get("maxSkew") or 0)
            min_domains = int(c.get("minDomains") or 1)
        except (TypeError, ValueError):
            raise SelectorError("maxSkew or minDomains is not a number") from None
        out.append(
            _Constraint(
                max_skew,
                str(c.get("topologyKey") or ""),
                selector,
                min_domains,
                c.get("nodeAffinityPolicy", "Honor") != "Ignore",
                c.get("nodeTaintsPolicy", "Ignore") == "Honor",
            )
        )
    return out


def spread_problem(
    pod: Mapping[str, Any],
    node: str,
    others: Sequence[tuple[Mapping[str, Any], str]],
    nodes: Mapping[str, Mapping[str, Any]],
    defaults: SpreadDefaults | None = None,
) -> str | None:
    """Why kube-scheduler's PodTopologySpread filter would keep `pod` off `node`, or None.

    `others`: every other pod that runs (or will run) with its node; `nodes`: every node by name;
    `defaults`: the scheduler profile's, for a pod that states no constraint.
    A constraint that cannot be read is a problem too (kube-scheduler refuses such a pod)."""
    try:
        constraints = _constraints(pod, defaults)
        if not constraints:
            return None
        return _problem(pod, node, constraints, others, nodes)
    except SelectorError as exc:
        return f"its topology spread cannot be read: {exc}"


def _problem(
    pod: Mapping[str, Any],
    node: str,
    constraints: list[_Constraint],
    others: Sequence[tuple[Mapping[str, Any], str]],
    nodes: Mapping[str, Mapping[str, Any]],
) -> str | None:
    here = node_labels(nodes[node]) if node in nodes else {}
    for c in constraints:
        if c.key not in here:
            return f"node {node} has no {c.key} label its topology spread needs"
    own_namespace = namespace(pod)
    by_node: dict[str, list[Mapping[str, Any]]] = defaultdict(list)
    for other, where in others:
        if namespace(other) == own_namespace and not meta(other).get("deletionTimestamp"):
            by_node[where].append(other)
    counts: list[dict[str, int]] = [{} for _ in constraints]
    for name, obj in nodes.items():
        on = node_labels(obj)
        if any(c.key not in on for c in constraints):
            continue
        affinity_ok = node_affinity_refusal(pod, obj) is None
        taints_ok: bool | None = None
        for i, c in enumerate(constraints):
            if c.honor_affinity and not affinity_ok:
                continue
            if c.honor_taints:
                if taints_ok is None:
                    taints_ok = untolerated_taint(pod, obj) is None
                if not taints_ok:
                    continue
            value = on[c.key]
            matched = sum(selector_matches(c.selector, labels(p)) for p in by_node.get(name, ()))
            counts[i][value] = counts[i].get(value, 0) + matched
    own = labels(pod)
    for i, c in enumerate(constraints):
        domains = counts[i]
        fewest = min(domains.values()) if domains else 1 << 31
        if len(domains) < c.min_domains:
            fewest = 0
        value = here[c.key]
        skew = domains.get(value, 0) + int(selector_matches(c.selector, own)) - fewest
        if skew > c.max_skew:
            return (
                f"node {node}: its {c.key} {value} would hold {skew} more matching pods than the "
                f"emptiest domain, over its maxSkew {c.max_skew}"
            )
    return None
