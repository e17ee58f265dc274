"""Tests of the e2e harness itself: a real etcd + kube-apiserver + kube-scheduler, every version
the suite runs (and, on 1.36, kube-controller-manager and the credentials a kubelet uses)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import controlplane
import kubernetes.client
import kubernetes.config
import pytest
import yaml
from controlplane import (
    NOT_READY_TAINT,
    SCHEDULER_API_V1,
    SCHEDULER_API_V1BETA1,
    ControlPlane,
    SchedulerConfigError,
    overlay_v1,
    to_v1beta1,
)
from fake_extender import FakeExtender
from processes import free_port

GPU = "nvidia.com/gpu"


def pod_body(name: str, scheduler_name: str, gpus: int = 0) -> dict[str, Any]:
    resources: dict[str, Any] = {"requests": {"cpu": "100m", "memory": "64Mi"}}
    if gpus:
        resources["limits"] = {GPU: str(gpus)}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "schedulerName": scheduler_name,
            "containers": [{"name": "main", "image": "busybox", "resources": resources}],
        },
    }


def bound_node(core: kubernetes.client.CoreV1Api, name: str) -> str | None:
    return core.read_namespaced_pod(name, "default").spec.node_name


@pytest.mark.e2e
def test_api_answers_with_version_and_default_namespaces(cluster: ControlPlane) -> None:
    with cluster.api_client() as client:
        version = kubernetes.client.VersionApi(client).get_code()
        namespaces = {
            ns.metadata.name for ns in kubernetes.client.CoreV1Api(client).list_namespace().items
        }
    assert version.git_version == f"v{cluster.version}"
    assert {"default", "kube-system"} <= namespaces
    assert cluster.server_url.startswith("https://127.0.0.1:")
    kubeconfig = yaml.safe_load(Path(cluster.kubeconfig_path).read_text())
    assert kubeconfig["users"][0]["user"]["token"] == cluster.admin_token


@pytest.mark.e2e
def test_gpu_node_is_ready_untainted_and_has_gpus(cluster: ControlPlane) -> None:
    labels = {"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB", "nvidia.com/gpu.memory": "81920"}
    cluster.create_gpu_node(
        "gpu-a",
        labels,
        {GPU: 8},
        taints=[{"key": "dedicated", "value": "gpu", "effect": "PreferNoSchedule"}],
    )

    with cluster.api_client() as client:
        node = kubernetes.client.CoreV1Api(client).read_node("gpu-a")
    ready = [c for c in node.status.conditions if c.type == "Ready"]
    assert [c.status for c in ready] == ["True"]
    taint_keys = [t.key for t in node.spec.taints or []]
    assert NOT_READY_TAINT not in taint_keys
    assert taint_keys == ["dedicated"]  # taints the caller asked for are kept
    assert node.status.allocatable[GPU] == "8"
    assert node.status.capacity[GPU] == "8"
    assert node.metadata.labels["nvidia.com/gpu.product"] == "NVIDIA-A100-SXM4-80GB"


@pytest.mark.e2e
def test_scheduler_binds_pod_of_its_profile_and_ignores_others(cluster: ControlPlane) -> None:
    cluster.create_gpu_node("gpu-b", {}, {GPU: 4})
    cluster.start_scheduler(ControlPlane.scheduler_config("vramsched"))
    with cluster.api_client() as client:
        core = kubernetes.client.CoreV1Api(client)
        core.create_namespaced_pod("default", pod_body("other-scheduler", "someone-else"))
        core.create_namespaced_pod("default", pod_body("plain", "vramsched"))

        node = cluster.wait_for(
            lambda: bound_node(core, "plain"), timeout=60, message="pod 'plain' bound"
        )
        assert node == "gpu-b"
        conditions = core.read_namespaced_pod("plain", "default").status.conditions or []
        assert [(c.type, c.status) for c in conditions if c.type == "PodScheduled"] == [
            ("PodScheduled", "True")
        ]
        # Created first, so the scheduler had it in hand before it bound 'plain'.
        assert bound_node(core, "other-scheduler") is None


@pytest.mark.e2e
def test_scheduler_start_retries_a_port_another_process_took(
    cluster: ControlPlane, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ports are picked free and used a moment later: a port taken in between (by any
    process's outgoing connection, say) makes kube-scheduler exit at startup. start_scheduler
    then picks another, as the API server and etcd starts do."""
    taken = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    picks = iter([port])
    monkeypatch.setattr(controlplane, "free_port", lambda: next(picks, None) or free_port())
    try:
        cluster.start_scheduler(ControlPlane.scheduler_config("vramsched"))
        assert cluster.scheduler_secure_port != port and cluster.scheduler.running()
        log = (cluster.logs_dir / "kube-scheduler.log").read_text()
        assert f"listen tcp 127.0.0.1:{port}: bind: address already in use" in log
    finally:
        taken.close()


