"""kube-scheduler's node-side rules for a pod, read as its plugins read them: `nodeSelector` and
required node affinity (NodeAffinity, with component-helpers' matching), and the taints that keep
new pods off a node (TaintToleration). Pure (no I/O).

Live repacking checks a move's target with them (`repack_policy.schedulable_on`), and topology
spread counts only the nodes a pod's node affinity selects (`topology_spread`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from extender.quantity import INTEGER

__all__ = ["node_labels", "node_name", "node_affinity_refusal", "untolerated_taint"]

#: the taint effects that keep a new pod off a node
REPELLING = ("NoSchedule", "NoExecute")


def _meta(obj: Mapping[str, Any]) -> Mapping[str, Any]:
    meta = obj.get("metadata")
    return meta if isinstance(meta, Mapping) else {}


def _spec(obj: Mapping[str, Any]) -> Mapping[str, Any]:
    spec = obj.get("spec")
    return spec if isinstance(spec, Mapping) else {}


def node_labels(node: Mapping[str, Any]) -> dict[str, str]:
    labels = _meta(node).get("labels")
    return {str(k): str(v) for k, v in labels.items()} if isinstance(labels, Mapping) else {}


def node_name(node: Mapping[str, Any]) -> str:
    return str(_meta(node).get("name") or "?")


def _expression_holds(expr: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    key, op = str(expr.get("key") or ""), expr.get("operator")
    values = [str(v) for v in expr.get("values") or ()]
    has = key in labels
    if op == "In":
        return has and labels[key] in values
    if op == "NotIn":
        return not has or labels[key] not in values
    if op == "Exists":
        return has
    if op == "DoesNotExist":
        return not has
    if op in ("Gt", "Lt") and has and len(values) == 1:
        left, right = _go_int(labels[key]), _go_int(values[0])
        if left is None or right is None:
            return False
        return left > right if op == "Gt" else left < right
    return False


def _field_holds(expr: Mapping[str, Any], name: str) -> bool:
    """A matchFields requirement: `metadata.name` In or NotIn one name, the only field a node
    selector may name (the API server refuses others)."""
    values = [str(v) for v in expr.get("values") or ()]
    if expr.get("key") != "metadata.name" or len(values) != 1:
        return False  # a parse error to kube-scheduler: the term matches no node
    if expr.get("operator") == "In":
        return name == values[0]
    if expr.get("operator") == "NotIn":
        return name != values[0]
    return False


def _term_holds(term: Mapping[str, Any], labels: Mapping[str, str], name: str) -> bool:
    """A nodeSelectorTerm as component-helpers' nodeaffinity matches it: an empty term selects
    no node (it is dropped before matching), else every expression and field must hold."""
    expressions = term.get("matchExpressions") or ()
    fields = term.get("matchFields") or ()
    if not expressions and not fields:
        return False
    return all(_expression_holds(e, labels) for e in expressions) and all(
        _field_holds(f, name) for f in fields
    )


def _go_int(text: str) -> int | None:
    """A Gt/Lt operand as kube-scheduler reads it (Go's `strconv.ParseInt(s, 10, 64)`), or None
    where it fails: `int()` also takes `1_0`, other scripts' digits and values beyond int64."""
    if not INTEGER.fullmatch(text):
        return None
    value = int(text)
    return value if -(1 << 63) <= value < 1 << 63 else None


def node_affinity_refusal(pod: Mapping[str, Any], node: Mapping[str, Any]) -> str | None:
    """Why the pod's `nodeSelector` or required node affinity keeps it off `node`, or None."""
    spec = _spec(pod)
    labels, name = node_labels(node), node_name(node)
    for key, value in (spec.get("nodeSelector") or {}).items():
        if labels.get(str(key)) != str(value):
            return f"node {name} does not match nodeSelector {key}={value}"
    required = (
        ((spec.get("affinity") or {}).get("nodeAffinity") or {}).get(
            "requiredDuringSchedulingIgnoredDuringExecution"
        )
        or {}
    ).get("nodeSelectorTerms") or []
    terms = [t for t in required if isinstance(t, Mapping)]
    if terms and not any(_term_holds(t, labels, name) for t in terms):
        return f"node {name} does not match the pod's required node affinity"
    return None


def _tolerated(taint: Mapping[str, Any], tolerations: Iterable[Any]) -> bool:
    for t in tolerations:
        if not isinstance(t, Mapping):
            continue
        if t.get("effect") and t.get("effect") != taint.get("effect"):
            continue
        if t.get("operator") == "Exists":
            if not t.get("key") or t.get("key") == taint.get("key"):
                return True
        elif t.get("key") == taint.get("key") and (t.get("value") or "") == (
            taint.get("value") or ""
        ):
            return True
    return False


def untolerated_taint(pod: Mapping[str, Any], node: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The first taint of `node` that keeps new pods off (NoSchedule, NoExecute) and that the pod
    does not tolerate, or None."""
    tolerations = _spec(pod).get("tolerations") or ()
    for taint in _spec(node).get("taints") or ():
        if not isinstance(taint, Mapping) or taint.get("effect") not in REPELLING:
            continue
        if not _tolerated(taint, tolerations):
            return taint
    return None
