"""Required inter-pod affinity and anti-affinity, read as kube-scheduler's InterPodAffinity filter
reads them: may this pod run on this node, given where the other pods run? Pure (no I/O).

Live repacking checks a plan's final state with it: a moved pod whose re-created copy would break
a rule on its target waits for a node it may not use, after its old copy was evicted.

The three rules, for a pod P going to node N (a *domain* is the nodes sharing N's value of a
term's `topologyKey`; a node without that label is in no domain of it):

- each of P's anti-affinity terms: no pod matching it runs in N's domain;
- each other pod's anti-affinity terms: none that matches P is held by a pod in N's domain;
- P's affinity terms: N has every term's topology label, and in each term's domain runs a pod
  matching *all* of P's terms. The one exception is the first of a group that attracts itself:
  when no pod on a node with the term's label matches them all, and P matches all its own terms.

A term's namespaces are its `namespaces` and those its `namespaceSelector` picks; with neither, the
pod's own. A `namespaceSelector` with conditions needs the namespaces' labels, which the ledger
does not hold: such a term is taken to pick every namespace for anti-affinity and none for
affinity, the stricter reading either way. A selector that cannot be read (an unknown operator)
makes kube-scheduler refuse the pod everywhere; here it is a problem too.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from extender.label_selector import SelectorError, selector_matches
from extender.object_fields import field, items, labels, mapping, name, namespace, spec

__all__ = ["AffinityError", "affinity_problem", "has_pod_affinity"]


class AffinityError(ValueError):
    """A term kube-scheduler cannot read either."""


@dataclass(frozen=True)
class _Term:
    #: None: every namespace
    namespaces: frozenset[str] | None
    #: whether a namespaceSelector with conditions was read as "every namespace" / "none"
    unknown_namespaces: bool
    selector: Mapping[str, Any] | None
    topology_key: str


def has_pod_affinity(pod: Mapping[str, Any]) -> bool:
    """Whether the pod states any pod affinity or anti-affinity: a pod that states none matters to
    another's placement only through that one's own terms."""
    affinity = mapping(spec(pod).get("affinity"))
    return bool(affinity.get("podAffinity") or affinity.get("podAntiAffinity"))


def _terms(pod: Mapping[str, Any], kind: str) -> list[_Term]:
    """The pod's required terms of `kind` ("podAffinity" or "podAntiAffinity")."""
    raw = field(pod, "spec", "affinity", kind, "requiredDuringSchedulingIgnoredDuringExecution")
    if raw is None:
        return []
    if not isinstance(raw, list | tuple):
        raise AffinityError(f"the {kind} terms are not a list")
    out = []
    for t in raw:
        if not isinstance(t, Mapping):
            raise AffinityError(f"a {kind} term is not an object")
        names = frozenset(str(n) for n in items(t.get("namespaces")))
        ns_selector = t.get("namespaceSelector")
        unknown = False
        namespaces: frozenset[str] | None
        if not names and ns_selector is None:
            namespaces = frozenset({namespace(pod)})
        elif isinstance(ns_selector, Mapping) and (
            ns_selector.get("matchLabels") or ns_selector.get("matchExpressions")
        ):
            unknown = True
            namespaces = None if kind == "podAntiAffinity" else names
        elif isinstance(ns_selector, Mapping):
            namespaces = None  # {}: every namespace
        else:
            namespaces = names
        out.append(_Term(namespaces, unknown, t.get("labelSelector"), str(t.get("topologyKey"))))
    return out


def _matches(term: _Term, pod: Mapping[str, Any]) -> bool:
    if term.namespaces is not None and namespace(pod) not in term.namespaces:
        return False
    return selector_matches(term.selector, labels(pod))


def _domain(labels_of: Mapping[str, Mapping[str, str]], node: str, key: str) -> str | None:
    return (labels_of.get(node) or {}).get(key)


def _in_domain(
    others: Sequence[tuple[Mapping[str, Any], str]],
    labels_of: Mapping[str, Mapping[str, str]],
    key: str,
    value: str,
) -> Iterator[Mapping[str, Any]]:
    for pod, node in others:
        if _domain(labels_of, node, key) == value:
            yield pod


def affinity_problem(
    pod: Mapping[str, Any],
    node: str,
    others: Sequence[tuple[Mapping[str, Any], str]],
    labels_of: Mapping[str, Mapping[str, str]],
) -> str | None:
    """Why kube-scheduler's InterPodAffinity filter would keep `pod` off `node`, or None.

    `others`: every other pod that runs (or will run) with its node; `labels_of`: node name ->
    labels. Terms that cannot be read are a problem too (kube-scheduler refuses such a pod)."""
    try:
        return _problem(pod, node, others, labels_of)
    except (AffinityError, SelectorError) as exc:
        return f"its pod affinity cannot be read: {exc}"


def _excluding_key(
    other: Mapping[str, Any],
    where: str,
    pod: Mapping[str, Any],
    here: Mapping[str, str],
    labels_of: Mapping[str, Mapping[str, str]],
) -> str | None:
    """The topology key of `other`'s first anti-affinity term that keeps `pod` out of its domain
    (`here`: the labels of the node `pod` would go to), or None."""
    for term in _terms(other, "podAntiAffinity"):
        value = _domain(labels_of, where, term.topology_key)
        if value is not None and here.get(term.topology_key) == value and _matches(term, pod):
            return term.topology_key
    return None


def _problem(
    pod: Mapping[str, Any],
    node: str,
    others: Sequence[tuple[Mapping[str, Any], str]],
    labels_of: Mapping[str, Mapping[str, str]],
) -> str | None:
    here = labels_of.get(node) or {}
    for term in _terms(pod, "podAntiAffinity"):
        value = here.get(term.topology_key)
        if value is None:
            continue
        if any(_matches(term, o) for o in _in_domain(others, labels_of, term.topology_key, value)):
            return f"node {node}: a pod its anti-affinity excludes runs in its {term.topology_key}"
    for other, where in others:
        try:
            key = _excluding_key(other, where, pod, here, labels_of)
        except (AffinityError, SelectorError):
            continue  # kube-scheduler drops a running pod's terms it cannot read
        if key is not None:
            return f"node {node}: pod {namespace(other)}/{name(other)}'s anti-affinity excludes it from its {key}"
    terms = _terms(pod, "podAffinity")
    if not terms:
        return None
    if any(t.topology_key not in here for t in terms):
        missing = next(t.topology_key for t in terms if t.topology_key not in here)
        return f"node {node} has no {missing} label its pod affinity needs"
    # kube-scheduler counts a pod for P's affinity only when it matches all of P's terms
    counted = [(o, where) for o, where in others if all(_matches(t, o) for t in terms)]
    pairs = {
        (t.topology_key, v)
        for t in terms
        for _, where in counted
        if (v := _domain(labels_of, where, t.topology_key)) is not None
    }
    if all((t.topology_key, here[t.topology_key]) in pairs for t in terms):
        return None
    if not pairs and all(_matches(t, pod) and not t.unknown_namespaces for t in terms):
        return None  # the first of a group that attracts itself
    return f"node {node}: no pod its affinity asks for runs in the same domain"