@pytest.mark.e2e
def test_apiserver_restart_keeps_etcd_data(cluster: ControlPlane) -> None:
    cluster.create_gpu_node("gpu-c", {"zone": "z1"}, {GPU: 2})
    port = cluster.apiserver_port

    cluster.stop_apiserver()
    with cluster.api_client() as client:
        with pytest.raises(Exception):
            kubernetes.client.CoreV1Api(client).read_node("gpu-c", _request_timeout=2)
    cluster.start_apiserver()

    assert cluster.apiserver_port == port
    with cluster.api_client() as client:
        node = kubernetes.client.CoreV1Api(client).read_node("gpu-c")
    assert node.metadata.labels["zone"] == "z1"
    assert node.status.allocatable[GPU] == "2"


@pytest.fixture
def recording_extender(cluster: ControlPlane) -> Iterator[FakeExtender]:
    """A permissive extender that records what the scheduler sends (harness wiring only:
    urlPrefix -> scheduler -> HTTP; vramsched's own extender has its own e2e tests)."""
    ext = FakeExtender(cluster)
    yield ext
    ext.close()


@pytest.mark.e2e
def test_scheduler_calls_extender_at_url_prefix_for_gpu_pods_only(
    cluster: ControlPlane, recording_extender: FakeExtender
) -> None:
    cluster.create_gpu_node("gpu-d", {}, {GPU: 1})
    config = ControlPlane.scheduler_config(
        "vramsched", extender_url=recording_extender.url, prioritize_verb=None
    )
    written = yaml.safe_load(cluster.start_scheduler(config).read_text())
    # 1.20 reads v1beta1 (the harness translates); 1.36 loads the v1 document as given.
    expected_api = SCHEDULER_API_V1 if cluster.release.scheduler_reads_v1 else SCHEDULER_API_V1BETA1
    assert written["apiVersion"] == expected_api
    with cluster.api_client() as client:
        core = kubernetes.client.CoreV1Api(client)
        core.create_namespaced_pod("default", pod_body("no-gpu", "vramsched"))
        core.create_namespaced_pod("default", pod_body("one-gpu", "vramsched", gpus=1))
        assert cluster.wait_for(lambda: bound_node(core, "one-gpu"), timeout=60) == "gpu-d"
        assert cluster.wait_for(lambda: bound_node(core, "no-gpu"), timeout=60) == "gpu-d"

    verbs = [c.verb for c in recording_extender.calls]
    pods = [c.pod for c in recording_extender.calls]
    assert verbs == ["filter"]  # one feasible node: no prioritize call
    assert pods == ["one-gpu"]  # managedResources: the GPU-less pod never reaches it
    sent_nodes = recording_extender.calls[0].body["Nodes"]["items"]
    assert [n["metadata"]["name"] for n in sent_nodes] == ["gpu-d"]


SHIPPED_CONFIG = Path(__file__).resolve().parents[2] / "config" / "KubeSchedulerConfiguration.yaml"


