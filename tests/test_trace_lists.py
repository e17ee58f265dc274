"""Every pod list of the Alibaba GPU-sharing dataset reads, whatever optional columns it lacks.

The dataset's lists differ in their columns: the `multigpu` lists carry only
`name, cpu_milli, memory_mib, num_gpu, gpu_milli`. The lists themselves come from the public
alibaba/clusterdata repository (folder cluster-trace-gpu-v2023); set VRAMSCHED_TRACES to the
folder holding them. CI has them beside the repository.
"""

from __future__ import annotations

import csv
import json
import os
import re
from pathlib import Path

import pytest
from builders import gpu_node, pod

from extender.cli import main
from extender.quantity import MIB
from extender.simulate.trace import (
    TRACE_POD_DEFAULTS,
    TraceError,
    inflate,
    read_inputs,
    read_trace_nodes,
    read_trace_pods,
)

TRACES = Path(
    os.environ.get("VRAMSCHED_TRACES", Path(__file__).resolve().parents[2] / "shared" / "traces")
)
POD_LISTS = sorted(TRACES.glob("openb_pod_list_*.csv"))
needs_traces = pytest.mark.skipif(
    not POD_LISTS,
    reason=f"no pod lists in {TRACES}: download cluster-trace-gpu-v2023 from alibaba/clusterdata "
    "and set VRAMSCHED_TRACES",
)


@needs_traces
@pytest.mark.parametrize(
    "pod_list", POD_LISTS, ids=lambda p: p.stem.removeprefix("openb_pod_list_")
)
def test_every_pod_list_of_the_dataset_reads(pod_list: Path) -> None:
    with open(pod_list, newline="") as fh:
        rows = list(csv.DictReader(fh))
    nodes, tasks, bound = read_inputs(TRACES / "openb_node_list_gpu_node.csv", pod_list)
    assert len(nodes) == 1213 and not bound
    assert len(tasks) == len(rows)  # every task, none dropped
    by_name = {t.demand.pod.name: t for t in tasks}
    for row in rows[:: max(1, len(rows) // 200)]:
        d = by_name[row["name"]].demand
        assert d.gpu_count == int(row["num_gpu"])
        assert d.cpu_milli == int(row["cpu_milli"])
        assert d.memory_bytes == int(row["memory_mib"]) * MIB
        if d.gpu_count == 1:
            assert d.bytes_per_gpu == int(row["gpu_milli"]) * MIB
    arrivals = [t.arrival for t in tasks]
    assert arrivals == sorted(arrivals)
    if "creation_time" not in rows[0]:
        # no times: file order, one task per arrival, nobody leaves
        assert [t.demand.pod.name for t in tasks] == [r["name"] for r in rows]
        assert len(set(arrivals)) == len(tasks)
        assert all(t.departure is None for t in tasks)
        assert all(t.demand.allowed_products is None for t in tasks)


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_a_list_without_optional_columns_takes_the_documented_defaults(tmp_path: Path) -> None:
    pods = _write(
        tmp_path / "pods.csv",
        "name,num_gpu,gpu_milli\nz,1,\ny,2,\nx,0,\nw,1,250\n",
    )
    tasks = read_trace_pods(pods)
    assert [t.demand.pod.name for t in tasks] == ["z", "y", "x", "w"]  # file order, not by name
    assert [t.arrival for t in tasks] == [0.0, 1.0, 2.0, 3.0]
    z, y, x, w = (t.demand for t in tasks)
    assert z.bytes_per_gpu == 1000 * MIB  # a single-GPU task without gpu_milli: a whole GPU
    assert y.gpu_count == 2 and y.bytes_per_gpu is None
    assert x.gpu_count == 0 and x.cpu_milli == 0 and x.memory_bytes == 0
    assert w.bytes_per_gpu == 250 * MIB and w.allowed_products is None
    assert {t.qos for t in tasks} == {""} and {d.priority for d in (z, y, x, w)} == {0}
    assert set(TRACE_POD_DEFAULTS) >= {"cpu_milli", "memory_mib", "gpu_milli", "creation_time"}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("name,cpu_milli\na,1000\n", "no column num_gpu"),
        ("name,num_gpu,gpu_milli\na,one,\n", "line 2: num_gpu 'one' is not a whole number"),
        ("name,num_gpu,gpu_milli\na,1,1500\n", "line 2: gpu_milli 1500 is not a share of one GPU"),
        ("name,num_gpu,cpu_milli\na,1,-5\n", "line 2: cpu_milli '-5' is negative"),
        ("name,num_gpu\n,1\n", "line 2: name is empty"),
        (
            "name,num_gpu,creation_time\na,1,soon\n",
            "line 2: creation_time 'soon' is not a number of seconds",
        ),
        (
            "name,num_gpu,creation_time\na,1,0\nb,1,nan\n",
            "line 3: creation_time 'nan' is not a finite number of seconds",
        ),
        (
            "name,num_gpu,creation_time,deletion_time\na,1,5,inf\n",
            "line 2: deletion_time 'inf' is not a finite number of seconds",
        ),
        (
            "name,num_gpu,creation_time,deletion_time\na,1,100,40\n",
            "line 2: deletion_time 40 is before creation_time 100",
        ),
        # int() takes underscores and every script's digits; the dataset writes ASCII digits
        ("name,num_gpu\na,1_0\n", "line 2: num_gpu '1_0' is not a whole number"),
        ("name,num_gpu,qos\na,1,LS\nb,1,ls\n", "line 3: qos 'ls' is not one of LS, Guaranteed"),
        (
            "name,num_gpu,gpu_milli\na,1,\u0665\u0660\u0660\n",
            "line 2: gpu_milli '.+' is not a whole",
        ),
        # one pod key: the ledger would hold one of them and count the other as failed
        ("name,num_gpu\na,1\nb,1\na,0\n", "line 4: name 'a' is also on line 2"),
        # beyond int64 in the arrays: was an OverflowError traceback
        ("name,num_gpu,memory_mib\na,0,999999999999999\n", "line 2: memory_mib .* more than any"),
    ],
)
def test_a_bad_pod_list_names_the_line_and_column(tmp_path: Path, text: str, message: str) -> None:
    pods = _write(tmp_path / "pods.csv", text)
    with pytest.raises(TraceError, match=message):
        read_trace_pods(pods)


