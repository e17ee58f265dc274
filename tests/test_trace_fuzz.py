"""Property: whatever a node or pod list holds, `vramsched simulate` reads it as written or refuses
it with a TraceError naming the file and row; a list it reads replays with every pod key
distinct and no device over its memory or replicas. Lists that once read as another cluster
(a node named twice, two pods of one name) or ended in a traceback (a memory column beyond
int64) are among the values drawn."""

from __future__ import annotations

import csv
import io
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from extender.simulate.engine import run_policy
from extender.simulate.trace import TraceError, inflate, read_inputs

NODE_COLUMNS = ["sn", "cpu_milli", "memory_mib", "gpu", "model"]  # all required
POD_COLUMNS = ["name", "num_gpu", "cpu_milli", "memory_mib", "gpu_milli", "gpu_spec"]
POD_COLUMNS += ["creation_time", "deletion_time"]
ODD = st.sampled_from(
    ["", "0", "-1", "1.5", "1e3", "nan", "inf", " 3 ", "1_0", "\u0661", "+4", "0x10", "x", "|"]
    + ["999999999999999999", "9" * 30, "513", "65", "1000", "1001", "T4", "V100|T4"]
)


def mostly(good: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
    """49 draws in 50 from `good`: a list is refused at its first odd value, and one refused
    tests less than one replayed."""
    return st.integers(0, 49).flatmap(lambda n: ODD if n == 0 else good)


def columns(names: list[str], required: int) -> st.SearchStrategy[list[str]]:
    """Mostly every column or the required ones (the first `required`) and some others; now and
    then any of them, required or not."""
    some = st.lists(st.sampled_from(names), unique=True).map(
        lambda more: names[:required] + [c for c in more if c not in names[:required]]
    )
    any_of = st.lists(st.sampled_from(names), unique=True)
    return st.integers(0, 9).flatmap(
        lambda n: st.just(names) if n < 5 else (some if n < 9 else any_of)
    )


NODE_ROW = st.fixed_dictionaries(
    {
        "sn": mostly(st.sampled_from([f"n{i}" for i in range(16)])),
        "cpu_milli": mostly(st.sampled_from(["0", "8000", "64000"])),
        "memory_mib": mostly(st.sampled_from(["0", "65536", "262144"])),
        "gpu": mostly(st.sampled_from(["0", "1", "2", "8"])),
        "model": mostly(st.sampled_from(["T4", "V100", "P100"])),
    }
)
POD_ROW = st.fixed_dictionaries(
    {
        "name": mostly(st.sampled_from([f"p{i}" for i in range(40)] + ["p0-r1", "p1-r1"])),
        "cpu_milli": mostly(st.sampled_from(["0", "1000", "8000"])),
        "memory_mib": mostly(st.sampled_from(["0", "1024", "16384"])),
        "num_gpu": mostly(st.sampled_from(["0", "1", "1", "2", "8"])),
        "gpu_milli": mostly(st.sampled_from(["50", "300", "500", "1000"])),
        "gpu_spec": mostly(st.sampled_from(["", "T4", "V100|P100"])),
        "creation_time": mostly(st.sampled_from(["0", "5", "10"])),
        "deletion_time": mostly(st.sampled_from(["", "20", "30"])),
    }
)


def _csv(columns: list[str], rows: list[dict[str, str]]) -> str:
    out = io.StringIO()
    writer = csv.DictWriter(out, columns, extrasaction="ignore")
    writer.writeheader()
    writer.writerows(rows)
    return out.getvalue()


@settings(
    max_examples=500,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(
    node_columns=columns(NODE_COLUMNS, 5),
    nodes=st.lists(NODE_ROW, min_size=1, max_size=4),
    pod_columns=columns(POD_COLUMNS, 2),
    pods=st.lists(POD_ROW, min_size=1, max_size=6),
    factor=st.sampled_from([0.0, 0.0, 1.3, 3.0]),
    churn=st.booleans(),
)
def test_a_list_is_read_as_written_or_refused_by_row(
    node_columns: list[str],
    nodes: list[dict[str, str]],
    pod_columns: list[str],
    pods: list[dict[str, str]],
    factor: float,
    churn: bool,
) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        node_file, pod_file = Path(tmp, "nodes.csv"), Path(tmp, "pods.csv")
        node_file.write_text(_csv(node_columns, nodes))
        pod_file.write_text(_csv(pod_columns, pods))
        try:
            read = read_inputs(node_file, pod_file)
        except TraceError as exc:
            event("refused")
            assert str(exc).startswith(str(node_file if "nodes" in str(exc) else pod_file))
            return
    node_objects, tasks, bound = read
    event("read")
    assert len(node_objects) == len(nodes) and len(tasks) == len(pods) and not bound
    assert len({n["metadata"]["name"] for n in node_objects}) == len(node_objects)
    if factor:
        gpus = sum(int(n["metadata"]["labels"]["nvidia.com/gpu.count"]) for n in node_objects)
        try:
            tasks = inflate(tasks, gpus, factor)
        except ValueError as exc:
            assert "copies" in str(exc) or "no GPUs" in str(exc)
            return
    assert len({t.key for t in tasks}) == len(tasks)
    event("replayed" if tasks else "replayed, no pods")
    for policy in ("planner", "fgd", "hot-path"):
        result = run_policy(policy, node_objects, tasks, churn=churn, time_limit=0.05)
        assert result.invariantViolations == 0
        assert result.placed + result.failed == len(tasks)
