"""What a pod needs from the GPUs: read from its annotation and its GPU resource request.

`vramsched.io/model-memory` is the total VRAM the model needs across the pod's GPUs;
`nvidia.com/gpu: N` (or a MIG resource) says on how many devices of one node it is spread.
A pod without the annotation reserves whole devices: the safe default.
"""

from __future__ import annotations

from collections.abc import (
    Callable,
    Mapping,  # the typing alias makes isinstance() 5x slower, on every pod
)
from dataclasses import dataclass
from typing import Any

from extender.inventory import GPU_RESOURCE, MIG_RESOURCE_PREFIX, is_gpu_resource
from extender.pinning import references_pin_configmap
from extender.quantity import (
    HOST_MAX,
    QuantityError,
    format_bytes,
    parse_bytes,
    parse_milli,
    parse_quantity,
)

__all__ = [
    "asks_same_gpus",
    "TERMINAL_PHASES",
    "well_formed_pod",
    "container_requests",
    "pod_requests",
    "ANNOTATION_PREFIX",
    "MODEL_MEMORY",
    "ALLOWED_PRODUCTS",
    "ASSIGNMENT",
    "GPU_INDEX",
    "PIN_ENV",
    "PIN_FIELD_PATH",
    "DemandError",
    "PodRef",
    "Demand",
    "pod_ref",
    "pod_demand",
    "reads_pin_annotation",
    "requests_gpu",
    "MAX_MODEL_MEMORY",
    "MAX_GPUS_PER_POD",
]

ANNOTATION_PREFIX = "vramsched.io/"
MODEL_MEMORY = ANNOTATION_PREFIX + "model-memory"
ALLOWED_PRODUCTS = ANNOTATION_PREFIX + "gpu-products"
ASSIGNMENT = ANNOTATION_PREFIX + "assignment"
GPU_INDEX = ANNOTATION_PREFIX + "gpu-index"
#: The variable the NVIDIA Container Toolkit selects GPUs by (deviceListStrategy: envvar).
PIN_ENV = "NVIDIA_VISIBLE_DEVICES"
#: The downward-API form of the pin: kubelet resolves it when the container starts, after the
#: binder wrote the annotation. The only spelling kubelet accepts (fieldpath.SplitMaybeSubscriptedPath).
PIN_FIELD_PATH = f"metadata.annotations['{GPU_INDEX}']"
# Larger than any GPU node that exists (8 x B200 = 1.4 TiB); beyond this a value is a typo.
MAX_MODEL_MEMORY = 64 * 1024**4
# kube-scheduler would never find a node with more; a larger request is a mistake, not a demand.
MAX_GPUS_PER_POD = 64


#: the pod phases after which its containers are gone: the kubelet holds nothing for it, and
#: kube-scheduler no longer counts it on its node
TERMINAL_PHASES = frozenset({"Succeeded", "Failed"})


class DemandError(ValueError):
    """A pod whose GPU demand cannot be understood; the message names the field and value."""


@dataclass(frozen=True, slots=True)
class PodRef:
    """Identity of a pod: `namespace/name` for people, UID to tell re-creations apart."""

    namespace: str
    name: str
    uid: str = ""

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"

    def __str__(self) -> str:
        return self.key


@dataclass(frozen=True, slots=True)
class Demand:
    """A pod's GPU demand: `gpu_count` devices of `resource` on one node, each with
    `bytes_per_gpu` free (None: whole devices)."""

    pod: PodRef
    gpu_count: int
    bytes_per_gpu: int | None
    resource: str = GPU_RESOURCE
    priority: int = 0
    cpu_milli: int = 0
    memory_bytes: int = 0
    allowed_products: frozenset[str] | None = None
    model_memory: int | None = None
    #: the pod takes the GPU pin: envFrom its pin ConfigMap (extender.pinning) or
    #: NVIDIA_VISIBLE_DEVICES from the gpu-index annotation (`pin_annotation`)
    pin_configmap: bool = False
    #: every GPU container reads NVIDIA_VISIBLE_DEVICES from the gpu-index annotation, so it sees
    #: no GPU at all unless the binder writes an index there: only pinnable GPUs will do
    pin_annotation: bool = False

    @property
    def mig_profile(self) -> str | None:
        if self.resource.startswith(MIG_RESOURCE_PREFIX):
            return self.resource[len(MIG_RESOURCE_PREFIX) :]
        return None

    @property
    def wants_gpu(self) -> bool:
        return self.gpu_count > 0

    def describe(self) -> str:
        per = "whole device" if self.bytes_per_gpu is None else format_bytes(self.bytes_per_gpu)
        return f"{self.gpu_count}x {self.resource} ({per} each)"


