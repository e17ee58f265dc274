import pytest
from builders import pod

from extender.demand import DemandError, pod_demand
from extender.quantity import GIB


def test_split_evenly_over_gpus():
    d = pod_demand(pod("p", "40Gi", gpus=4))
    assert d.gpu_count == 4 and d.bytes_per_gpu == 10 * GIB and d.model_memory == 40 * GIB


def test_rounds_up_per_gpu():
    d = pod_demand(pod("p", "10", gpus=3))
    assert d.bytes_per_gpu == 4


def test_without_annotation_reserves_whole_gpus():
    d = pod_demand(pod("p", None, gpus=2))
    assert d.bytes_per_gpu is None and d.gpu_count == 2


def test_headroom_is_opt_in():
    assert pod_demand(pod("p", "10Gi")).bytes_per_gpu == 10 * GIB
    assert pod_demand(pod("p", "10Gi"), headroom=0.1).bytes_per_gpu == 11 * GIB


@pytest.mark.parametrize("value", ["16Gx", "0", "-1", "1e400", "NaN", "", "999Pi", "1.5.5Gi"])
def test_bad_annotation_names_annotation_and_value(value):
    with pytest.raises(DemandError) as exc:
        pod_demand(pod("p", value))
    assert "vramsched.io/model-memory" in str(exc.value) and "default/p" in str(exc.value)


def test_requests_default_from_limits_and_init_containers():
    p = pod("p", "8Gi")
    p["spec"]["containers"][0]["resources"] = {"limits": {"nvidia.com/gpu": "2"}}
    assert pod_demand(p).gpu_count == 2
    p["spec"]["initContainers"] = [
        {"name": "i", "resources": {"requests": {"nvidia.com/gpu": "3"}}}
    ]
    assert pod_demand(p).gpu_count == 3