@pytest.mark.e2e
def test_shipped_scheduler_config_runs_with_leader_election_and_extender_binding(
    cluster: ControlPlane, recording_extender: FakeExtender
) -> None:
    config = yaml.safe_load(SHIPPED_CONFIG.read_text())
    election = config["leaderElection"]
    cluster.create_gpu_node("gpu-e", {}, {GPU: 2})
    cluster.create_gpu_node("gpu-f", {}, {GPU: 2})
    cluster.start_scheduler(
        SHIPPED_CONFIG.read_text(), extender_url=recording_extender.url, leader_elect=True
    )

    holder = cluster.wait_for(
        lambda: cluster.scheduler_lease_holder(
            election["resourceNamespace"], election["resourceName"]
        ),
        timeout=60,
        message="the scheduler holds its own lease",
    )
    assert holder
    with cluster.api_client() as client:
        core = kubernetes.client.CoreV1Api(client)
        core.create_namespaced_pod("default", pod_body("gpu-pod", "vramsched", gpus=1))
        node = cluster.wait_for(
            lambda: bound_node(core, "gpu-pod"), timeout=60, message="gpu-pod bound by the extender"
        )
    assert node in {"gpu-e", "gpu-f"}
    verbs = recording_extender.verbs_for("gpu-pod")
    assert verbs == ["filter", "prioritize", "bind"]  # two feasible nodes: prioritize runs
    filter_args = recording_extender.calls[0].body
    assert filter_args["Nodes"] is None  # nodeCacheCapable: names only
    assert sorted(filter_args["NodeNames"]) == ["gpu-e", "gpu-f"]


def _leaves(doc: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[tuple[Any, ...], Any]]:
    """(path, value) of every scalar in a parsed YAML/JSON document."""
    if isinstance(doc, dict):
        for key, value in doc.items():
            yield from _leaves(value, (*path, key))
    elif isinstance(doc, list):
        for i, value in enumerate(doc):
            yield from _leaves(value, (*path, i))
    else:
        yield path, doc


def _lookup(doc: Any, path: tuple[Any, ...], zero: Any) -> Any:
    """The value at ``path``, or ``zero`` where Go's ``omitempty`` left a zero value out."""
    for key in path:
        try:
            doc = doc[key]
        except (KeyError, IndexError, TypeError):
            return type(zero)()
    return doc


def test_overlay_changes_only_the_url_prefix_line_and_appends_the_kubeconfig() -> None:
    shipped = SHIPPED_CONFIG.read_text()
    out = overlay_v1(shipped, kubeconfig="/tmp/x/scheduler.kubeconfig", extender_url="http://h:1")
    old, new = shipped.splitlines(), out.splitlines()
    removed = [line for line in old if line not in new]
    added = [line for line in new if line not in old]
    assert removed == ['  - urlPrefix: "http://127.0.0.1:8888"']
    assert added == [
        '  - urlPrefix: "http://h:1"',
        "clientConnection:",
        '  kubeconfig: "/tmp/x/scheduler.kubeconfig"',
    ]
    assert new[: len(old)] == [added[0] if line == removed[0] else line for line in old]
    with pytest.raises(SchedulerConfigError, match="clientConnection"):
        overlay_v1(out, kubeconfig="/tmp/y", extender_url=None)  # only ever applied once


