"""The embedded cluster: a Kubernetes `List` of Nodes and Pods read from a file.

Accepts exactly what `kubectl get nodes,pods -A -o yaml` (or `-o json`) prints, or
several YAML documents; `plan-defrag` also reads the PersistentVolumeClaims and
PersistentVolumes of the same file (`kinds`). JSON is parsed with orjson, so a generated
100,000-pod cluster loads in seconds; YAML uses the C loader when PyYAML has it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import orjson
import yaml

from extender.spread_defaults import SPREAD_LISTS

__all__ = [
    "CLUSTER_KINDS",
    "STORAGE_KINDS",
    "ClusterFileError",
    "read_cluster_file",
    "iter_objects",
    "given_twice",
]

#: what a cluster file is read for by default, and what plan-defrag also reads of it
CLUSTER_KINDS = ("Node", "Pod")
STORAGE_KINDS = ("PersistentVolumeClaim", "PersistentVolume")
#: kinds whose objects are told apart by namespace too (the spread kinds: `spread_defaults`)
_NAMESPACED = frozenset({"Pod", "PersistentVolumeClaim", *SPREAD_LISTS})

_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class ClusterFileError(ValueError):
    """The file is not a Kubernetes List (or stream) of objects; the message starts with its
    path."""


def iter_objects(doc: Any, kinds: Iterable[str] = CLUSTER_KINDS) -> Iterator[Mapping[str, Any]]:
    """Objects of `kinds` in a document: a `List`/`NodeList`/`PodList`, a single object, or a
    list."""
    kinds = tuple(kinds)
    if doc is None:
        return
    if isinstance(doc, list):
        for item in doc:
            yield from iter_objects(item, kinds)
        return
    if not isinstance(doc, Mapping):
        raise ClusterFileError(f"expected a Kubernetes object, got {type(doc).__name__}")
    kind = doc.get("kind", "")
    if "items" in doc and (kind.endswith("List") or kind == ""):
        item_kind = kind[:-4] if kind not in ("List", "") else ""
        for item in doc.get("items") or []:
            if isinstance(item, Mapping) and item_kind and "kind" not in item:
                item = {**item, "kind": item_kind}
            yield from iter_objects(item, kinds)
        return
    if kind in kinds:
        yield doc


def read_cluster_file(
    path: str | Path, kinds: Iterable[str] = CLUSTER_KINDS
) -> list[Mapping[str, Any]]:
    data = Path(path).read_bytes()
    head = data.lstrip()[:1]
    try:
        if head in (b"{", b"["):
            docs = [orjson.loads(data)]
        else:
            docs = list(yaml.load_all(data, Loader=_Loader))
    except (orjson.JSONDecodeError, yaml.YAMLError) as exc:
        raise ClusterFileError(f"{path}: not YAML/JSON: {exc}") from None
    out: list[Mapping[str, Any]] = []
    try:
        for doc in docs:
            out.extend(iter_objects(doc, kinds))
    except ClusterFileError as exc:
        raise ClusterFileError(f"{path}: {exc}") from None
    if twice := given_twice(out):
        raise ClusterFileError(f"{path}: {twice} is given more than once")
    return out


def given_twice(objects: Iterable[Mapping[str, Any]]) -> str | None:
    """The first object (a Pod or a claim by namespace/name, else by name) that `objects` hold
    twice, or None. The API server holds one object per name, and so does every reader of the
    file: the last one would silently stand for both."""
    seen: set[tuple[str, str, str]] = set()
    for obj in objects:
        meta = obj.get("metadata")
        if not isinstance(meta, Mapping) or not isinstance(meta.get("name"), str):
            continue  # left out wherever objects are read
        kind, name = str(obj.get("kind")), meta["name"]
        namespaced = kind in _NAMESPACED
        namespace = str(meta.get("namespace") or "default") if namespaced else ""
        if (kind, namespace, name) in seen:
            return f"{kind.lower()} {namespace}/{name}" if namespaced else f"{kind.lower()} {name}"
        seen.add((kind, namespace, name))
    return None