def test_requests_are_counted_as_kube_scheduler_counts_them():
    """component-helpers `PodRequests`: sidecars (restartPolicy Always) add to the app
    containers, a plain init container runs beside the sidecars before it, pod-level resources
    replace the containers' CPU and memory, and the RuntimeClass overhead comes on top. Counted
    as a plain init container, a GPU sidecar was booked as if it gave its GPU back."""
    p = pod("p", "30Gi")
    main = p["spec"]["containers"][0]
    main["resources"] = {"limits": {"nvidia.com/gpu": "1"}, "requests": {"cpu": "2"}}

    def init(name: str, gpus: str, cpu: str, sidecar: bool) -> dict:
        c = {"name": name, "resources": {"limits": {"nvidia.com/gpu": gpus, "cpu": cpu}}}
        return {**c, "restartPolicy": "Always"} if sidecar else c

    p["spec"]["initContainers"] = [init("proxy", "1", "500m", True)]
    d = pod_demand(p)
    assert (d.gpu_count, d.cpu_milli, d.bytes_per_gpu) == (2, 2500, 15 * GIB)
    # a plain init container beside the proxy: 1 + 2 GPUs at once, more than proxy + main
    p["spec"]["initContainers"].append(init("warmup", "2", "1", False))
    assert (pod_demand(p).gpu_count, pod_demand(p).cpu_milli) == (3, 2500)
    # a sidecar after it adds to the containers' sum only: 1 + 1 + 1, still under warmup's 3
    p["spec"]["initContainers"].append(init("agent", "1", "4", True))
    assert (pod_demand(p).gpu_count, pod_demand(p).cpu_milli) == (3, 6500)
    p["spec"]["resources"] = {"requests": {"cpu": "8", "memory": "1Gi", "nvidia.com/gpu": "9"}}
    p["spec"]["overhead"] = {"cpu": "250m", "memory": "512Mi"}
    d = pod_demand(p)
    assert (d.gpu_count, d.cpu_milli, d.memory_bytes) == (3, 8250, GIB + GIB // 2)


def _resizing(spec_cpu: str, allocated: str | None, running: str | None) -> dict:
    """A bound one-GPU pod whose app container asks `spec_cpu` and whose status holds the
    kubelet's allocation and the size it runs with (None: not reported)."""
    p = pod("p", "8Gi")
    c = p["spec"]["containers"][0]
    c["name"] = "app"
    c["resources"]["requests"]["cpu"] = spec_cpu
    c["resources"]["requests"]["memory"] = "1Gi"
    status: dict = {"name": "app"}
    if allocated is not None:
        status["allocatedResources"] = {"cpu": allocated, "memory": "1Gi", "nvidia.com/gpu": "1"}
    if running is not None:
        status["resources"] = {"requests": {"cpu": running, "memory": "1Gi"}}
    p["spec"]["nodeName"] = "n1"
    p["status"] = {"phase": "Running", "containerStatuses": [status]}
    return p


@pytest.mark.parametrize(
    ("spec_cpu", "allocated", "running", "counted"),
    [
        ("2", None, None, 2000),  # no resize: the spec
        ("1", "4", "4", 4000),  # shrinking: the kubelet still holds 4 until it applies 1
        ("4", "2", "2", 4000),  # growing, not yet allocated: the spec already counts
        ("4", "4", "2", 4000),  # allocated, not yet applied
        ("1", "3", None, 3000),  # no running size reported: the allocation
    ],
)
def test_a_resizing_container_counts_the_most_of_spec_allocation_and_running(
    spec_cpu: str, allocated: str | None, running: str | None, counted: int
) -> None:
    """kube-scheduler counts a container during an in-place resize by the most of its spec, the
    kubelet's allocation and what it runs with (component-helpers `PodRequests` with status
    resources); counting the spec alone freed CPU on the node that the kubelet still holds."""
    d = pod_demand(_resizing(spec_cpu, allocated, running))
    assert (d.cpu_milli, d.memory_bytes, d.gpu_count) == (counted, GIB, 1)


def test_an_infeasible_resize_leaves_the_spec_out() -> None:
    """A resize the kubelet marks Infeasible will not happen: only what it allocated counts."""
    p = _resizing("16", "2", "2")
    assert pod_demand(p).cpu_milli == 16000
    p["status"]["conditions"] = [
        {"type": "PodResizePending", "status": "True", "reason": "Infeasible"}
    ]
    assert pod_demand(p).cpu_milli == 2000
    p["status"]["conditions"][0]["reason"] = "Deferred"  # may still happen: the spec counts
    assert pod_demand(p).cpu_milli == 16000


def test_a_resizing_sidecar_and_statuses_not_as_the_kubelet_writes_them() -> None:
    """Statuses are matched to containers by name, init containers' too, and combined by the
    sidecar rule; an entry of the wrong shape is left out, so its container counts by spec."""
    p = _resizing("1", "1", "1")
    p["spec"]["initContainers"] = [
        {
            "name": "proxy",
            "restartPolicy": "Always",
            "resources": {"requests": {"cpu": "500m", "memory": "256Mi"}},
        }
    ]
    assert pod_demand(p).cpu_milli == 1500
    p["status"]["initContainerStatuses"] = [
        {"name": "proxy", "allocatedResources": {"cpu": "2", "memory": "256Mi"}}
    ]
    assert pod_demand(p).cpu_milli == 3000
    p["status"]["initContainerStatuses"] = ["proxy", {"name": 7}, {"allocatedResources": []}]
    p["status"]["containerStatuses"] = {"app": {}}
    assert pod_demand(p).cpu_milli == 1500
    # quantities no kubelet writes leave the spec counted, rather than the pod unreadable
    for cpu in ("2x", "-1", "1e30"):
        p["status"]["containerStatuses"] = [{"name": "app", "allocatedResources": {"cpu": cpu}}]
        p["status"]["conditions"] = [{"type": "PodResizePending", "reason": "Infeasible"}]
        assert pod_demand(p).cpu_milli == 1500, cpu
    del p["status"]["conditions"]
    # GPUs cannot be resized: a GPU count in the status changes nothing
    p = _resizing("1", "1", "1")
    p["status"]["containerStatuses"][0]["allocatedResources"]["nvidia.com/gpu"] = "4"
    assert pod_demand(p).gpu_count == 1


def _pod_level_resizing(status: dict) -> dict:
    """A bound one-GPU pod with pod-level requests of 2 cores and 2 GiB, its container steady at
    1 core, and the pod-level `status` fields given."""
    p = _resizing("1", "1", "1")
    p["spec"]["resources"] = {"requests": {"cpu": "2", "memory": "2Gi"}}
    p["status"].update(status)
    return p


@pytest.mark.parametrize(
    ("status", "cpu", "memory"),
    [
        ({}, 2000, 2 * GIB),  # no resize: the pod-level spec
        # shrinking: the pod still runs at 5 cores and 3 GiB, allocated 4 cores
        (
            {
                "resources": {"requests": {"cpu": "5", "memory": "3Gi"}},
                "allocatedResources": {"cpu": "4"},
            },
            5000,
            3 * GIB,
        ),
        # allocated, not yet running at it
        (
            {"resources": {"requests": {"cpu": "2500m"}}, "allocatedResources": {"cpu": "4"}},
            4000,
            2 * GIB,
        ),
        # no running size reported: kube-scheduler reads the pod-level status only with one
        ({"allocatedResources": {"cpu": "4"}}, 2000, 2 * GIB),
        # a running size without requests still lets the allocation count
        (
            {"resources": {"limits": {"cpu": "7"}}, "allocatedResources": {"cpu": "4"}},
            4000,
            2 * GIB,
        ),
        # an infeasible resize leaves the spec out: memory, which no status sizes, falls back to
        # the container as the kubelet allocated it
        (
            {
                "resources": {"requests": {"cpu": "1500m"}},
                "allocatedResources": {"cpu": "1200m"},
                "conditions": [{"type": "PodResizePending", "reason": "Infeasible"}],
            },
            1500,
            GIB,
        ),
    ],
)
def test_a_pod_level_resize_counts_as_kube_scheduler_counts_it(
    status: dict, cpu: int, memory: int
) -> None:
    """kube-scheduler 1.36 counts pod-level CPU and memory during a pod-level in-place resize by
    the most of the spec, the running `status.resources` and `status.allocatedResources` (each
    case checked against the real one in tests/e2e/test_pod_requests_e2e.py)."""
    d = pod_demand(_pod_level_resizing(status))
    assert (d.cpu_milli, d.memory_bytes) == (cpu, memory)


def test_a_pod_level_status_sizes_only_what_the_spec_sets_and_overhead_adds() -> None:
    """A resource the pod-level spec leaves to the containers keeps their sum whatever the status
    says; the RuntimeClass overhead comes on top of a status size as of a spec one; a status no
    kubelet writes leaves the spec counted."""
    p = _pod_level_resizing(
        {"resources": {"requests": {"cpu": "4", "memory": "6Gi"}}, "allocatedResources": {}}
    )
    p["spec"]["resources"] = {"requests": {"memory": "2Gi"}}
    assert (pod_demand(p).cpu_milli, pod_demand(p).memory_bytes) == (1000, 6 * GIB)
    p["spec"]["resources"] = {"requests": {"cpu": "2"}}
    p["spec"]["overhead"] = {"cpu": "500m"}
    assert (pod_demand(p).cpu_milli, pod_demand(p).memory_bytes) == (4500, GIB)
    for bad in ("2x", "-1", "1e30", ["4"]):
        p["status"]["resources"] = {"requests": {"cpu": bad}}
        assert pod_demand(p).cpu_milli == 2500, bad


@pytest.mark.parametrize("field", ["resources", "overhead"])
def test_pod_level_fields_of_the_wrong_shape_are_named(field: str) -> None:
    p = pod("p", "8Gi")
    p["spec"][field] = ["cpu"]
    with pytest.raises(DemandError, match=f"spec.{field} is not an object"):
        pod_demand(p)


def test_absurd_gpu_count_and_fractional():
    with pytest.raises(DemandError, match="more than 64 GPUs"):
        pod_demand(pod("p", "8Gi", gpus=10**6))
    p = pod("p", "8Gi")
    p["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] = "500m"
    p["spec"]["containers"][0]["resources"]["requests"]["nvidia.com/gpu"] = "500m"
    with pytest.raises(DemandError, match="not a whole number"):
        pod_demand(p)


def test_mig_resource_and_products():
    d = pod_demand(
        pod(
            "p",
            "5Gi",
            resource="nvidia.com/mig-1g.10gb",
            annotations={"vramsched.io/gpu-products": "A, B"},
        )
    )
    assert d.mig_profile == "1g.10gb" and d.allowed_products == frozenset({"A", "B"})


def test_annotation_without_gpu_request_is_an_error():
    p = pod("p", "8Gi")
    p["spec"]["containers"][0]["resources"] = {}
    with pytest.raises(DemandError, match="requests no nvidia.com/gpu"):
        pod_demand(p)


@pytest.mark.parametrize(
    "mutate",
    [
        lambda p: p.pop("metadata"),
        lambda p: p["metadata"].pop("name"),
        lambda p: p.update(spec=None),
        lambda p: p["spec"].update(containers="x"),
        lambda p: p["spec"].update(priority="high"),
        lambda p: p["metadata"].update(annotations=["x"]),
        lambda p: p["spec"]["containers"][0]["resources"].update(limits={"cpu": "lots"}),
    ],
)
def test_malformed_pods_raise_demand_error(mutate):
    p = pod("p", "8Gi")
    mutate(p)
    with pytest.raises(DemandError):
        pod_demand(p)


@pytest.mark.parametrize(
    "requests", [{"cpu": "99999999999999999999"}, {"memory": "9223372036854775807"}]
)
def test_a_host_request_beyond_any_node_is_refused(requests):
    p = pod("p", "16Gi")
    p["spec"]["containers"][0].setdefault("resources", {})["requests"] = requests
    with pytest.raises(DemandError, match="pod default/p: cpu/memory request is more than any"):
        pod_demand(p)
    p["spec"]["containers"][0]["resources"]["requests"] = {"cpu": "64", "memory": "512Gi"}
    assert pod_demand(p).cpu_milli == 64_000
