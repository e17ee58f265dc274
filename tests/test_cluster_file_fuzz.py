"""Property: whatever a hand-written cluster file holds, the commands that read one answer with
a report or a one-line error, never a traceback. The demo cluster's objects are mutated: a
field's value replaced by one of another type or out of range, a field deleted, or one of
vramsched's annotations set to an odd value. A pod whose `status.phase` was `{}` once ended
`top`, `why`, `plan-defrag`, `simulate` and `serve --cluster` in a TypeError."""

from __future__ import annotations

import contextlib
import copy
import io
import json
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from demo_server import DEMO
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from extender.cli import main
from extender.source_file import read_cluster_file

BASE = [dict(o) for o in read_cluster_file(DEMO)]
ODD: list[Any] = [None, "", "0", "-1", "1.5", "1e3", "nan", "x", 7, True, "9" * 22, "1_0"]
ODD += ["\u0661", "16Gi", "8", "none", "mixed", "mps", "Running", "Succeeded"]
#: values of another JSON type than a string or a number: the most common way a hand-written
#: field breaks a reader that only expects the API server's types
CONTAINERS: list[Any] = [[], {}, [{}], {"a": 1}, ["Running"]]
ANNOTATIONS = [
    "vramsched.io/assignment",
    "vramsched.io/model-memory",
    "vramsched.io/movable",
    "vramsched.io/allowed-products",
    "vramsched.io/gpu-index",
    "vramsched.io/device-plugin-state",
]
ASSIGNMENT = '{"node":"a100-ts-0","devices":["0"],"bytesPerDevice":[1]}'


def paths(obj: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    """Every key path into `obj`'s metadata, spec and status."""
    items = (
        obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    )
    for key, value in items:
        if prefix or key in ("metadata", "spec", "status"):
            yield (*prefix, key)
            yield from paths(value, (*prefix, key))


def mutate(items: list[dict[str, Any]], data: st.DataObject) -> None:
    """One change to one of `items`. Retyping comes first: a reader written against the API
    server's types breaks on an object where it expects a string far more than on a bad string."""
    obj = data.draw(st.sampled_from(items))
    action = data.draw(st.sampled_from(["retype", "retype", "replace", "delete", "annotate"]))
    if action == "annotate":
        meta = obj.setdefault("metadata", {})
        annotations = meta.setdefault("annotations", {}) if isinstance(meta, dict) else None
        if isinstance(annotations, dict):
            key = data.draw(st.sampled_from(ANNOTATIONS))
            annotations[key] = data.draw(st.sampled_from([*ODD, *CONTAINERS, ASSIGNMENT]))
        return
    choices = list(paths(obj))
    shallow = [p for p in choices if len(p) <= 2]  # where a field's type matters most
    if not choices:
        return
    deep = data.draw(st.integers(0, 3)) == 0
    path = data.draw(st.sampled_from(choices if deep or not shallow else shallow))
    parent = obj
    for key in path[:-1]:
        parent = parent[key]
    if action == "delete" and isinstance(parent, dict):
        del parent[path[-1]]
    elif action == "retype" and not isinstance(parent[path[-1]], dict | list):
        parent[path[-1]] = data.draw(st.sampled_from(CONTAINERS))
    else:
        parent[path[-1]] = data.draw(st.sampled_from(ODD))


def answers(argv: list[str]) -> tuple[int, str, str]:
    """Exit code, stdout and stderr of one command run in this process."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue(), err.getvalue()


@settings(
    max_examples=200, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
@given(data=st.data(), mutations=st.integers(1, 4))
def test_every_reader_answers_a_mutated_cluster_file(data: st.DataObject, mutations: int) -> None:
    items = copy.deepcopy(BASE)
    for _ in range(mutations):
        mutate(items, data)
    pods = [o for o in BASE if o.get("kind") == "Pod"]
    target = data.draw(st.sampled_from(pods))["metadata"]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp, "cluster.json")
        path.write_text(json.dumps({"kind": "List", "items": items}))
        key = f"{target.get('namespace') or 'default'}/{target['name']}"
        for argv in (
            ["top", "--cluster", str(path), "-o", "json"],
            ["top", "--cluster", str(path), "-o", "wide"],
            ["why", "--cluster", str(path), key],
        ):
            code, out, err = answers(argv)
            assert code in (0, 1), (argv, code, err)  # 1: an error, or `why` finding no place
            assert out or (err.startswith("error: ") and err.count("\n") == 1), (argv, err)