def asks_same_gpus(a: Demand, b: Demand) -> bool:
    """Whether two demands ask the same GPUs: as many devices of the same resource and models,
    each with the same memory. A choice of GPUs made for one holds for the other."""
    return (a.gpu_count, a.bytes_per_gpu, a.resource, a.allowed_products) == (
        b.gpu_count,
        b.bytes_per_gpu,
        b.resource,
        b.allowed_products,
    )


def well_formed_pod(pod: Mapping[str, Any]) -> bool:
    """spec and status objects, and spec.nodeName and status.phase (when set) strings: the shape
    of every pod the API server holds. A pod without it, from a hand-written file, is left out
    wherever pods are read, as one without a name is."""
    spec = pod.get("spec") or {}
    status = pod.get("status") or {}
    return (
        isinstance(spec, Mapping)
        and isinstance(status, Mapping)
        and isinstance(spec.get("nodeName") or "", str)
        # not `or ""` as for nodeName: a falsy {} would pass, and looking it up in a set raises
        and isinstance(status.get("phase"), str | None)
    )


def pod_ref(pod: Mapping[str, Any]) -> PodRef:
    meta = pod.get("metadata") if isinstance(pod, Mapping) else None
    if not isinstance(meta, Mapping):
        raise DemandError("Pod has no metadata")
    name, namespace = meta.get("name"), meta.get("namespace") or "default"
    if not isinstance(name, str) or not name:
        raise DemandError("Pod has no metadata.name")
    if not isinstance(namespace, str):
        raise DemandError("Pod metadata.namespace is not a string")
    uid = meta.get("uid") or ""
    return PodRef(namespace, name, uid if isinstance(uid, str) else str(uid))


def container_requests(container: Any) -> dict[str, Any]:
    """One container's requests, limits standing in for requests they do not state (as the API
    server fills extended resources on create); DemandError for a container not shaped so."""
    if not isinstance(container, Mapping):
        raise DemandError("a container is not an object")
    resources = container.get("resources") or {}
    if not isinstance(resources, Mapping):
        raise DemandError("container resources is not an object")
    requests = resources.get("requests") or {}
    limits = resources.get("limits") or {}
    if not isinstance(requests, Mapping) or not isinstance(limits, Mapping):
        raise DemandError("container resources.requests/limits is not an object")
    # Extended resources: requests default to limits (the API server does this on create).
    merged = dict(limits)
    merged.update(requests)
    return merged


