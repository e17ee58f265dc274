"""deploy/examples: what users copy to run a GPU workload through vramsched. Each example asks
only for managed resources, its engine's memory flag fits its reservation, and the sizing,
time-slicing, MIG and pinning examples agree with what vramsched reads.
"""

from __future__ import annotations

from collections import Counter
from fractions import Fraction
from typing import Any

import pytest
import yaml
from builders import apply_json_patch
from deploy_objects import (
    EXAMPLES,
    example_workloads,
    flag_value,
    load,
    pod_specs,
    requested_resources,
    scheduler_config,
    the_extender,
)

from extender import mig
from extender.demand import MODEL_MEMORY, pod_demand
from extender.inventory import GPU_RESOURCE, is_gpu_resource, node_inventory
from extender.quantity import MIB, parse_bytes
from extender.sizing.engines import FLAGS, EngineSettings, outside
from extender.sizing.handoff import FRACTION_ENV, FRACTION_FIELD_PATH, pod_engine, pod_fraction
from extender.webhook.admission import decide


def test_examples_request_only_managed_resources_through_vramsched() -> None:
    managed = {m["name"] for m in the_extender()["managedResources"]}
    profile = scheduler_config()["profiles"][0]["schedulerName"]
    workloads = example_workloads()
    assert len(workloads) >= 3
    for path, doc in workloads:
        for meta, spec in pod_specs(doc):
            gpu = {r for r in requested_resources(spec) if is_gpu_resource(r)}
            assert gpu and gpu <= managed, f"{path.name}: {gpu}"
            assert spec["schedulerName"] == profile, path.name
            pod = admitted(meta, spec)
            demand = pod_demand(pod)
            annotations = pod["metadata"]["annotations"]
            assert demand.model_memory == parse_bytes(annotations[MODEL_MEMORY]) > 0


def admitted(meta: dict[str, Any], spec: dict[str, Any]) -> dict[str, Any]:
    """A workload's pod as the admission webhook lets it in (memory filled, env var added)."""
    pod = {"metadata": {"name": "x", "namespace": "default", **meta}, "spec": spec}
    decision = decide(pod)
    assert decision.allowed, decision.message
    return apply_json_patch(pod, decision.patch)


def _device_memory_bytes(spec: dict[str, Any]) -> int:
    """Memory of the device the pod lands on: from its nodeSelector (whole GPU) or the MIG node labels."""
    (resource,) = {r for r in requested_resources(spec) if is_gpu_resource(r)}
    if resource == GPU_RESOURCE:
        return int(spec["nodeSelector"]["nvidia.com/gpu.memory"]) * MIB
    labels = load(EXAMPLES / "mig-mixed-node.yaml")[0]["metadata"]["labels"]
    profile = mig.profile_from_resource(resource)
    return int(labels[f"nvidia.com/mig-{profile}.memory"]) * MIB


def test_vllm_memory_fraction_matches_the_reservation() -> None:
    checked = 0
    for path, doc in example_workloads():
        for meta, spec in pod_specs(doc):
            (vllm,) = spec["containers"]
            if "--gpu-memory-utilization" not in vllm["args"]:
                continue  # set at bind time: test_sizing_examples_*
            fraction = Fraction(flag_value(vllm["args"], "--gpu-memory-utilization"))
            reserved = parse_bytes(meta["annotations"][MODEL_MEMORY])
            device = _device_memory_bytes(spec)
            # vLLM's budget plus what it takes outside it (the CUDA context and graphs) stays
            # inside the reservation, wasting at most the 1% of the device rounding to 0.01 may,
            # as the fraction vramsched hands out at bind does.
            used = fraction * device + outside(EngineSettings("vllm"), device)
            assert used <= reserved, f"{path.name}: {float(used) / 2**30:.2f} GiB"
            assert reserved - used <= device / 100, f"{path.name}: {float(used) / 2**30:.2f} GiB"
            # and vLLM 0.21 and later keep the graphs outside the budget, as counted here
            env = {e["name"]: e.get("value") for e in vllm.get("env", [])}
            assert env.get("VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS") == "0", path.name
            checked += 1
    assert checked >= 3


SIZING_EXAMPLES = ("vllm-sizing.yaml", "tgi-sizing.yaml", "sglang-sizing.yaml")