def test_a_bad_node_list_names_the_missing_column(tmp_path: Path) -> None:
    nodes = _write(tmp_path / "nodes.csv", "sn,cpu_milli,gpu,model\nn0,1000,1,T4\n")
    with pytest.raises(TraceError, match="no column memory_mib"):
        read_trace_nodes(nodes)


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        # a second row of one name replaced the first: half the GPUs, silently
        ("n0,1000,1024,2,T4\nn0,1000,1024,2,T4\n", "line 3: sn 'n0' is also on line 2"),
        (",1000,1024,2,T4\n", "line 2: sn is empty"),
        # beyond the GPU labels' range: the node was read as having no GPUs
        ("n0,1000,1024,513,T4\n", "line 2: gpu 513 is more GPUs than a node may have"),
        ("n0,1000,1024,1_0,T4\n", "line 2: gpu '1_0' is not a whole number"),
        ("n0,1000,1024,2,\n", "line 2: model is empty on a node with 2 GPUs"),
        ("n0,1000,999999999999999,2,T4\n", "line 2: memory_mib .* more than any node has"),
    ],
)
def test_a_bad_node_row_names_the_line_and_column(tmp_path: Path, rows: str, message: str) -> None:
    """Each of these was read without a word as a node other than the row says, or as none."""
    nodes = _write(tmp_path / "nodes.csv", "sn,cpu_milli,memory_mib,gpu,model\n" + rows)
    with pytest.raises(TraceError, match=message):
        read_trace_nodes(nodes)


