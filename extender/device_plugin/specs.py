"""What a container is given for its GPUs, per `--device-list-strategy`. Pure: no I/O.

The same artefacts NVIDIA's k8s-device-plugin returns (internal/plugin/server.go
`getAllocateResponse`), so the NVIDIA Container Toolkit on the node (or the CDI-aware runtime)
does the rest exactly as with NVIDIA's plugin:

- `envvar`: `NVIDIA_VISIBLE_DEVICES=<uuid>[,<uuid>]`;
- `volume-mounts`: `NVIDIA_VISIBLE_DEVICES=/var/run/nvidia-container-devices` and one mount per
  GPU of `/dev/null` at `/var/run/nvidia-container-devices/<uuid>` (the toolkit reads the names;
  used where the toolkit refuses the variable from unprivileged containers);
- `cdi-annotations`: annotation `cdi.k8s.io/vramsched-device-plugin_<request id>` =
  `nvidia.com/gpu=<uuid>,...` for a CDI-enabled runtime;
- `cdi-cri`: the CDI device names in the CRI field (`cdi_devices`, containerd 1.7+).

Strategies combine as there: with only CDI strategies no variable is set. Every response also
carries `VRAMSCHED_GPU_INDEX` (the assigned indices), which no runtime reads: it is for people.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from extender.plugin_state import ASSIGNMENT_ENV

__all__ = [
    "STRATEGIES",
    "VISIBLE_DEVICES",
    "MOUNT_ROOT",
    "CDI_KIND",
    "ContainerSpec",
    "parse_strategies",
    "container_spec",
]

STRATEGIES = ("envvar", "volume-mounts", "cdi-annotations", "cdi-cri")
_CDI = frozenset({"cdi-annotations", "cdi-cri"})
VISIBLE_DEVICES = "NVIDIA_VISIBLE_DEVICES"
MOUNT_ROOT = "/var/run/nvidia-container-devices"
MOUNT_HOST_PATH = "/dev/null"
CDI_KIND = "nvidia.com/gpu"
CDI_ANNOTATION_PREFIX = "cdi.k8s.io/"
CDI_PLUGIN_NAME = "vramsched-device-plugin"


@dataclass(frozen=True, slots=True)
class ContainerSpec:
    """One container's share of an AllocateResponse, before it becomes a protobuf message."""

    envs: dict[str, str] = field(default_factory=dict)
    mounts: list[tuple[str, str]] = field(default_factory=list)  # (container path, host path)
    annotations: dict[str, str] = field(default_factory=dict)
    cdi_devices: list[str] = field(default_factory=list)


def parse_strategies(raw: str | Iterable[str]) -> tuple[str, ...]:
    """`envvar`, `volume-mounts,cdi-cri`, ...: a comma list of known strategies, in that order."""
    items = raw.split(",") if isinstance(raw, str) else list(raw)
    names = [s.strip() for s in items if s.strip()]
    unknown = [s for s in names if s not in STRATEGIES]
    if unknown or not names:
        raise ValueError(
            f"--device-list-strategy {','.join(names) or '(empty)'}: "
            f"each must be one of {', '.join(STRATEGIES)}"
        )
    return tuple(s for s in STRATEGIES if s in names)


def container_spec(
    strategies: Sequence[str], uuids: Sequence[str], indices: Sequence[int], request_id: str
) -> ContainerSpec:
    """The container's envs, mounts, annotations and CDI devices for GPUs `uuids`.

    `request_id` names the CDI annotation (unique per response, as NVIDIA's uuid there)."""
    out = ContainerSpec()
    out.envs[ASSIGNMENT_ENV] = ",".join(map(str, indices))
    cdi_names = [f"{CDI_KIND}={u}" for u in uuids]
    if "cdi-annotations" in strategies and cdi_names:
        name = f"{CDI_PLUGIN_NAME}_{request_id}"
        if len(name) > 63:  # the CDI annotation key limit (container-device-interface)
            raise ValueError(f"CDI request id {request_id!r} is too long")
        out.annotations[CDI_ANNOTATION_PREFIX + name] = ",".join(cdi_names)
    if "cdi-cri" in strategies:
        out.cdi_devices.extend(cdi_names)
    if all(s in _CDI for s in strategies):
        return out
    if "envvar" in strategies:
        out.envs[VISIBLE_DEVICES] = ",".join(uuids)
    if "volume-mounts" in strategies:
        out.envs[VISIBLE_DEVICES] = MOUNT_ROOT
        out.mounts.extend((f"{MOUNT_ROOT}/{u}", MOUNT_HOST_PATH) for u in uuids)
    return out