def pod_requests(
    spec: Mapping[str, Any], status: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """The pod's request per resource, as kube-scheduler and the kubelet count it
    (component-helpers `PodRequests`): the app containers and the sidecars (init containers with
    `restartPolicy: Always`, which keep running beside them) summed; a plain init container runs
    beside the sidecars started before it, so the pod needs at least its request plus theirs;
    pod-level `resources` replace the containers' CPU and memory; the RuntimeClass `overhead`
    comes on top.

    Why sidecars matter here: the kubelet keeps a sidecar's GPUs while the app containers run
    (its device manager reuses only plain init containers' devices), so a pod with a GPU sidecar
    holds more GPUs than the largest of its containers' requests.

    With the pod's `status`, a container's CPU and memory during an in-place resize count as
    kube-scheduler counts them: the most of what the spec asks, what the kubelet allocated and
    what the container runs with, as the kubelet holds the old size until the new one is
    applied; a resize the kubelet calls infeasible leaves the spec out (it will not happen).
    Pod-level `resources` count the same way during a pod-level resize (`_pod_level_resized`).
    A status quantity that does not parse raises QuantityError, as a spec's does."""
    containers = spec.get("containers") or []
    inits = spec.get("initContainers") or []
    if not isinstance(containers, list) or not isinstance(inits, list):
        raise DemandError("Pod spec.containers is not a list")
    total = _aggregate(containers, inits, container_requests)
    statuses = _container_statuses(status)
    if statuses:
        infeasible = _resize_infeasible(status)
        allocated = _aggregate(
            containers, inits, lambda c: _resized(c, statuses, infeasible, actuated=False)
        )
        actuated = _aggregate(
            containers, inits, lambda c: _resized(c, statuses, infeasible, actuated=True)
        )
        for k in _RESIZABLE:
            sizes = [allocated.get(k, 0), actuated.get(k, 0)]
            if not infeasible:
                sizes.append(total.get(k, 0))
            if max(sizes) or k in total:
                total[k] = max(sizes)
    pod_level = spec.get("resources")
    if pod_level:
        if not isinstance(pod_level, Mapping):
            raise DemandError("Pod spec.resources is not an object")
        level = {
            k: parse_quantity(v)
            for k, v in container_requests({"resources": pod_level}).items()
            if k in _POD_LEVEL
        }
        total.update(_pod_level_resized(level, status))
    overhead = spec.get("overhead")
    if overhead:
        if not isinstance(overhead, Mapping):
            raise DemandError("Pod spec.overhead is not an object")
        _add(total, overhead)
    return total


def _aggregate(
    containers: list[Any],
    inits: list[Any],
    requests_of: Callable[[Mapping[str, Any]], Mapping[str, Any]],
) -> dict[str, Any]:
    """The containers' requests (each as `requests_of` reads it) combined by the sidecar rule of
    `pod_requests`."""
    total: dict[str, Any] = {}
    for c in containers:
        _add(total, requests_of(c))
    sidecars: dict[str, Any] = {}
    init_peak: dict[str, Any] = {}  # the most any init container's start holds at once
    for c in inits:
        own = requests_of(c)
        if c.get("restartPolicy") == "Always":
            _add(total, own)
            _add(sidecars, own)
            running = sidecars
        else:
            running = dict(sidecars)
            _add(running, own)
        for k, q in running.items():
            if q > init_peak.get(k, 0):
                init_peak[k] = q
    for k, q in init_peak.items():
        if q > total.get(k, 0):
            total[k] = q
    return total


#: the resources an in-place resize may change (the API server refuses any other)
_RESIZABLE = ("cpu", "memory")


def _container_statuses(status: Mapping[str, Any] | None) -> dict[str, Mapping[str, Any]]:
    """The pod's container statuses (app and init) by container name; entries not shaped as the
    kubelet writes them are left out, so the spec counts for their containers."""
    if not isinstance(status, Mapping):
        return {}
    found: dict[str, Mapping[str, Any]] = {}
    for group in ("initContainerStatuses", "containerStatuses"):
        entries = status.get(group)
        if not isinstance(entries, list):
            continue
        for entry in entries:
            if isinstance(entry, Mapping) and isinstance(entry.get("name"), str):
                found[entry["name"]] = entry
    return found


def _pod_level_status(spec: Mapping[str, Any], status: Mapping[str, Any] | None) -> bool:
    """Whether the pod sets pod-level resources and its status reports the running ones."""
    return bool(spec.get("resources")) and (
        isinstance(status, Mapping) and isinstance(status.get("resources"), Mapping)
    )


def _resize_infeasible(status: Mapping[str, Any] | None) -> bool:
    """Whether the kubelet marked the pod's pending resize infeasible (condition
    `PodResizePending`, reason `Infeasible`)."""
    conditions = status.get("conditions") if isinstance(status, Mapping) else None
    if not isinstance(conditions, list):
        return False
    for cond in conditions:
        if isinstance(cond, Mapping) and cond.get("type") == "PodResizePending":
            return cond.get("reason") == "Infeasible"
    return False


def _resized(
    container: Mapping[str, Any],
    statuses: Mapping[str, Mapping[str, Any]],
    infeasible: bool,
    *,
    actuated: bool,
) -> Mapping[str, Any]:
    """A container's CPU and memory as the kubelet allocated them (`allocatedResources`) or, with
    `actuated`, as it runs (`resources.requests`, else the allocation); the spec where the status
    says nothing, nothing at all for an infeasible resize (as component-helpers reads them)."""
    name = container.get("name") if isinstance(container, Mapping) else None
    status = statuses.get(name) if isinstance(name, str) else None
    found: Any = None
    if status is not None:
        if actuated:
            running = status.get("resources")
            if isinstance(running, Mapping) and isinstance(running.get("requests"), Mapping):
                found = running["requests"]
        if found is None and isinstance(status.get("allocatedResources"), Mapping):
            found = status["allocatedResources"]
    if found is None:
        if infeasible:
            return {}
        found = container_requests(container)
    return {k: v for k, v in found.items() if k in _RESIZABLE}


#: the resources pod-level `spec.resources` may set, of those vramsched reads
_POD_LEVEL = frozenset({"cpu", "memory"})


def _pod_level_resized(
    level: Mapping[str, Any], status: Mapping[str, Any] | None
) -> dict[str, Any]:
    """The pod-level CPU and memory (`level`, from the spec) during a pod-level in-place resize, as
    kube-scheduler 1.36 counts them (InPlacePodLevelResourcesVerticalScaling, on by default): once
    the kubelet reports the pod's running `status.resources`, each resource the spec sets counts
    at the most of the spec, that running size and `status.allocatedResources`, the spec left out
    of an infeasible resize. Checked against a real kube-scheduler 1.36.3
    (tests/e2e/test_pod_requests_e2e.py): a resource the spec does not set keeps its containers'
    sum, and the RuntimeClass overhead comes on top of the status sizes too."""
    if not isinstance(status, Mapping) or not isinstance(status.get("resources"), Mapping):
        return dict(level)
    infeasible = _resize_infeasible(status)
    sources = [status["resources"].get("requests"), status.get("allocatedResources")]
    out: dict[str, Any] = {}
    for k, q in level.items():
        sizes = [] if infeasible else [q]
        sizes += [
            parse_quantity(src[k]) for src in sources if isinstance(src, Mapping) and k in src
        ]
        if sizes:
            out[k] = max(sizes)
    return out


def _add(total: dict[str, Any], requests: Mapping[str, Any]) -> None:
    """Add parsed `requests` to `total` in place (no Fraction + 0 for a resource seen once)."""
    for k, v in requests.items():
        q = parse_quantity(v)
        prev = total.get(k)
        total[k] = q if prev is None else q + prev


def _env_from_pin_annotation(container: Mapping[str, Any]) -> bool:
    """The container's effective NVIDIA_VISIBLE_DEVICES (the last `env` entry of that name wins
    in kubelet, and `env` beats `envFrom`) is the downward-API reference to the gpu-index annotation."""
    env = container.get("env")
    if not isinstance(env, list):
        return False
    last: Any = None
    for entry in env:
        if isinstance(entry, Mapping) and entry.get("name") == PIN_ENV:
            last = entry
    if last is None or last.get("value"):
        return False
    source = last.get("valueFrom")
    ref = source.get("fieldRef") if isinstance(source, Mapping) else None
    return isinstance(ref, Mapping) and ref.get("fieldPath") == PIN_FIELD_PATH


def requests_gpu(container: Mapping[str, Any]) -> bool:
    """Whether a container asks for a non-zero amount of any GPU resource."""
    resources = container.get("resources")
    if not isinstance(resources, Mapping):
        return False
    for group in ("limits", "requests"):
        values = resources.get(group)
        if isinstance(values, Mapping) and any(
            isinstance(k, str) and is_gpu_resource(k) and str(v) not in ("0", "")
            for k, v in values.items()
        ):
            return True
    return False


def reads_pin_annotation(pod: Mapping[str, Any]) -> bool:
    """Whether the pod takes its GPU pin from the `vramsched.io/gpu-index` annotation.

    True when every container that requests a GPU (init containers included) sets
    `NVIDIA_VISIBLE_DEVICES` from `metadata.annotations['vramsched.io/gpu-index']` through the
    downward API. Stricter than the ConfigMap form on purpose: a GPU container without it would
    run on the device plugin's choice, not on the GPU vramsched booked.
    """
    spec = pod.get("spec") if isinstance(pod, Mapping) else None
    if not isinstance(spec, Mapping):
        return False
    gpu_containers = [
        c
        for group in ("containers", "initContainers")
        for c in (spec.get(group) or [])
        if isinstance(c, Mapping) and requests_gpu(c)
    ]
    return bool(gpu_containers) and all(_env_from_pin_annotation(c) for c in gpu_containers)


def _host_requests(ref: PodRef, requests: Mapping[str, Any]) -> tuple[int, int]:
    """CPU (millicores) and memory (bytes) of `pod_requests`' answer; DemandError if either is
    negative or more than any node has."""
    try:
        cpu = parse_milli(requests["cpu"]) if "cpu" in requests else 0
        memory = parse_bytes(requests["memory"], allow_zero=True) if "memory" in requests else 0
    except QuantityError as exc:
        raise DemandError(f"pod {ref}: invalid cpu/memory request: {exc}") from None
    if cpu > HOST_MAX or memory > HOST_MAX:
        raise DemandError(f"pod {ref}: cpu/memory request is more than any node has")
    return cpu, memory


def pod_demand(
    pod: Mapping[str, Any], *, headroom: float = 0.0, gpu_resource: str | None = None
) -> Demand:
    """Parse a Pod object (dict). Raises DemandError with a message fit for a filter `Error`.

    `headroom` is an operator option (fraction added to the declared memory); off by default
    because the declared model memory is exactly what the pod reserves. `gpu_resource` reads
    that GPU resource alone, for counting a running pod that asks several (vramsched schedules
    no such pod, but another scheduler may run one on its nodes).
    """
    ref = pod_ref(pod)
    meta = pod["metadata"]
    spec = pod.get("spec")
    if not isinstance(spec, Mapping):
        raise DemandError(f"pod {ref}: spec is missing")
    try:
        requests = pod_requests(spec)
    except QuantityError as exc:
        raise DemandError(f"pod {ref}: invalid resource quantity: {exc}") from None
    gpu_resources = {
        k: v
        for k, v in requests.items()
        if isinstance(k, str) and is_gpu_resource(k) and v != 0 and gpu_resource in (None, k)
    }
    if len(gpu_resources) > 1:
        raise DemandError(
            f"pod {ref}: requests several GPU resources ({', '.join(sorted(gpu_resources))}); use one"
        )
    resource, count = GPU_RESOURCE, 0
    if gpu_resources:
        resource, value = next(iter(gpu_resources.items()))
        if value.denominator != 1 or value < 0:
            raise DemandError(
                f"pod {ref}: {resource} request {float(value):g} is not a whole number of GPUs"
            )
        count = int(value)
        if count > MAX_GPUS_PER_POD:
            raise DemandError(
                f"pod {ref}: {resource} request {count} is more than {MAX_GPUS_PER_POD} GPUs"
            )
    annotations = meta.get("annotations") or {}
    if not isinstance(annotations, Mapping):
        raise DemandError(f"pod {ref}: metadata.annotations is not an object")
    model_memory: int | None = None
    raw = annotations.get(MODEL_MEMORY)
    if raw is not None:
        try:
            model_memory = parse_bytes(raw, maximum=MAX_MODEL_MEMORY)
        except QuantityError as exc:
            raise DemandError(
                f"pod {ref}: annotation {MODEL_MEMORY}={str(raw)[:40]!r} is invalid: {exc}"
            ) from None
        if count == 0:
            raise DemandError(
                f"pod {ref}: annotation {MODEL_MEMORY} is set but the pod requests no {GPU_RESOURCE}"
            )
    per_gpu: int | None = None
    if model_memory is not None and count:
        total = model_memory + int(model_memory * headroom)
        per_gpu = -(-total // count)
    allowed = None
    raw_products = annotations.get(ALLOWED_PRODUCTS)
    if raw_products:
        allowed = frozenset(p.strip() for p in str(raw_products).split(",") if p.strip()) or None
    priority = spec.get("priority") or 0
    if not isinstance(priority, int) or isinstance(priority, bool):
        raise DemandError(f"pod {ref}: spec.priority {priority!r} is not an integer")
    cpu, memory = _host_requests(ref, requests)
    status = pod.get("status")
    if _container_statuses(status) or _pod_level_status(spec, status):
        try:
            cpu, memory = _host_requests(ref, pod_requests(spec, status))
        except (QuantityError, DemandError):
            pass  # a status no kubelet writes (a negative size, say): the spec counts
    from_annotation = reads_pin_annotation(pod) if count else False
    pinned = from_annotation or (references_pin_configmap(pod) if count else False)
    return Demand(
        ref,
        count,
        per_gpu,
        resource,
        priority,
        cpu,
        memory,
        allowed,
        model_memory,
        pinned,
        from_annotation,
    )