def test_a_node_without_gpus_needs_no_model(tmp_path: Path) -> None:
    nodes = _write(tmp_path / "nodes.csv", "sn,cpu_milli,memory_mib,gpu,model\nc0,1000,1024,0,\n")
    assert [n["metadata"]["name"] for n in read_trace_nodes(nodes)] == ["c0"]


@pytest.mark.parametrize(
    ("items", "message"),
    [
        (
            [gpu_node("a"), gpu_node("a"), pod("p", namespace="ml")],
            "node a is given more than once",
        ),
        (
            [gpu_node("a"), pod("p", namespace="ml"), pod("p", namespace="ml")],
            "pod ml/p is given more than once",
        ),
        (
            [gpu_node("a"), pod("p", namespace="ml", node="a"), pod("p", namespace="ml")],
            "pod ml/p is given more than once",
        ),
        # a pod the filter cannot read: left out, the replay was of fewer pods than the file's
        (
            [gpu_node("a"), pod("p", "16 Gi", namespace="ml")],
            "pod ml/p: annotation vramsched.io/model-memory",
        ),
    ],
)
def test_a_cluster_file_that_cannot_be_replayed_as_written_is_refused(
    tmp_path: Path, items: list[dict], message: str
) -> None:
    path = tmp_path / "cluster.yaml"
    path.write_text(json.dumps({"apiVersion": "v1", "kind": "List", "items": items}))
    with pytest.raises(ValueError, match=message):  # TraceError, or ClusterFileError for the file
        read_inputs(path, path)


def test_bound_pods_of_two_files_are_one_pod_each(tmp_path: Path) -> None:
    """The node file's bound pods and the pod file's are both kept; the same pod in both is not."""
    nodes, pods = tmp_path / "nodes.yaml", tmp_path / "pods.yaml"
    nodes.write_text(
        json.dumps({"kind": "List", "items": [gpu_node("a"), pod("x", namespace="ml", node="a")]})
    )
    pods.write_text(
        json.dumps(
            {
                "kind": "List",
                "items": [pod("y", namespace="ml", node="a"), pod("p", namespace="ml")],
            }
        )
    )
    _, tasks, bound = read_inputs(nodes, pods)
    assert [t.key for t in tasks] == ["ml/p"]
    assert sorted(b["metadata"]["name"] for b in bound) == ["x", "y"]
    pods.write_text(
        json.dumps(
            {
                "kind": "List",
                "items": [pod("x", namespace="ml", node="a"), pod("p", namespace="ml")],
            }
        )
    )
    with pytest.raises(TraceError, match="pod ml/x is given more than once"):
        read_inputs(nodes, pods)