@pytest.mark.e2e
@pytest.mark.k8s(
    "1.36",
    reason="kube-scheduler 1.20 reads kubescheduler.config.k8s.io/v1beta1: the harness "
    "translates the shipped v1 file there, so it cannot load it as shipped",
)
def test_kube_scheduler_loads_the_shipped_file_as_shipped_plus_the_overlay(
    cluster: ControlPlane, recording_extender: FakeExtender
) -> None:
    """The file kube-scheduler reads is the shipped bytes with only the overlay's lines changed,
    and /configz (what it parsed) holds every shipped value, the overlay's two fields aside."""
    shipped_text = SHIPPED_CONFIG.read_text()
    path = cluster.start_scheduler(
        shipped_text, extender_url=recording_extender.url, leader_elect=True
    )
    loaded_text = path.read_text()
    assert loaded_text == overlay_v1(
        shipped_text,
        kubeconfig=cluster.scheduler_kubeconfig_path,
        extender_url=recording_extender.url,
    )
    assert f"--config={path}" in cluster.scheduler.argv
    loaded = json.loads(cluster.scheduler_get("/configz"))["componentconfig"]
    overlay = {
        ("clientConnection", "kubeconfig"): str(cluster.scheduler_kubeconfig_path),
        **{
            ("extenders", i, "urlPrefix"): recording_extender.url
            for i in range(len(yaml.safe_load(shipped_text)["extenders"]))
        },
    }
    compared = 0
    for leaf, value in _leaves(yaml.safe_load(shipped_text)):
        if leaf in overlay:
            continue
        assert _lookup(loaded, leaf, value) == value, leaf
        compared += 1
    for leaf, value in overlay.items():
        assert _lookup(loaded, leaf, value) == value, leaf
    assert compared > 50  # every managed resource, verb, election and profile field
    assert loaded["leaderElection"]["leaderElect"] is True
    election = loaded["leaderElection"]
    assert cluster.wait_for(
        lambda: cluster.scheduler_lease_holder(
            election["resourceNamespace"], election["resourceName"]
        ),
        timeout=60,
        message="the scheduler holds the shipped config's lease",
    )


@pytest.mark.e2e
def test_service_account_kubeconfig_carries_rbac_of_that_account(cluster: ControlPlane) -> None:
    path = cluster.service_account_kubeconfig("vramsched-system", "extender")
    sa_client = kubernetes.config.new_client_from_config(config_file=str(path))
    with sa_client:
        sa_core = kubernetes.client.CoreV1Api(sa_client)
        with pytest.raises(kubernetes.client.ApiException) as denied:
            sa_core.list_node()
        assert denied.value.status == 403
        with cluster.api_client() as admin:
            kubernetes.client.RbacAuthorizationV1Api(admin).create_cluster_role_binding(
                {
                    "metadata": {"name": "e2e-extender-reads-nodes"},
                    "roleRef": {
                        "apiGroup": "rbac.authorization.k8s.io",
                        "kind": "ClusterRole",
                        "name": "system:kube-scheduler",
                    },
                    "subjects": [
                        {
                            "kind": "ServiceAccount",
                            "name": "extender",
                            "namespace": "vramsched-system",
                        }
                    ],
                }
            )
        try:
            cluster.wait_for(
                lambda: sa_core.list_node() is not None, timeout=30, message="RBAC grant visible"
            )
        finally:
            with cluster.api_client() as admin:
                kubernetes.client.RbacAuthorizationV1Api(admin).delete_cluster_role_binding(
                    "e2e-extender-reads-nodes"
                )


@pytest.mark.e2e
@pytest.mark.k8s(
    "1.36", reason="build.sh builds no kube-controller-manager and no kubelet for 1.20"
)
def test_controller_manager_recreates_pods_and_kubelet_credentials_name_the_node(
    cluster: ControlPlane,
) -> None:
    """What the kubelet and Deployment tests build on: a kubelet's kubeconfig authenticates as
    system:node:<name> in system:nodes, and a Deployment re-creates a deleted pod."""
    creds = cluster.kubelet_credentials("node-x")
    with kubernetes.config.new_client_from_config(config_file=str(creds.kubeconfig)) as client:
        review = kubernetes.client.AuthenticationV1Api(client).create_self_subject_review(
            {"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"}
        )
    assert review.status.user_info.username == "system:node:node-x"
    assert "system:nodes" in review.status.user_info.groups
    assert creds.serving_cert.exists() and creds.ca == cluster.ca_path

    cluster.start_controller_manager()
    labels = {"app": "kcm-e2e"}
    with cluster.api_client() as client:
        kubernetes.client.AppsV1Api(client).create_namespaced_deployment(
            "default",
            {
                "metadata": {"name": "kcm-e2e"},
                "spec": {
                    "replicas": 1,
                    "selector": {"matchLabels": labels},
                    "template": {
                        "metadata": {"labels": labels},
                        # nobody schedules it: the pod only has to exist
                        "spec": {**pod_body("x", "nobody")["spec"]},
                    },
                },
            },
        )
        core = kubernetes.client.CoreV1Api(client)

        def pod_uids() -> set[str]:
            pods = core.list_namespaced_pod("default", label_selector="app=kcm-e2e").items
            return {p.metadata.uid for p in pods if not p.metadata.deletion_timestamp}

        (first,) = cluster.wait_for(pod_uids, timeout=60, message="the ReplicaSet creates a pod")
        (pod,) = core.list_namespaced_pod("default", label_selector="app=kcm-e2e").items
        core.delete_namespaced_pod(pod.metadata.name, "default", grace_period_seconds=0)
        (second,) = cluster.wait_for(
            lambda: pod_uids() - {first}, timeout=60, message="the deleted pod is re-created"
        )
        kubernetes.client.AppsV1Api(client).delete_namespaced_deployment("kcm-e2e", "default")
    assert second != first


