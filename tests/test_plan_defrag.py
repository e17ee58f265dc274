"""`vramsched plan-defrag` reads a live cluster through the API, as `vramsched top` does.

A stub API server (plain HTTP, the two list calls the informers' first sync makes) serves the
same Nodes and Pods as a cluster file; the plan read through `--kubeconfig` (the kubernetes
client, `LiveSource`) must be the plan read from the file.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml
from builders import gpu_node, pod

from extender.assignment import encode_assignment
from extender.cli import main
from extender.demand import PodRef
from extender.ledger import Reservation
from extender.quantity import GIB


def bound_pod(name: str, node: str, dev: str, gib: int, namespace: str = "default"):
    res = Reservation(PodRef(namespace, name), node, (dev,), (gib * GIB,))
    p = pod(
        name,
        f"{gib}Gi",
        node=node,
        namespace=namespace,
        phase="Running",
        annotations=encode_assignment(res),
        scheduler="vramsched",
    )
    p["metadata"].setdefault("uid", f"uid-{name}")
    p["metadata"]["resourceVersion"] = "1"
    return p


def cluster_objects() -> list[dict]:
    return [
        gpu_node("g0", count=2, memory_mib=80 * 1024, replicas=4),
        gpu_node("g1", count=1, memory_mib=80 * 1024, replicas=4),
        bound_pod("a", "g0", "0", 20),
        bound_pod("b", "g0", "1", 20),
        bound_pod("c", "g1", "0", 30, namespace="prod"),
    ]


class StubApi(BaseHTTPRequestHandler):
    """GET /api/v1/nodes, pods, persistentvolumeclaims, persistentvolumes, services and
    replicationcontrollers, storage.k8s.io's csinodes, volumeattachments and storageclasses, and
    apps' replicasets and statefulsets: the objects as one page of a List."""

    objects: list[dict] = []
    #: answer 403 to the claims and volumes, as a role without them does
    refuse_storage = False
    #: answer 403 to the Services, as a role without them does
    refuse_services = False

    def do_GET(self) -> None:
        path = self.path.split("?")[0]
        if self.refuse_storage and path.startswith("/api/v1/persistentvolume"):
            self.send_error(403)
            return
        if self.refuse_services and path == "/api/v1/services":
            self.send_error(403)
            return
        kinds = {
            "/api/v1/nodes": "Node",
            "/api/v1/pods": "Pod",
            "/api/v1/persistentvolumeclaims": "PersistentVolumeClaim",
            "/api/v1/persistentvolumes": "PersistentVolume",
            "/apis/storage.k8s.io/v1/csinodes": "CSINode",
            "/apis/storage.k8s.io/v1/volumeattachments": "VolumeAttachment",
            "/apis/storage.k8s.io/v1/storageclasses": "StorageClass",
            "/api/v1/services": "Service",
            "/api/v1/replicationcontrollers": "ReplicationController",
            "/apis/apps/v1/replicasets": "ReplicaSet",
            "/apis/apps/v1/statefulsets": "StatefulSet",
        }
        if path not in kinds:
            self.send_error(404)
            return
        # as the API lists them: the items name no kind
        items = [
            {k: v for k, v in o.items() if k != "kind"}
            for o in self.objects
            if o["kind"] == kinds[path]
        ]
        body = json.dumps(
            {"kind": kinds[path] + "List", "metadata": {"resourceVersion": "7"}, "items": items}
        ).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def api_server(tmp_path: Path):
    StubApi.objects = cluster_objects()
    StubApi.refuse_storage = False
    StubApi.refuse_services = False
    server = ThreadingHTTPServer(("127.0.0.1", 0), StubApi)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [
                    {"name": "c", "cluster": {"server": f"http://127.0.0.1:{server.server_port}"}}
                ],
                "users": [{"name": "u", "user": {"token": "x"}}],
                "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}],
                "current-context": "c",
            }
        )
    )
    yield kubeconfig
    server.shutdown()


def plan(capsys, *argv: str) -> dict:
    assert main(["plan-defrag", *argv, "--json", "--workers", "1"]) == 0
    out = json.loads(capsys.readouterr().out)
    out.pop("seconds")
    return out


