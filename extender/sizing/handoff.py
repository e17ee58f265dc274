"""The bind-time hand-off of a pod's VRAM share to its engine (pure).

At bind vramsched knows the device a pod got; it writes the engine's memory flag for that
device into the `vramsched.io/gpu-memory-fraction` annotation. The admission webhook points
an env var at the annotation through the downward API, so kubelet resolves it when the
container starts (the binder writes annotations before the Binding), and a template says
`--gpu-memory-utilization=$(VRAMSCHED_GPU_MEMORY_FRACTION)`.

The value is the reservation per GPU over the device's memory, minus what the pod's engine
takes outside its flag (extender.sizing.engines), rounded down to 0.01. For a container whose
engine is not recognised, it is exactly reservation / device memory.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from extender.demand import ANNOTATION_PREFIX, DemandError, pod_demand, requests_gpu
from extender.sizing.engine_args import Invocation, parse_container
from extender.sizing.engines import Overhead, fraction, outside

__all__ = [
    "FRACTION_ANNOTATION",
    "FRACTION_ENV",
    "FRACTION_FIELD_PATH",
    "ENGINE_ANNOTATION",
    "ENGINE_ARGS_ANNOTATION",
    "MODEL_ANNOTATION",
    "gpu_containers",
    "pod_engine",
    "engine_hint",
    "pod_fraction",
    "bind_fraction",
    "format_fraction",
]

FRACTION_ANNOTATION = ANNOTATION_PREFIX + "gpu-memory-fraction"
FRACTION_ENV = "VRAMSCHED_GPU_MEMORY_FRACTION"
#: The only spelling of a downward-API annotation reference kubelet accepts.
FRACTION_FIELD_PATH = f"metadata.annotations['{FRACTION_ANNOTATION}']"
#: Optional: the engine when it cannot be read from the command (a custom entrypoint).
ENGINE_ANNOTATION = ANNOTATION_PREFIX + "engine"
#: `inject`: the webhook appends the engine's memory flag to the container's args.
ENGINE_ARGS_ANNOTATION = ANNOTATION_PREFIX + "engine-args"
#: The model a pod serves, when its args do not say (a catalogue name).
MODEL_ANNOTATION = ANNOTATION_PREFIX + "model"


def _annotations(pod: Mapping[str, Any]) -> Mapping[str, Any]:
    meta = pod.get("metadata") if isinstance(pod, Mapping) else None
    ann = meta.get("annotations") if isinstance(meta, Mapping) else None
    return ann if isinstance(ann, Mapping) else {}


def gpu_containers(pod: Mapping[str, Any]) -> Iterable[tuple[int, Mapping[str, Any]]]:
    """(index, container) of the pod's regular containers that request a GPU."""
    spec = pod.get("spec") if isinstance(pod, Mapping) else None
    containers = spec.get("containers") if isinstance(spec, Mapping) else None
    for i, c in enumerate(containers if isinstance(containers, list) else []):
        if isinstance(c, Mapping) and requests_gpu(c):
            yield i, c


def engine_hint(pod: Mapping[str, Any]) -> str | None:
    """The engine the pod names in vramsched.io/engine (lower case), None when it names none."""
    return str(_annotations(pod).get(ENGINE_ANNOTATION) or "").strip().lower() or None


def pod_engine(pod: Mapping[str, Any]) -> Invocation | None:
    """The first GPU container's engine, if recognised (or named by vramsched.io/engine)."""
    hint = engine_hint(pod)
    for _, container in gpu_containers(pod):
        found = parse_container(container, hint)
        if found is not None:
            return found
    return None


def format_fraction(value: float) -> str:
    return f"{value:.2f}"


def pod_fraction(pod: Mapping[str, Any], per_device: Iterable[tuple[int, int]]) -> str:
    """The annotation value for a pod holding `per_device` = (reserved bytes, device memory)
    on each of its devices: the smallest device's share sets it (one flag for all ranks)."""
    invocation = pod_engine(pod)
    shares = []
    for reserved, memory in per_device:
        out = outside(invocation.settings, memory) if invocation is not None else 0
        shares.append(fraction(reserved, memory, Overhead(0, out)))
    return format_fraction(min(shares) if shares else 0.0)


def bind_fraction(
    pod: Mapping[str, Any], device_ids: Iterable[str], devices: Iterable[Any]
) -> str | None:
    """The fraction annotation for a pod bound to `device_ids` (of `devices`: inventory devices
    with device_id and memory_bytes); None when it declared no model-memory (whole devices:
    the engine's own default is right) or its devices are unknown."""
    try:
        per_gpu = pod_demand(pod).bytes_per_gpu  # declared memory, without the operator's headroom
    except DemandError:
        return None
    if per_gpu is None:
        return None
    memory = {d.device_id: d.memory_bytes for d in devices}
    pairs = [(per_gpu, memory[i]) for i in device_ids if i in memory]
    return pod_fraction(pod, pairs) if pairs else None
