"""Kubernetes label selectors (metav1.LabelSelector) matched as apimachinery matches them. Pure.

A null selector selects nothing and `{}` everything, as `LabelSelectorAsSelector` reads them. An
operator other than In, NotIn, Exists and DoesNotExist is an error there, and here
(`SelectorError`): kube-scheduler then refuses the pod that states it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["SelectorError", "selector_matches"]


class SelectorError(ValueError):
    """A selector apimachinery cannot read either."""


def selector_matches(selector: Any, labels: Mapping[str, str]) -> bool:
    """Whether `labels` match `selector` (None: no labels do)."""
    if selector is None:
        return False
    if not isinstance(selector, Mapping):
        raise SelectorError("a labelSelector is not an object")
    match_labels = selector.get("matchLabels") or {}
    expressions = selector.get("matchExpressions") or ()
    if not isinstance(match_labels, Mapping) or not isinstance(expressions, list | tuple):
        raise SelectorError("matchLabels is not an object or matchExpressions not a list")
    for key, value in match_labels.items():
        if labels.get(str(key)) != str(value):
            return False
    for expr in expressions:
        if not isinstance(expr, Mapping):
            raise SelectorError("a matchExpressions entry is not an object")
        key, op = str(expr.get("key") or ""), expr.get("operator")
        raw = expr.get("values") or ()
        if not isinstance(raw, list | tuple):
            raise SelectorError(f"the values of {key!r} are not a list")
        values = {str(v) for v in raw}
        has = key in labels
        if op == "In":
            ok = has and labels[key] in values
        elif op == "NotIn":
            ok = not has or labels[key] not in values
        elif op == "Exists":
            ok = has
        elif op == "DoesNotExist":
            ok = not has
        else:
            raise SelectorError(f"label selector operator {op!r} is not one of In, NotIn, Exists")
        if not ok:
            return False
    return True
