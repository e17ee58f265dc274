"""kube-scheduler's node-side rules for a pod, read as its plugins read them: `nodeSelector` and
required node affinity (NodeAffinity, with component-helpers' matching), and the taints that keep
new pods off a node (TaintToleration). Pure (no I/O).

Live repacking checks a move's target with them (`target_rules.schedulable_on`), and topology
spread counts only the nodes a pod's node affinity selects (`topology_spread`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from extender.object_fields import field, items, labels, mapping, name, spec
from extender.quantity import INTEGER

__all__ = [
    "node_labels",
    "node_name",
    "node_affinity_refusal",
    "selector_terms_hold",
    "untolerated_taint",
]

#: the taint effects that keep a new pod off a node
REPELLING = ("NoSchedule", "NoExecute")


def node_labels(node: Mapping[str, Any]) -> dict[str, str]:
    return labels(node)


def node_name(node: Mapping[str, Any]) -> str:
    return name(node)


def _expression_holds(expr: Any, node: Mapping[str, str]) -> bool:
    expr = mapping(expr)
    key, op = str(expr.get("key") or ""), expr.get("operator")
    values = [str(v) for v in items(expr.get("values"))]
    has = key in node
    if op == "In":
        return has and node[key] in values
    if op == "NotIn":
        return not has or node[key] not in values
    if op == "Exists":
        return has
    if op == "DoesNotExist":
        return not has
    if op in ("Gt", "Lt") and has and len(values) == 1:
        left, right = _go_int(node[key]), _go_int(values[0])
        if left is None or right is None:
            return False
        return left > right if op == "Gt" else left < right
    return False


def _field_holds(expr: Any, node: str) -> bool:
    """A matchFields requirement: `metadata.name` In or NotIn one name, the only field a node
    selector may name (the API server refuses others)."""
    expr = mapping(expr)
    values = [str(v) for v in items(expr.get("values"))]
    if expr.get("key") != "metadata.name" or len(values) != 1:
        return False  # a parse error to kube-scheduler: the term matches no node
    if expr.get("operator") == "In":
        return node == values[0]
    if expr.get("operator") == "NotIn":
        return node != values[0]
    return False


def _term_holds(term: Mapping[str, Any], node_labels: Mapping[str, str], node: str) -> bool:
    """A nodeSelectorTerm as component-helpers' nodeaffinity matches it: an empty term selects
    no node (it is dropped before matching), else every expression and field must hold. Fields
    are skipped for a node without a name, as there: a volume's node affinity is matched on a
    node made of labels alone, so its `matchFields` never narrow it."""
    expressions = items(term.get("matchExpressions"))
    fields = items(term.get("matchFields"))
    if not expressions and not fields:
        return False
    return all(_expression_holds(e, node_labels) for e in expressions) and (
        not node or all(_field_holds(f, node) for f in fields)
    )


def selector_terms_hold(terms: Sequence[Any], on: Mapping[str, str], node: str) -> bool:
    """Whether a NodeSelector's terms select a node with labels `on` and name `node`: any one
    term holds. A pod's node affinity and a PersistentVolume's are matched alike."""
    return any(_term_holds(t, on, node) for t in terms if isinstance(t, Mapping))


def _go_int(text: str) -> int | None:
    """A Gt/Lt operand as kube-scheduler reads it (Go's `strconv.ParseInt(s, 10, 64)`), or None
    where it fails: `int()` also takes `1_0`, other scripts' digits and values beyond int64."""
    if not INTEGER.fullmatch(text):
        return None
    value = int(text)
    return value if -(1 << 63) <= value < 1 << 63 else None


def node_affinity_refusal(pod: Mapping[str, Any], node: Mapping[str, Any]) -> str | None:
    """Why the pod's `nodeSelector` or required node affinity keeps it off `node`, or None."""
    pod_spec = spec(pod)
    on, called = labels(node), name(node)
    for key, value in mapping(pod_spec.get("nodeSelector")).items():
        if on.get(str(key)) != str(value):
            return f"node {called} does not match nodeSelector {key}={value}"
    required = field(
        pod_spec,
        "affinity",
        "nodeAffinity",
        "requiredDuringSchedulingIgnoredDuringExecution",
        "nodeSelectorTerms",
    )
    terms = [t for t in items(required) if isinstance(t, Mapping)]
    if terms and not selector_terms_hold(terms, on, called):
        return f"node {called} does not match the pod's required node affinity"
    return None


def _tolerated(taint: Mapping[str, Any], tolerations: Sequence[Any]) -> bool:
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
    tolerations = items(spec(pod).get("tolerations"))
    for taint in items(spec(node).get("taints")):
        if not isinstance(taint, Mapping) or taint.get("effect") not in REPELLING:
            continue
        if not _tolerated(taint, tolerations):
            return taint
    return None
