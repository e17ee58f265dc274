"""The bind writes vramsched.io/gpu-memory-fraction for the device it chose (KubeBinder against
a scripted API), and takes it away again with the assignment when the Binding is refused."""

from __future__ import annotations

from typing import Any

from builders import cluster, gpu_node, mig_single_node, pod, service
from test_kube_bind import bind_args, live

from extender.ledger import check_invariant
from extender.live.api_client import ApiError
from extender.sizing.handoff import FRACTION_ANNOTATION


def _app(p: dict[str, Any]) -> dict[str, Any]:
    """An engine vramsched does not recognise (the builders' pods run the vLLM image)."""
    p["spec"]["containers"][0]["image"] = "example.com/my-server:1"
    return p


def _vllm(p: dict[str, Any]) -> dict[str, Any]:
    p["spec"]["containers"][0]["command"] = ["vllm", "serve", "Qwen/Qwen2.5-7B-Instruct"]
    return p


async def test_fraction_of_the_whole_gpu_for_an_unrecognised_container() -> None:
    p = _app(pod("p", "20Gi"))
    service, api, _ = live([gpu_node("n1", memory_mib=81920)], [p])
    assert (await service.bind(bind_args(p, "n1"))).Error == ""
    annotations = api.calls[0][3]["metadata"]["annotations"]
    assert annotations[FRACTION_ANNOTATION] == "0.25"  # 20 GiB of 80 GiB


async def test_fraction_leaves_out_what_vllm_takes_outside_its_flag() -> None:
    p = _vllm(pod("p", "20Gi"))
    service, api, _ = live([gpu_node("n1", memory_mib=81920)], [p])
    await service.bind(bind_args(p, "n1"))
    # (20 GiB - 0.75 GiB CUDA context - 1 GiB CUDA graphs) / 80 GiB = 0.228
    assert api.calls[0][3]["metadata"]["annotations"][FRACTION_ANNOTATION] == "0.22"


async def test_fraction_of_a_mig_slice_uses_the_slice_memory() -> None:
    p = _app(pod("p", "8Gi"))
    service, api, _ = live([mig_single_node("m1", "1g.10gb", slices=7, memory_mib=9984)], [p])
    await service.bind(bind_args(p, "m1"))
    assert api.calls[0][3]["metadata"]["annotations"][FRACTION_ANNOTATION] == "0.82"  # 8192/9984


async def test_whole_device_pods_get_no_fraction() -> None:
    p = pod("p", None)
    service, api, _ = live([gpu_node("n1")], [p])
    await service.bind(bind_args(p, "n1"))
    annotations = api.calls[0][3]["metadata"]["annotations"]
    assert FRACTION_ANNOTATION in annotations and annotations[FRACTION_ANNOTATION] is None


async def test_a_refused_binding_takes_the_fraction_back() -> None:
    p = pod("p", "20Gi")
    service, api, _ = live([gpu_node("n1")], [p])
    api.fail["create_binding"] = [ApiError(403, "Forbidden", "no")]
    assert (await service.bind(bind_args(p, "n1"))).Error
    undo = api.calls[-1][3]["metadata"]["annotations"]
    assert undo[FRACTION_ANNOTATION] is None


# ----- embedded mode writes the same annotation (parity with the live binder) ---------------------


async def test_embedded_bind_writes_the_fraction_as_the_live_binder_does() -> None:
    p = _vllm(pod("p", "20Gi"))
    c = cluster(gpu_node("n1", memory_mib=81920), p)
    assert (await service(c).bind(bind_args(p, "n1"))).Error == ""
    annotations = c.pod("default/p")["metadata"]["annotations"]
    assert annotations[FRACTION_ANNOTATION] == "0.22"  # as the live test above
    assert "vramsched.io/assignment" in annotations
    assert check_invariant(c.ledger) == []


async def test_embedded_bind_of_a_whole_device_pod_drops_a_stale_fraction() -> None:
    p = pod("p", None, annotations={FRACTION_ANNOTATION: "0.99"})
    c = cluster(gpu_node("n1"), p)
    assert (await service(c).bind(bind_args(p, "n1"))).Error == ""
    assert FRACTION_ANNOTATION not in c.pod("default/p")["metadata"]["annotations"]
