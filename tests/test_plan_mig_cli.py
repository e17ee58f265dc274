"""``vramsched plan-mig`` command (extender.commands.plan_mig)."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
from pathlib import Path

import pytest
import yaml

from extender import mig
from extender.commands import plan_mig

GIB = mig.GIB


def node(
    name: str,
    product: str,
    count: int,
    labels: dict[str, str] | None = None,
    strategy: str | None = "mixed",
) -> dict:
    lab = {"nvidia.com/gpu.product": product, "nvidia.com/gpu.count": str(count)}
    if strategy:
        lab["nvidia.com/mig.strategy"] = strategy
    lab.update(labels or {})
    return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": lab}}


def mig_labels(
    counts: dict[str, int], memory_mib: dict[str, int] | None = None, config: str | None = None
) -> dict[str, str]:
    out = {}
    for p, k in counts.items():
        base = mig.resource_name(p)
        out[base + ".count"] = str(k)
        if memory_mib and p in memory_mib:
            out[base + ".memory"] = str(memory_mib[p])
    if config:
        out["nvidia.com/mig.config"] = config
        out["nvidia.com/mig.config.state"] = "success"
    return out


def pod(
    name: str,
    memory: str | None = None,
    node_name: str | None = None,
    assignment: dict | None = None,
    mig_limits: dict | None = None,
    phase: str | None = None,
) -> dict:
    ann = {}
    if memory:
        ann["vramsched.io/model-memory"] = memory
    if assignment:
        ann["vramsched.io/assignment"] = json.dumps(assignment)
    spec: dict = {"containers": [{"name": "c", "image": "x"}]}
    if mig_limits:
        spec["containers"][0]["resources"] = {"limits": mig_limits}
    if node_name:
        spec["nodeName"] = node_name
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "ml", "annotations": ann},
        "spec": spec,
        "status": {"phase": phase or ("Running" if node_name else "Pending")},
    }


def write_list(path: Path, items: list[dict]) -> Path:
    path.write_text(yaml.safe_dump({"apiVersion": "v1", "kind": "List", "items": items}))
    return path


def args(cluster: Path, **kw) -> argparse.Namespace:
    base = dict(
        cluster=cluster,
        pending=None,
        time_limit=5.0,
        workers=1,
        reconfigure="whole-gpu",
        compare_uniform=False,
        output_yaml=None,
        apply_labels=False,
        kubeconfig=None,
    )
    base.update(kw)
    return argparse.Namespace(**base)


A100 = "NVIDIA-A100-SXM4-80GB"
H100 = "NVIDIA-H100-80GB-HBM3"


@pytest.fixture
def cluster(tmp_path: Path) -> Path:
    balanced2 = {"1g.10gb": 4, "2g.20gb": 2, "3g.40gb": 2}
    items = [
        node(
            "a100-1",
            A100,
            2,
            mig_labels(
                balanced2, {"1g.10gb": 9728, "2g.20gb": 19968, "3g.40gb": 40192}, "all-balanced"
            ),
        ),
        node("h100-1", H100, 2, mig_labels({"1g.10gb": 14})),
        node("l4-1", "NVIDIA-L4", 1, strategy=None),
        pod(
            "running",
            "30Gi",
            "a100-1",
            {"node": "a100-1", "devices": ["0:3g.40gb:0"], "bytesPerDevice": 30 * GIB},
        ),
        pod("big", "70Gi"),
        pod("mid", "23Gi"),
        pod("huge", "100Gi"),
        pod("pinned", mig_limits={"nvidia.com/mig-2g.20gb": 1}),
        pod("done", "70Gi", phase="Succeeded"),
        pod("not-mig", None),
    ]
    return write_list(tmp_path / "cluster.yaml", items)


def test_parse_bytes() -> None:
    assert plan_mig.parse_bytes("16Gi") == 16 * GIB
    assert plan_mig.parse_bytes("1.5Gi") == 3 * GIB // 2
    assert plan_mig.parse_bytes("1000") == 1000
    assert plan_mig.parse_bytes("2G") == 2 * 10**9
    assert plan_mig.parse_bytes("0.1") == 1  # rounded up
    assert plan_mig.parse_bytes("1e3") == 1000
    assert plan_mig.parse_bytes("0") == 0
    for bad in ("", "16GiB", "-1Gi", "abc"):
        with pytest.raises(ValueError):
            plan_mig.parse_bytes(bad)


def test_read_cluster(cluster: Path) -> None:
    snap = plan_mig.read_cluster(cluster)
    assert sorted({g.node for g in snap.gpus}) == ["a100-1", "h100-1"]
    a0 = next(g for g in snap.gpus if g.node == "a100-1" and g.gpu_index == 0)
    assert a0.layout_known and a0.current == mig.A100_80GB.balanced
    assert a0.occupied == (("3g.40gb", 1),)
    assert a0.model is not None and a0.model.profile("1g.10gb").memory_bytes == 9728 * mig.MIB
    h = [g for g in snap.gpus if g.node == "h100-1"]
    assert all(g.current == (("1g.10gb", 7),) for g in h)
    assert sorted(p.key for p in snap.pending) == ["ml/big", "ml/huge", "ml/mid", "ml/pinned"]
    pinned = next(p for p in snap.pending if p.key == "ml/pinned")
    assert pinned.allowed_profiles == frozenset({"2g.20gb"}) and pinned.model_memory_bytes == 0


def test_run_prints_table_and_yaml(cluster: Path, tmp_path: Path) -> None:
    out = io.StringIO()
    out_yaml = tmp_path / "mig-parted.yaml"
    rc = plan_mig.run(args(cluster, output_yaml=out_yaml, compare_uniform=True), out=out)
    text = out.getvalue()
    assert rc == 0
    assert text.splitlines()[0].split()[:3] == ["NODE", "MODEL", "ACTION"]
    assert "pods placed: 3/4" in text
    assert "ml/huge: needs 100.0 GiB" in text
    assert "uniform:all-balanced" in text
    cfg = yaml.safe_load(out_yaml.read_text())
    assert cfg["version"] == "v1"
    assert cfg == yaml.safe_load(
        text.split("# mig-parted config")[1].split("\n", 1)[1].split("# node labels")[0]
    )
    labels = yaml.safe_load(text.split("# node labels (dry-run: not applied)\n")[1])["nodeLabels"]
    # a100-1 GPU 0 runs a pod: whatever the plan, its layout is untouched
    for n, lab in labels.items():
        entries = cfg["mig-configs"][lab["nvidia.com/mig.config"]]
        if n == "a100-1":
            dev0 = [e for e in entries if e["devices"] == "all" or 0 in e["devices"]]
            assert dev0[0]["mig-devices"] == {"1g.10gb": 2, "2g.20gb": 1, "3g.40gb": 1}
    assert "l4-1" not in labels


def test_pending_file_replaces_cluster_pending(cluster: Path, tmp_path: Path) -> None:
    pending = write_list(tmp_path / "pending.yaml", [pod("only", "8Gi")])
    out = io.StringIO()
    assert plan_mig.run(args(cluster, pending=pending), out=out) == 0
    assert "pods placed: 1/1" in out.getvalue()
    assert "nodeLabels: {}" in out.getvalue()  # a free 1g slice exists already


def test_apply_labels_is_dry_run(cluster: Path) -> None:
    out = io.StringIO()
    assert plan_mig.run(args(cluster, apply_labels=True), out=out) == 2
    text = out.getvalue()
    assert "not implemented; nothing was changed" in text
    assert "kubectl label node h100-1 nvidia.com/mig.config=vramsched-" in text


def test_opaque_and_single_strategy_nodes_are_frozen(tmp_path: Path) -> None:
    items = [
        node(
            "single",
            "NVIDIA-A100-SXM4-40GB-MIG-1g.5gb",
            14,
            {"nvidia.com/gpu.memory": "4864"},
            strategy="single",
        ),
        node("opaque", H100, 1, mig_labels({"1g.10gb": 7})),
        pod("foreign", None, "opaque", mig_limits={"nvidia.com/mig-1g.10gb": 1}),
        pod("big", "70Gi"),
    ]
    cluster = write_list(tmp_path / "c.yaml", items)
    snap = plan_mig.read_cluster(cluster)
    assert {g.node for g in snap.gpus} == {"single", "opaque"}
    assert len([g for g in snap.gpus if g.node == "single"]) == 2  # 14 devices / 7 per GPU
    assert all(g.frozen_reason for g in snap.gpus)
    out = io.StringIO()
    assert plan_mig.run(args(cluster), out=out) == 0
    text = out.getvalue()
    assert "pods placed: 0/1" in text and "frozen" in text and "nodeLabels: {}" in text


def test_assignment_forms_and_multi_gpu_pods(tmp_path: Path) -> None:
    items = [
        node("h", H100, 2, mig_labels({"1g.10gb": 14})),
        # bytesPerDevice as a list (what the binder writes) and as one number; two pods on one device
        pod(
            "a",
            "5Gi",
            "h",
            {"node": "h", "devices": ["1:1g.10gb:3", "1:1g.10gb:4"], "bytesPerDevice": [GIB, GIB]},
        ),
        pod("b", "5Gi", "h", {"node": "h", "devices": ["1:1g.10gb:3"], "bytesPerDevice": GIB}),
        pod("two", "8Gi", mig_limits={"nvidia.com/mig-1g.10gb": 2}),
        pod("one", "8Gi"),
    ]
    snap = plan_mig.read_cluster(write_list(tmp_path / "c.yaml", items))
    g1 = next(g for g in snap.gpus if g.gpu_index == 1)
    assert g1.occupied == (("1g.10gb", 2),) and all(g.frozen_reason is None for g in snap.gpus)
    assert [p.key for p in snap.pending] == ["ml/one"]
    assert any("ml/two" in n and "several" in n for n in snap.notes)


def test_init_containers_and_sidecars_count_as_the_scheduler_counts_them(tmp_path: Path) -> None:
    """plan-mig counted the app containers only: a pod with a MIG sidecar beside its MIG app
    container was planned one slice, while the extender books two."""
    limits = {"nvidia.com/mig-1g.10gb": "1"}

    def init(name: str, sidecar: bool) -> dict:
        c = {"name": name, "image": "x", "resources": {"limits": limits}}
        return {**c, "restartPolicy": "Always"} if sidecar else c

    side = pod("side", "8Gi", mig_limits=limits)
    side["spec"]["initContainers"] = [init("proxy", True)]
    warm = pod("warm", "8Gi", mig_limits=limits)
    warm["spec"]["initContainers"] = [init("warmup", False)]  # done before the app starts
    items = [node("h", H100, 1, mig_labels({"1g.10gb": 7})), side, warm]
    snap = plan_mig.read_cluster(write_list(tmp_path / "c.yaml", items))
    assert [p.key for p in snap.pending] == ["ml/warm"]
    assert any("ml/side" in n and "several" in n for n in snap.notes)


def test_an_assignment_device_with_a_non_decimal_gpu_index_freezes_the_node(
    tmp_path: Path,
) -> None:
    """A GPU index of "²" (a digit to str.isdigit, not a number int() reads) once raised; the
    assignment is now refused as it is read, as every consumer of it reads it."""
    items = [
        node("h", H100, 1, mig_labels({"1g.10gb": 7})),
        pod("a", "5Gi", "h", {"node": "h", "devices": ["²:1g.10gb:0"], "bytesPerDevice": GIB}),
    ]
    snap = plan_mig.read_cluster(write_list(tmp_path / "c.yaml", items))
    (gpu,) = snap.gpus
    assert gpu.frozen_reason is not None
    assert "device '²:1g.10gb:0' is not a GPU index or a MIG slice's ID" in gpu.frozen_reason


def test_no_mig_gpus(tmp_path: Path) -> None:
    cluster = write_list(tmp_path / "c.yaml", [node("l4", "NVIDIA-L4", 1, strategy=None)])
    out = io.StringIO()
    assert plan_mig.run(args(cluster), out=out) == 1
    assert "no MIG GPUs" in out.getvalue()


def test_register_adds_subcommand(cluster: Path) -> None:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command")
    plan_mig.register(sub)
    ns = parser.parse_args(["plan-mig", "--cluster", str(cluster), "--time-limit", "3"])
    assert ns.run is plan_mig.run and ns.time_limit == 3.0 and not ns.apply_labels


def test_the_cluster_file_is_read_as_serve_reads_it(cluster: Path, tmp_path: Path) -> None:
    """One reader (extender.source_file): `kubectl get -o json` works too, and a bad file is one
    clear error."""
    as_json = tmp_path / "cluster.json"
    as_json.write_text(json.dumps(yaml.safe_load(cluster.read_text())))
    assert plan_mig.read_cluster(as_json) == plan_mig.read_cluster(cluster)
    bad = tmp_path / "bad.yaml"
    bad.write_text("- 1\n- 2\n")
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert plan_mig.run(args(bad), out=io.StringIO()) == 2
    assert err.getvalue() == (
        f"vramsched plan-mig: cannot read {bad}: expected a Kubernetes object, got int\n"
    )
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert plan_mig.run(args(tmp_path / "missing.yaml"), out=io.StringIO()) == 2
    assert err.getvalue() == (
        f"vramsched plan-mig: cannot read {tmp_path / 'missing.yaml'}: No such file or directory\n"
    )


@pytest.mark.parametrize("count", [None, [1], "-1", "1.5", "two", "1_0", "\u0661", True])
def test_a_device_request_that_is_not_a_count_is_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], count: object
) -> None:
    """A hand-written limit of null, a list or a negative number was a TypeError traceback or a
    negative count of slices. A pending pod with one is left out with a note naming it; a
    running one (its slices then unknown) stops the plan with one line naming it. A count is a
    Kubernetes quantity in ASCII digits: `int()` took `1_0` and other scripts' digits."""
    says = f"pod ml/odd: nvidia.com/mig-1g.10gb request {count!r} is not a device count"
    h100 = node("h100-1", H100, 1, mig_labels({"1g.10gb": 7}))
    for on_node, code in ((None, 0), ("h100-1", 1)):
        odd = pod("odd", "8Gi", on_node, mig_limits={"nvidia.com/mig-1g.10gb": count})
        cluster = write_list(tmp_path / "c.yaml", [h100, odd, pod("ok", "8Gi")])
        out = io.StringIO()
        assert plan_mig.run(args(cluster), out=out) == code
        if on_node is None:
            assert f"note: {says}; ignored" in out.getvalue()
            assert "pods placed: 1/1" in out.getvalue()
        else:
            assert says in capsys.readouterr().err


@pytest.mark.parametrize("count", ["1.0", "1e0", "1000m", 1])
def test_a_device_request_is_read_as_a_kubernetes_quantity(tmp_path: Path, count: object) -> None:
    """The same reading as the scheduler's demand: a whole quantity in any of its forms is a
    count of slices, so a pending pod asking `1.0` slice is planned, not ignored."""
    h100 = node("h100-1", H100, 1, mig_labels({"1g.10gb": 7}))
    asks = pod("asks", "8Gi", mig_limits={"nvidia.com/mig-1g.10gb": count})
    cluster = write_list(tmp_path / "c.yaml", [h100, asks])
    out = io.StringIO()
    assert plan_mig.run(args(cluster), out=out) == 0
    assert "ignored" not in out.getvalue()
    assert "pods placed: 1/1" in out.getvalue()