def test_the_api_and_a_cluster_file_give_the_same_plan(api_server, tmp_path, capsys):
    f = tmp_path / "c.yaml"
    f.write_text(yaml.safe_dump({"apiVersion": "v1", "kind": "List", "items": cluster_objects()}))
    from_file = plan(capsys, "--cluster", str(f))
    assert from_file["gpusFreed"] == 2 and len(from_file["moves"]) == 2
    assert plan(capsys, "--kubeconfig", str(api_server)) == from_file
    limited = plan(capsys, "--kubeconfig", str(api_server), "--max-moves", "1")
    assert limited["gpusFreed"] == 1 and len(limited["moves"]) == 1


def test_a_bad_source_is_one_line(tmp_path, capsys):
    assert main(["plan-defrag", "--kubeconfig", "/no/such/kubeconfig"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(
        "vramsched plan-defrag: cannot load the Kubernetes client configuration from /no/such"
    )
    assert err.count("\n") == 1
    assert main(["plan-defrag", "--cluster", str(tmp_path / "missing.yaml")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("vramsched plan-defrag: cannot read") and err.count("\n") == 1


def _write(tmp_path: Path, objects: list[dict]) -> str:
    f = tmp_path / "c.yaml"
    f.write_text(yaml.safe_dump({"apiVersion": "v1", "kind": "List", "items": objects}))
    return str(f)


def test_moves_go_only_where_kube_scheduler_lets_the_new_copy(tmp_path, capsys):
    """Unrestricted, the plan moves a and b beside c on g1; kept to pool a (g0), they share one
    GPU of g0 and c joins them."""
    free = plan(capsys, "--cluster", _write(tmp_path, cluster_objects()))
    assert {m["pod"]: m["to_node"] for m in free["moves"]} == {"default/a": "g1", "default/b": "g1"}
    objects = cluster_objects()
    objects[0]["metadata"]["labels"]["pool"] = "a"
    for p in objects[2:4]:
        p["spec"]["nodeSelector"] = {"pool": "a"}
    kept = plan(capsys, "--cluster", _write(tmp_path, objects))
    assert kept["gpusFreed"] == 2 and kept["leftOut"] == {} and len(kept["moves"]) == 2
    assert {m["to_node"] for m in kept["moves"]} == {"g0"}
    assert "prod/c" in {m["pod"] for m in kept["moves"]}
    # a taint on g0 that c does not tolerate: c stays, and a and b share a GPU of g0
    objects[0]["spec"] = {"taints": [{"key": "gpu", "effect": "NoSchedule"}]}
    for p in objects[2:4]:
        p["spec"]["tolerations"] = [{"key": "gpu", "operator": "Exists"}]
    tainted = plan(capsys, "--cluster", _write(tmp_path, objects))
    assert tainted["gpusFreed"] == 1 and len(tainted["moves"]) == 1
    assert tainted["moves"][0]["pod"] in ("default/a", "default/b")


def with_volume(objects: list[dict], *pools: str) -> list[dict]:
    """Pod a mounts claim data, bound to a volume that only nodes labelled pool=<one of pools>
    reach (g0 is labelled pool=a, g1 pool=b)."""
    objects[0]["metadata"]["labels"]["pool"] = "a"
    objects[1]["metadata"]["labels"]["pool"] = "b"
    objects[2]["spec"]["volumes"] = [{"name": "d", "persistentVolumeClaim": {"claimName": "data"}}]
    term = {"matchExpressions": [{"key": "pool", "operator": "In", "values": list(pools)}]}
    return [
        *objects,
        {
            "kind": "PersistentVolumeClaim",
            "metadata": {
                "name": "data",
                "namespace": "default",
                "annotations": {"pv.kubernetes.io/bind-completed": "yes"},
            },
            "spec": {"volumeName": "pv-data"},
        },
        {
            "kind": "PersistentVolume",
            "metadata": {"name": "pv-data"},
            "spec": {"nodeAffinity": {"required": {"nodeSelectorTerms": [term]}}},
        },
    ]


def test_a_pod_moves_only_where_its_volume_reaches(api_server, tmp_path, capsys):
    """With a's volume reaching both nodes, a and b move to g1, as without volumes. With it
    reaching only g0, no move takes a off g0, read from a file or from the API; with a file that
    holds no claims, a never moves."""
    free = plan(capsys, "--cluster", _write(tmp_path, with_volume(cluster_objects(), "a", "b")))
    assert {m["pod"]: m["to_node"] for m in free["moves"]} == {"default/a": "g1", "default/b": "g1"}
    kept_objects = with_volume(cluster_objects(), "a")
    kept = plan(capsys, "--cluster", _write(tmp_path, kept_objects))
    assert kept["gpusFreed"] >= 1
    assert all(m["to_node"] == "g0" for m in kept["moves"] if m["pod"] == "default/a")
    StubApi.objects = kept_objects
    assert plan(capsys, "--kubeconfig", str(api_server)) == kept
    no_claims = [o for o in kept_objects if o["kind"] in ("Node", "Pod")]
    unread = plan(capsys, "--cluster", _write(tmp_path, no_claims))
    assert "default/a" not in {m["pod"] for m in unread["moves"]}
    StubApi.objects, StubApi.refuse_storage = with_volume(cluster_objects(), "a", "b"), True
    assert main(["plan-defrag", "--kubeconfig", str(api_server), "--json"]) == 0
    out, err = capsys.readouterr()
    assert "default/a" not in {m["pod"] for m in json.loads(out)["moves"]}
    assert err.startswith("vramsched plan-defrag: cannot list claims and volumes from the API")
    assert err.endswith("; pods with claims stay put\n") and err.count("\n") == 1


def with_disks(objects: list[dict], limit: int) -> list[dict]:
    """Pods a (on g0) and c (on g1) each mount a CSI disk of one driver; g1's CSINode takes
    `limit` of them. c is kept to g1 by a nodeSelector, so a plan that frees two GPUs moves a
    and b to g1."""
    driver = "disk.csi.example.com"
    objects[1]["metadata"]["labels"]["pool"] = "b"
    objects[4]["spec"]["nodeSelector"] = {"pool": "b"}
    extra: list[dict] = [
        {
            "kind": "CSINode",
            "metadata": {"name": "g1"},
            "spec": {
                "drivers": [{"name": driver, "nodeID": "g1", "allocatable": {"count": limit}}]
            },
        }
    ]
    for p in (objects[2], objects[4]):
        name, ns = p["metadata"]["name"], p["metadata"]["namespace"]
        p["spec"]["volumes"] = [{"name": "d", "persistentVolumeClaim": {"claimName": name}}]
        extra.append(
            {
                "kind": "PersistentVolumeClaim",
                "metadata": {"name": name, "namespace": ns},
                "spec": {"volumeName": f"pv-{name}"},
            }
        )
        csi = {"driver": driver, "volumeHandle": name}
        extra.append(
            {"kind": "PersistentVolume", "metadata": {"name": f"pv-{name}"}, "spec": {"csi": csi}}
        )
    return [*objects, *extra]


@pytest.mark.parametrize("limit", [1, 2])
def test_a_move_keeps_to_the_targets_attach_limit(api_server, tmp_path, capsys, limit):
    """Without limits a and b move to g1. Where g1 takes one disk and c's is there, a's move is
    left out and said, read from a file or from the API; where it takes two, a moves."""
    objects = with_disks(cluster_objects(), limit)
    found = plan(capsys, "--cluster", _write(tmp_path, objects))
    moved = {m["pod"]: m["to_node"] for m in found["moves"]}
    if limit == 2:
        assert moved == {"default/a": "g1", "default/b": "g1"} and found["leftOut"] == {}
        return
    assert moved.get("default/a") != "g1"
    assert found["leftOut"] == {
        "default/a": "node g1 attaches at most 1 volume(s) of disk.csi.example.com and would hold 2"
    }
    StubApi.objects = objects
    assert plan(capsys, "--kubeconfig", str(api_server)) == found
    # a file without the CSINodes cannot tell: a and c stay on their nodes, and stderr says so
    no_limits = [o for o in objects if o["kind"] != "CSINode"]
    assert main(["plan-defrag", "--cluster", _write(tmp_path, no_limits), "--json"]) == 0
    out, err = capsys.readouterr()
    unread = json.loads(out)
    assert unread["leftOut"] == {} and unread["status"] != "REFUSED"
    assert all(m["to_node"] == m["from_node"] for m in unread["moves"] if m["pod"] != "default/b")
    assert err.endswith("2 pod(s) whose volumes attach limits count stay on their nodes\n"), err


def test_a_move_that_breaks_anti_affinity_is_left_out_and_said(tmp_path, capsys):
    """a and b keep one replica per node: moving either beside the other frees a GPU, and
    kube-scheduler would keep its new copy off that node."""
    objects = [
        gpu_node("g0", count=1, memory_mib=80 * 1024, replicas=4),
        gpu_node("g1", count=1, memory_mib=80 * 1024, replicas=4),
        bound_pod("a", "g0", "0", 20),
        bound_pod("b", "g1", "0", 20),
    ]
    for p in objects[2:]:
        p["metadata"]["labels"] = {"app": "x"}
        term = {
            "labelSelector": {"matchLabels": {"app": "x"}},
            "topologyKey": "kubernetes.io/hostname",
        }
        p["spec"]["affinity"] = {
            "podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [term]}
        }
    for n in objects[:2]:
        n["metadata"]["labels"]["kubernetes.io/hostname"] = n["metadata"]["name"]
    out = plan(capsys, "--cluster", _write(tmp_path, objects))
    assert out["moves"] == [] and out["gpusFreed"] == 0
    assert sorted(out["leftOut"]) == ["default/a", "default/b"]
    assert all("anti-affinity" in why for why in out["leftOut"].values())
    assert main(["plan-defrag", "--cluster", _write(tmp_path, objects), "--workers", "1"]) == 0
    text = capsys.readouterr().out
    assert "left out: default/a: kube-scheduler would refuse its move (node g1:" in text


SPREAD_CONFIG = """
apiVersion: kubescheduler.config.k8s.io/v1
kind: KubeSchedulerConfiguration
profiles:
  - schedulerName: vramsched
    pluginConfig:
      - name: PodTopologySpread
        args:
          defaultingType: List
          defaultConstraints:
            - {maxSkew: 1, topologyKey: zone, whenUnsatisfiable: DoNotSchedule}
"""


def spread_objects() -> list[dict]:
    """a on g0 (zone z0) and b on g1 (z1), both selected by Service x: moving either beside the
    other frees a GPU, and a profile that spreads by zone keeps its new copy off."""
    objects = [
        gpu_node("g0", count=1, memory_mib=80 * 1024, replicas=4),
        gpu_node("g1", count=1, memory_mib=80 * 1024, replicas=4),
        bound_pod("a", "g0", "0", 20),
        bound_pod("b", "g1", "0", 20),
        {
            "kind": "Service",
            "metadata": {"name": "x", "namespace": "default"},
            "spec": {"selector": {"app": "x"}},
        },
        # a Service of the same name in another namespace is another object
        {
            "kind": "Service",
            "metadata": {"name": "x", "namespace": "prod"},
            "spec": {"selector": {"app": "x"}},
        },
    ]
    for zone, n in enumerate(objects[:2]):
        n["metadata"]["labels"]["zone"] = f"z{zone}"
    for p in objects[2:4]:
        p["metadata"]["labels"] = {"app": "x"}
    return objects


def test_the_profiles_default_spread_keeps_moves_off(api_server, tmp_path, capsys):
    config = tmp_path / "scheduler.yaml"
    config.write_text(SPREAD_CONFIG)
    source = _write(tmp_path, spread_objects())
    assert plan(capsys, "--cluster", source)["gpusFreed"] == 1
    kept = plan(capsys, "--cluster", source, "--scheduler-config", str(config))
    assert kept["moves"] == [] and sorted(kept["leftOut"]) == ["default/a", "default/b"]
    assert all("over its maxSkew 1" in why for why in kept["leftOut"].values())
    # the same read from the API server, Services listed there
    StubApi.objects = spread_objects()
    live = ["--kubeconfig", str(api_server), "--scheduler-config", str(config)]
    assert plan(capsys, *live) == kept


def test_a_bad_scheduler_config_or_unread_services_stop_it(api_server, tmp_path, capsys):
    config = tmp_path / "scheduler.yaml"
    config.write_text(SPREAD_CONFIG.replace("List", "Lists"))
    source = _write(tmp_path, spread_objects())
    assert main(["plan-defrag", "--cluster", source, "--scheduler-config", str(config)]) == 2
    err = capsys.readouterr().err
    assert err == (
        f"vramsched plan-defrag: --scheduler-config {config}: PodTopologySpread defaultingType "
        "'Lists' is not List or System\n"
    )
    config.write_text(SPREAD_CONFIG)
    StubApi.objects = spread_objects()
    StubApi.refuse_services = True
    live = ["--kubeconfig", str(api_server), "--scheduler-config", str(config)]
    assert main(["plan-defrag", *live]) == 2
    err = capsys.readouterr().err
    assert err.startswith(
        "vramsched plan-defrag: cannot list the Services and controllers the scheduler profile's "
        "default spread selects by from the API server"
    )
    assert "403" in err and err.count("\n") == 1
