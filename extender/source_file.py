"""The embedded cluster: a Kubernetes `List` of Nodes and Pods read from a file.

Accepts exactly what `kubectl get nodes,pods -A -o yaml` (or `-o json`) prints, or
several YAML documents. JSON is parsed with orjson, so a generated 100,000-pod cluster
loads in seconds; YAML uses the C loader when PyYAML has it.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import orjson
import yaml

__all__ = ["ClusterFileError", "read_cluster_file", "iter_objects"]

_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class ClusterFileError(ValueError):
    """The file is not a Kubernetes List (or stream) of objects."""


def iter_objects(doc: Any) -> Iterator[Mapping[str, Any]]:
    """Objects of a document: a `List`/`NodeList`/`PodList`, a single object, or a list."""
    if doc is None:
        return
    if isinstance(doc, list):
        for item in doc:
            yield from iter_objects(item)
        return
    if not isinstance(doc, Mapping):
        raise ClusterFileError(f"expected a Kubernetes object, got {type(doc).__name__}")
    kind = doc.get("kind", "")
    if "items" in doc and (kind.endswith("List") or kind == ""):
        item_kind = kind[:-4] if kind not in ("List", "") else ""
        for item in doc.get("items") or []:
            if isinstance(item, Mapping) and item_kind and "kind" not in item:
                item = {**item, "kind": item_kind}
            yield from iter_objects(item)
        return
    if kind in ("Node", "Pod"):
        yield doc


def read_cluster_file(path: str | Path) -> list[Mapping[str, Any]]:
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
    for doc in docs:
        out.extend(iter_objects(doc))
    return out