@pytest.mark.parametrize("name", SIZING_EXAMPLES)
def test_sizing_examples_hand_the_bind_time_fraction_to_their_engine(name: str) -> None:
    (doc,) = [d for d in load(EXAMPLES / name) if d["kind"] == "Deployment"]
    ((meta, spec),) = list(pod_specs(doc))
    decision = decide({"metadata": {"name": "x", "namespace": "default", **meta}, "spec": spec})
    assert not any("run out" in w or "cannot size" in w for w in decision.warnings), (
        decision.warnings
    )
    pod = admitted(meta, spec)
    (engine_container,) = pod["spec"]["containers"]
    env = {e["name"]: e for e in engine_container["env"]}
    assert env[FRACTION_ENV]["valueFrom"]["fieldRef"]["fieldPath"] == FRACTION_FIELD_PATH
    invocation = pod_engine(pod)
    assert invocation is not None
    flag = FLAGS[invocation.engine]
    assert f"{flag}=$({FRACTION_ENV})" in engine_container["args"]
    # At bind, on any device the reservation fits: the engine's flag plus what it takes outside
    # the flag stays inside the reservation, and rounding wastes at most 1% of the device.
    per_gpu = pod_demand(pod).bytes_per_gpu
    assert per_gpu is not None
    checked = 0
    for device in (24 * 2**30, 40 * 2**30, 48 * 2**30, 80 * 2**30, 141 * 2**30):
        if per_gpu > device:
            continue
        share = Fraction(pod_fraction(pod, [(per_gpu, device)]))
        used = share * device * (Fraction(90, 100) if invocation.engine == "tgi" else 1)
        used += outside(invocation.settings, device)
        assert used <= per_gpu, (name, device)
        assert per_gpu - used <= device / 100 + (
            device * share / 10 if invocation.engine == "tgi" else 0
        )
        checked += 1
    assert checked >= 2


def test_time_slicing_example_shares_a_managed_resource() -> None:
    managed = {m["name"] for m in the_extender()["managedResources"]}
    cm = load(EXAMPLES / "time-slicing-config.yaml")[0]
    for key, text in cm["data"].items():
        cfg = yaml.safe_load(text)
        assert cfg["version"] == "v1", key
        ts = cfg["sharing"]["timeSlicing"]
        assert ts["failRequestsGreaterThanOne"] is True
        for r in ts["resources"]:
            assert r["replicas"] >= 2
            advertised = r["name"] + ".shared" if ts.get("renameByDefault") else r["name"]
            assert advertised in managed
    # the vLLM example selects the nodes this config produces
    node_labels = {"nvidia.com/gpu.sharing-strategy": "time-slicing"}
    dep = load(EXAMPLES / "vllm-inference.yaml")[0]
    assert node_labels.items() <= dep["spec"]["template"]["spec"]["nodeSelector"].items()


def test_mig_example_layouts_are_valid_and_match_the_example_node() -> None:
    cfg = yaml.safe_load(load(EXAMPLES / "mig-mixed-config.yaml")[0]["data"]["config.yaml"])
    node = load(EXAMPLES / "mig-mixed-node.yaml")[0]
    labels = node["metadata"]["labels"]
    layout_name = labels["nvidia.com/mig.config"]
    model = mig.model_for_product(labels["nvidia.com/gpu.product"])
    assert model is not None
    totals: Counter[str] = Counter()
    gpus = 0
    for entry in cfg["mig-configs"][layout_name]:
        assert entry["mig-enabled"] is True, "whole GPUs on a MIG node are not placed by vramsched"
        assert mig.is_valid_geometry(model, entry["mig-devices"]), entry
        for profile, count in entry["mig-devices"].items():
            totals[mig.resource_name(profile)] += count * len(entry["devices"])
        gpus += len(entry["devices"])
    alloc = {
        k: int(v)
        for k, v in node["status"]["allocatable"].items()
        if k.startswith("nvidia.com/mig-")
    }
    assert alloc == dict(totals)
    assert int(labels["nvidia.com/gpu.count"]) == gpus
    inv = node_inventory(node)
    assert inv.problem is None and inv.gpu_count == gpus
    assert Counter(d.resource for d in inv.devices) == totals
    for d in inv.devices:
        assert d.memory_bytes == int(labels[f"nvidia.com/mig-{d.profile}.memory"]) * MIB


def test_pinned_example_reads_the_configmap_named_after_the_pod() -> None:
    pod = load(EXAMPLES / "pinned-inference.yaml")[0]
    assert pod["kind"] == "Pod", "the ConfigMap name needs the pod name, known only for bare Pods"
    (vllm,) = pod["spec"]["containers"]
    refs = [e["configMapRef"] for e in vllm["envFrom"]]
    assert refs == [{"name": f"vramsched-{pod['metadata']['name']}", "optional": False}]


def test_pinned_deployment_example_reads_the_gpu_index_annotation() -> None:
    dep = load(EXAMPLES / "pinned-deployment.yaml")[0]
    assert dep["kind"] == "Deployment", (
        "the downward-API form is the one that works without per-pod names"
    )
    ((meta, spec),) = pod_specs(dep)
    pod = {"metadata": {"name": "any-random-name", "namespace": "default", **meta}, "spec": spec}
    demand = pod_demand(pod)
    assert demand.pin_annotation and demand.pin_configmap  # pinned pod, no ConfigMap needed
    assert not any("envFrom" in c for c in spec["containers"])
    assert "vramsched.io/gpu-index" not in meta.get("annotations", {}), (
        "vramsched writes it at bind time"
    )
    # Pinning happens only on time-sliced GPUs: the example must select them.
    assert spec["nodeSelector"]["nvidia.com/gpu.sharing-strategy"] == "time-slicing"