@pytest.mark.e2e
def test_stop_leaves_no_process_behind(tmp_path: Path, control_plane: ControlPlane) -> None:
    cp = ControlPlane(tmp_path / "cp", version=control_plane.version, bin_dir=control_plane.bin_dir)
    cp.start()
    try:
        cp.start_scheduler(ControlPlane.scheduler_config("vramsched"))
        pids = [c.proc.pid for c in (cp.etcd, cp.apiserver, cp.scheduler) if c and c.proc]
        assert len(pids) == 3
        assert all(_alive(pid) for pid in pids)
    finally:
        cp.stop()
    assert not [pid for pid in pids if _alive(pid)]


CRASHING_SESSION = """
import os, sys, time
sys.path.insert(0, {here!r})
from controlplane import ControlPlane
cp = ControlPlane({workdir!r}, version={version!r}, bin_dir={bin_dir!r}).start()
print(cp.etcd.proc.pid, cp.apiserver.proc.pid, flush=True)
time.sleep(600)
"""


@pytest.mark.e2e
def test_components_die_with_a_killed_test_process(
    tmp_path: Path, control_plane: ControlPlane
) -> None:
    script = CRASHING_SESSION.format(
        here=str(Path(__file__).parent),
        workdir=str(tmp_path / "cp"),
        version=control_plane.version,
        bin_dir=str(control_plane.bin_dir),
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert len(pids) == 2 and all(_alive(pid) for pid in pids)
    finally:
        proc.kill()  # SIGKILL: no atexit, no finally in the child
        proc.wait()
    control_plane.wait_for(
        lambda: not [pid for pid in pids if _alive(pid)],
        timeout=15,
        message="etcd and kube-apiserver gone after their parent was killed",
    )


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_v1_config_is_translated_for_kube_scheduler_1_20() -> None:
    v1 = yaml.safe_load(ControlPlane.scheduler_config("vramsched", extender_url="http://x/s"))
    out = to_v1beta1(v1)
    assert out["apiVersion"] == SCHEDULER_API_V1BETA1
    assert out["percentageOfNodesToScore"] == 100  # hoisted: 1.20 has no per-profile value
    assert "percentageOfNodesToScore" not in out["profiles"][0]
    assert out["extenders"] == v1["extenders"]
    assert v1["apiVersion"] == "kubescheduler.config.k8s.io/v1"  # input left untouched


def test_v1_config_that_1_20_cannot_express_is_refused() -> None:
    multipoint = {
        "apiVersion": "kubescheduler.config.k8s.io/v1",
        "profiles": [{"schedulerName": "a", "plugins": {"multiPoint": {}}}],
    }
    with pytest.raises(SchedulerConfigError, match="multiPoint"):
        to_v1beta1(multipoint)
    disagree = {
        "profiles": [
            {"schedulerName": "a", "percentageOfNodesToScore": 50},
            {"schedulerName": "b", "percentageOfNodesToScore": 100},
        ]
    }
    with pytest.raises(SchedulerConfigError, match="percentageOfNodesToScore"):
        to_v1beta1(disagree)
