"""`vramsched top` / `why` (and `kubectl vramsched`) on the demo cluster: a file and a running
extender, as a user runs them (output piped, so plain text), plus the one-line errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import orjson
import pytest
import yaml
from demo_server import DEMO, ROOT, DemoServer, gpu_pod

from extender.cli import main

GIB = 1 << 30


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_top_on_the_demo_file_is_plain_text_sorted_with_a_summary(capsys) -> None:
    code, out, err = run(capsys, "top", "--cluster", str(DEMO))
    assert code == 0 and err == ""
    assert "\x1b[" not in out  # piped: no colour
    lines = out.splitlines()
    assert lines[0].split()[:4] == ["NODE", "GPU", "PRODUCT", "SHARING"]
    assert all(line == line.rstrip() for line in lines)
    row = next(line for line in lines if line.startswith("a100-ts-0"))
    assert "64Gi/80Gi" in row and "2/4" in row and "inference/llama3-8b-0 24Gi" in row
    assert any(line.strip() == "inference/qwen25-32b-awq-0 40Gi" for line in lines)
    assert lines[-1] == (
        "1 of 18 GPUs in use, 17 fully free; VRAM allocated 64Gi of 1.4Ti (4.5%); "
        "stranded 0B; 2 pods on 4 nodes"
    )
    assert "cpu-only-0" not in out  # not a GPU node: only with --wide
    code, wide, _ = run(capsys, "top", "--cluster", str(DEMO), "-o", "wide")
    assert "missing label nvidia.com/gpu.product" in wide and "STRANDED" in wide


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("nodeName", [1]),
        ("nodeName", {"a": 1}),
        ("spec", ["a100-ts-0"]),
        ("status", "Running"),
        ("phase", {}),  # tested against a set of terminal phases: TypeError, unhashable
        ("phase", ["Running"]),
        ("resources", {"requests": {"cpu": "99999999999999999999"}}),
    ],
)
def test_a_malformed_pod_in_a_file_changes_nothing(tmp_path, capsys, field, value) -> None:
    """A pod no API server would hold (a list for nodeName, a string for status, a request
    beyond any node) is left out: top shows the rest as before, and simulate and plan-defrag
    read the file (these crashed with TypeError and OverflowError)."""
    doc = yaml.safe_load(DEMO.read_text())
    extra = {"apiVersion": "v1", "kind": "Pod", **gpu_pod("odd", "8Gi")}
    extra["spec"]["nodeName"] = "a100-ts-1"
    if field == "resources":
        extra["spec"]["containers"][0]["resources"].update(value)
    elif field == "nodeName":
        extra["spec"]["nodeName"] = value
    elif field == "phase":
        extra["status"] = {"phase": value}
    else:
        extra[field] = value
    doc["items"].append(extra)
    odd = tmp_path / "odd.yaml"
    odd.write_text(yaml.safe_dump(doc))
    _, before, _ = run(capsys, "top", "--cluster", str(DEMO), "-o", "json")
    code, after, err = run(capsys, "top", "--cluster", str(odd), "-o", "json")
    assert code == 0 and err == "" and orjson.loads(after) == orjson.loads(before)
    assert run(capsys, "plan-defrag", "--cluster", str(odd), "--time-limit", "2")[0] == 0
    assert (
        run(capsys, "simulate", "--nodes", str(odd), "--pods", str(odd), "--policy", "fgd")[0] == 0
    )


def test_top_json_yaml_and_filters(capsys) -> None:
    code, out, _ = run(capsys, "top", "--cluster", str(DEMO), "-o", "json")
    doc = orjson.loads(out)
    assert doc["summary"]["gpusInUse"] == 1 and doc["summary"]["usedBytes"] == 64 * GIB
    assert yaml.safe_load(run(capsys, "top", "--cluster", str(DEMO), "-o", "yaml")[1]) == doc
    doc = orjson.loads(
        run(capsys, "top", "--cluster", str(DEMO), "--product", "h100", "-o", "json")[1]
    )
    assert [n["name"] for n in doc["nodes"]] == ["h100-excl-0", "h100-mps-0"]
    doc = orjson.loads(
        run(capsys, "top", "--cluster", str(DEMO), "-n", "inference", "-o", "json")[1]
    )
    assert [(n["name"], [d["id"] for d in n["devices"]]) for n in doc["nodes"]] == [
        ("a100-ts-0", ["0"])
    ]
    doc = orjson.loads(
        run(
            capsys,
            "top",
            "--cluster",
            str(DEMO),
            "--node",
            "a100-*",
            "--sort",
            "name",
            "-o",
            "json",
        )[1]
    )
    assert [n["name"] for n in doc["nodes"]] == ["a100-ts-0", "a100-ts-1"]


def test_colour_only_on_a_terminal() -> None:
    env = dict(os.environ, FORCE_COLOR="1", COLUMNS="200")
    env.pop("NO_COLOR", None)
    out = subprocess.run(
        [sys.executable, "-m", "extender", "top", "--cluster", str(DEMO)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "\x1b[" in out


def test_why_on_the_demo_file(capsys) -> None:
    code, out, err = run(capsys, "why", "--cluster", str(DEMO), "-n", "inference", "mistral-7b-0")
    assert code == 0 and err == ""
    assert (
        out.splitlines()[0] == "pod inference/mistral-7b-0 asks for 1x nvidia.com/gpu (16Gi each)"
    )
    assert "fits now on 4 of 5 nodes" in out
    doc = orjson.loads(
        run(capsys, "why", "--cluster", str(DEMO), "inference/mistral-7b-0", "-o", "json")[1]
    )
    assert doc["feasible"] == ["a100-ts-0", "a100-ts-1", "h100-excl-0", "h100-mps-0"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["why", "--cluster", str(DEMO), "nope"], "error: pod default/nope not found"),
        (
            ["top", "--cluster", "/no/such/file.yaml"],
            "error: cannot read /no/such/file.yaml: No such file or directory",
        ),
        (["top", "--server", "http://127.0.0.1:9"], "error: cannot reach http://127.0.0.1:9/state"),
        (["top", "--server", "127.0.0.1:8888"], "error: --server '127.0.0.1:8888' is not an http"),
        (["top", "--server", "http://[::1"], "error: cannot reach http://[::1/state: Invalid IPv6"),
        (["top", "--cluster", str(DEMO), "--server", "http://x"], "error: choose one source"),
        (
            ["top", "--kubeconfig", "/no/such/kubeconfig"],
            "error: cannot load the Kubernetes client configuration from /no/such/kubeconfig",
        ),
    ],
)
def test_bad_input_is_one_line(capsys, argv, message) -> None:
    code, out, err = run(capsys, *argv)
    assert code == 1 and out == ""
    assert err.startswith(message) and err.count("\n") == 1, err


def test_unreachable_api_server_is_one_line(capsys, tmp_path: Path) -> None:
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "c", "cluster": {"server": "https://127.0.0.1:9"}}],
                "users": [{"name": "u", "user": {"token": "x"}}],
                "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}],
                "current-context": "c",
            }
        )
    )
    code, out, err = run(capsys, "top", "--kubeconfig", str(kubeconfig))
    message = f"error: cannot list nodes from the API server ({kubeconfig})"
    assert code == 1 and out == ""
    assert err.startswith(message) and err.count("\n") == 1, err


def test_top_and_why_against_a_running_extender(tmp_path: Path, capsys) -> None:
    server = DemoServer(tmp_path / "serve.log")
    try:
        assert server.schedule(gpu_pod("big-70b", "150Gi", gpus=2)) is not None
        for i in range(3):
            assert server.schedule(gpu_pod(f"small-{i}", "20Gi")) is not None
        code, out, err = run(capsys, "top", "--server", server.url, "-o", "json")
        assert code == 0, err
        doc = orjson.loads(out)
        held = {p["pod"]: p["bytes"] for n in doc["nodes"] for d in n["devices"] for p in d["pods"]}
        assert held["inference/big-70b"] == 75 * GIB  # 150Gi over its two GPUs
        assert held["inference/small-0"] == 20 * GIB
        assert doc["summary"]["usedBytes"] == (64 + 150 + 60) * GIB
        text = run(capsys, "top", "--server", server.url)[1]
        assert "inference/big-70b 75Gi" in text
    finally:
        server.stop()


def test_kubectl_finds_the_plugin_on_path() -> None:
    """kubectl (installed by `make deps`) runs `kubectl-vramsched` from PATH."""
    bindir = Path(sys.executable).parent
    assert (bindir / "kubectl-vramsched").exists(), "installed by `pip install -e .` (make venv)"
    env = dict(os.environ, PATH=f"{bindir}{os.pathsep}{os.environ['PATH']}")
    out = subprocess.run(
        ["kubectl", "vramsched", "top", "--cluster", str(DEMO), "-o", "json"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert orjson.loads(out)["summary"]["gpus"] == 18
    usage = subprocess.run(
        ["kubectl", "vramsched", "--help"], env=env, capture_output=True, text=True
    ).stdout
    assert usage.startswith("usage: kubectl vramsched") and "serve" not in usage


@pytest.mark.parametrize("kind", ["Node", "Pod"])
def test_a_file_naming_one_object_twice_is_one_line(capsys, tmp_path: Path, kind: str) -> None:
    """The last object of one name stood for both without a word, whatever the first held. The
    same reader serves `why`, `plan-defrag`, `plan-mig`, `simulate` and `serve --cluster`."""
    items = list(yaml.safe_load(DEMO.read_text())["items"])
    first = next(o for o in items if o["kind"] == kind)
    path = tmp_path / "twice.yaml"
    path.write_text(yaml.safe_dump({"apiVersion": "v1", "kind": "List", "items": [*items, first]}))
    code, out, err = run(capsys, "top", "--cluster", str(path))
    meta = first["metadata"]
    name = (
        f"pod {meta.get('namespace') or 'default'}/{meta['name']}"
        if kind == "Pod"
        else f"node {meta['name']}"
    )
    assert code == 1 and out == ""
    assert err == f"error: cannot read {path}: {name} is given more than once\n"


def _demo_state() -> dict:
    from extender.observe.sources import cluster_from_file
    from extender.observe.usage import state_nodes, usage_from_ledger

    cluster = cluster_from_file(str(DEMO))
    return {"nodes": state_nodes(usage_from_ledger(cluster.ledger, cluster.pods))}


@pytest.mark.parametrize(
    ("field", "value", "says"),
    [
        # read with int(): -2**63 drew a bar of 2**63 characters, which never finished
        ("usedBytes", -1, "usedBytes=-1 is not a whole number"),
        ("memoryBytes", 1.5e20, "memoryBytes=1.5e+20 is not a whole number"),
        ("replicas", True, "replicas=True is not a whole number"),
        ("index", "0", "index='0' is not a whole number"),
        ("product", 0, "product=0 is not a string"),  # rich could not print it: a traceback
    ],
)
def test_a_state_document_vramsched_would_not_write_is_one_line(
    capsys, monkeypatch, field: str, value: object, says: str
) -> None:
    """`top --server` pointed at another program, or one that answers odd numbers."""
    doc = _demo_state()
    doc["nodes"][0]["gpus"][0][field] = value
    monkeypatch.setattr("extender.commands.top.state_from_server", lambda url: doc)
    code, out, err = run(capsys, "top", "--server", "http://x")
    assert code == 1 and out == ""
    assert err.startswith("error: http://x: not a vramsched /state document (ValueError: ")
    assert says in err and err.count("\n") == 1, err


def test_a_device_over_its_memory_and_sums_beyond_64_bits_still_print(capsys, monkeypatch) -> None:
    """Each value is one vramsched could write; the node's sum is beyond 64 bits, which orjson
    refuses (a TypeError traceback under `-o json`). A device over its memory fills its bar."""
    doc = _demo_state()
    gpus = doc["nodes"][0]["gpus"][:3]
    for g in gpus:
        g["memoryBytes"], g["usedBytes"] = 2**62 + 2**61, 2**63 - 1
    monkeypatch.setattr("extender.commands.top.state_from_server", lambda url: doc)
    code, out, _ = run(capsys, "top", "--server", "http://x", "-o", "json")
    assert code == 0
    report = json.loads(out)  # the standard library: orjson reads 64 bits at most
    (node,) = [n for n in report["nodes"] if n["name"] == doc["nodes"][0]["name"]]
    assert len(gpus) == 3 and node["usedBytes"] == 3 * (2**63 - 1) > 2**64  # beyond uint64
    code, out, _ = run(capsys, "top", "--server", "http://x")
    assert code == 0 and out.count("█" * 10) >= 2