def test_simulate_replays_a_list_without_times_and_says_what_was_wrong(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    nodes = _write(
        tmp_path / "nodes.csv", "sn,cpu_milli,memory_mib,gpu,model\nn0,64000,262144,2,T4\n"
    )
    pods = _write(
        tmp_path / "pods.csv",
        "name,cpu_milli,memory_mib,num_gpu,gpu_milli\na,1000,1024,1,600\nb,1000,1024,1,600\n",
    )
    assert (
        main(["simulate", "--nodes", str(nodes), "--pods", str(pods), "--policy", "fgd", "--json"])
        == 0
    )
    fgd = json.loads(capsys.readouterr().out)["policies"]["fgd"]
    # two 600-MiB tasks arriving one after the other (file order): one per GPU
    assert (fgd["placed"], fgd["batches"], fgd["gpusInUse"]) == (2, 2, 2)
    bad = _write(tmp_path / "bad.csv", "name,cpu_milli\na,1\n")
    assert main(["simulate", "--nodes", str(nodes), "--pods", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "cannot read inputs" in err and "no column num_gpu" in err and "Traceback" not in err


def test_inflated_copies_keep_every_pod_key_distinct(tmp_path: Path) -> None:
    """A list holding `a` and `a-r1` had the copy of `a` named `a-r1` too: one pod key for two
    pods, so the second always failed."""
    pods = _write(tmp_path / "pods.csv", "name,num_gpu\na,1\na-r1,1\n")
    tasks = inflate(read_trace_pods(pods), gpu_capacity=3, factor=2.0)
    assert len(tasks) == 6 and len({t.key for t in tasks}) == 6


@pytest.mark.parametrize(
    ("rows", "gpus", "message"),
    [
        # GPU-less pods never reach a GPU target: the list was repeated a thousand times
        ("c,0\nd,0\n", 2, "asks 0 GPUs; reaching 1.3 x the cluster's 2 GPUs would take more"),
        ("a,1\n", 2000, "asks 1 GPUs; reaching 1.3 x the cluster's 2000 GPUs would take more"),
        ("a,1\n", 0, "the cluster has no GPUs"),  # was an empty replay
    ],
)
def test_an_inflation_that_cannot_be_reached_is_refused(
    tmp_path: Path, rows: str, gpus: int, message: str
) -> None:
    pods = _write(tmp_path / "pods.csv", "name,num_gpu\n" + rows)
    with pytest.raises(ValueError, match=re.escape(message)):
        inflate(read_trace_pods(pods), gpu_capacity=gpus, factor=1.3)


def test_simulate_says_why_it_cannot_inflate(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    nodes = _write(
        tmp_path / "nodes.csv", "sn,cpu_milli,memory_mib,gpu,model\nn0,64000,262144,2,T4\n"
    )
    pods = _write(tmp_path / "pods.csv", "name,num_gpu,cpu_milli\nc,0,100\n")
    argv = ["simulate", "--nodes", str(nodes), "--pods", str(pods), "--inflate", "1.3"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("vramsched simulate: --inflate 1.3: the pod list asks 0 GPUs")
    assert err.count("\n") == 1


def test_simulate_names_the_gpu_nodes_it_cannot_use(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A node whose NVIDIA labels the filter would refuse held no GPUs in the replay, without a
    word; a CPU node (no `nvidia.com/` label) and a node labelled with no GPUs are not named."""
    odd = gpu_node("odd", count=1, extra_labels={"nvidia.com/gpu.count": "1_0"})
    cpu = {"kind": "Node", "metadata": {"name": "cpu"}, "status": {"allocatable": {"cpu": "8"}}}
    none = gpu_node("none", count=0)
    path = tmp_path / "cluster.yaml"
    items = [gpu_node("ok", count=1), odd, cpu, none, pod("p", namespace="ml")]
    path.write_text(json.dumps({"kind": "List", "items": items}))
    argv = ["simulate", "--nodes", str(path), "--pods", str(path), "--policy", "fgd", "--json"]
    assert main(argv) == 0
    captured = capsys.readouterr()
    notes = [line for line in captured.err.splitlines() if "note:" in line]
    assert notes == [
        "vramsched simulate: note: node odd holds no GPUs in this replay: "
        "label nvidia.com/gpu.count='1_0' is not an integer"
    ]
    assert json.loads(captured.out)["policies"]["fgd"]["placed"] == 1


def test_a_long_list_of_unusable_nodes_is_cut() -> None:
    from extender.commands.simulate import NODES_NAMED, gpu_nodes_left_out
    from extender.inventory import NodeInventory

    bad = [
        NodeInventory(f"n{i}", problem="missing label x", labels={"nvidia.com/gpu.present": "true"})
        for i in range(NODES_NAMED + 3)
    ]
    lines = gpu_nodes_left_out(bad)
    assert len(lines) == NODES_NAMED + 1 and lines[-1] == "and 3 more nodes"


def test_gpu_models_are_read_without_spaces_around_them(tmp_path: Path) -> None:
    """`V100| T4` named a model ` T4` that no node has, so the pod could never go on a T4."""
    pods = _write(tmp_path / "pods.csv", "name,num_gpu,gpu_spec\na,1,V100| T4 \nb,1, | \n")
    a, b = (t.demand for t in read_trace_pods(pods))
    assert a.allowed_products == frozenset({"V100", "T4"})
    assert b.allowed_products is None  # no model named: any
