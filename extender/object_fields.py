"""Fields of Kubernetes objects read without trusting their shape. Pure.

Objects from the API server are validated; those from a cluster file, or a field a newer API adds,
may not be. Each reader answers what an absent field means (an empty mapping, list, name) for a
field of the wrong type too, so a malformed object is judged by the rules, never crashes them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = [
    "mapping",
    "items",
    "field",
    "meta",
    "spec",
    "labels",
    "name",
    "namespace",
    "uid_of",
    "version_of",
]


def mapping(value: Any) -> Mapping[str, Any]:
    """`value` if it is a mapping, else an empty one."""
    return value if isinstance(value, Mapping) else {}


def items(value: Any) -> Sequence[Any]:
    """`value` if it is a list (or tuple), else an empty one (a string is not a list of items)."""
    return value if isinstance(value, list | tuple) else ()


def field(obj: Any, *path: str) -> Any:
    """obj[path[0]][path[1]]..., None where a step is missing or not a mapping."""
    for key in path:
        if not isinstance(obj, Mapping):
            return None
        obj = obj.get(key)
    return obj


def meta(obj: Any) -> Mapping[str, Any]:
    return mapping(field(obj, "metadata"))


def spec(obj: Any) -> Mapping[str, Any]:
    return mapping(field(obj, "spec"))


def labels(obj: Any) -> dict[str, str]:
    return {str(k): str(v) for k, v in mapping(meta(obj).get("labels")).items()}


def name(obj: Any) -> str:
    return str(meta(obj).get("name") or "?")


def namespace(obj: Any) -> str:
    return str(meta(obj).get("namespace") or "default")


def uid_of(obj: Any) -> str:
    """metadata.uid, "" when absent: the identity that tells a pod from one created again under
    its name."""
    return str(meta(obj).get("uid") or "")


def version_of(obj: Any) -> str:
    """metadata.resourceVersion, "" when absent: opaque, compared for equality only."""
    return str(meta(obj).get("resourceVersion") or "")
