"""deploy/device-plugin: the DaemonSet of vramsched's device plugin, where it runs, the kubelet
folders it mounts (the plugin's own defaults) and its RBAC.
"""

from __future__ import annotations

from typing import Any

from deploy_objects import (
    PLUGIN,
    check_object,
    kustomize,
    load,
    one,
)

from extender.cli import build_parser


def plugin_daemonset() -> dict[str, Any]:
    return one(load(PLUGIN / "daemonset.yaml"), "DaemonSet", "vramsched-device-plugin")


def test_kustomize_renders_the_device_plugin() -> None:
    docs = kustomize(PLUGIN)
    for doc in docs:
        check_object(doc)
    got = {(d["kind"], d["metadata"].get("namespace"), d["metadata"]["name"]) for d in docs}
    ns = "vramsched-device-plugin"
    assert got == {
        ("Namespace", None, ns),
        ("ServiceAccount", ns, ns),
        ("ClusterRole", None, ns),
        ("ClusterRoleBinding", None, ns),
        ("DaemonSet", ns, ns),
    }


def test_device_plugin_runs_where_labelled_with_the_kubelets_sockets() -> None:
    spec = plugin_daemonset()["spec"]["template"]["spec"]
    assert spec["nodeSelector"] == {"vramsched.io/device-plugin": "true"}
    assert spec["serviceAccountName"] == "vramsched-device-plugin"
    (c,) = spec["containers"]
    assert c["command"] == ["vramsched", "device-plugin"]
    args = build_parser().parse_args(["device-plugin", *c["args"]])
    defaults = build_parser().parse_args(["device-plugin"])
    env = {e["name"]: e for e in c["env"]}
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    hostpaths = {v["name"]: v["hostPath"]["path"] for v in spec["volumes"] if "hostPath" in v}
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    # the plugin's defaults are where the DaemonSet mounts the kubelet's folders
    assert mounts["device-plugins"] == hostpaths["device-plugins"] == defaults.device_plugin_dir
    assert (
        f"{mounts['pod-resources']}/kubelet.sock"
        == f"{hostpaths['pod-resources']}/kubelet.sock"
        == defaults.pod_resources_socket
    )
    (port,) = c["ports"]
    assert port["containerPort"] == args.probe_port
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
    sc = c["securityContext"]
    assert sc["capabilities"] == {"drop": ["ALL"]} and sc["allowPrivilegeEscalation"] is False
    assert not sc.get("privileged", False) and sc["readOnlyRootFilesystem"] is True


def test_device_plugin_role_reads_pods_and_patches_only_nodes() -> None:
    role = one(load(PLUGIN / "rbac.yaml"), "ClusterRole")
    assert sorted((tuple(r["resources"]), tuple(r["verbs"])) for r in role["rules"]) == [
        (("nodes",), ("get", "patch")),
        (("pods",), ("get", "list", "watch")),
    ]
    binding = one(load(PLUGIN / "rbac.yaml"), "ClusterRoleBinding")
    assert [(s["namespace"], s["name"]) for s in binding["subjects"]] == [
        ("vramsched-device-plugin", "vramsched-device-plugin")
    ]
