"""GPU inventory of a node, read from NVIDIA GPU Feature Discovery labels and allocatable.

A *device* is anything with its own VRAM that pods are placed on: a whole GPU
(exclusive, time-sliced or MPS-shared) or a MIG slice. The ledger only ever
sees devices; this module is the one place that knows how GFD spells them.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from functools import partial
from typing import Any

from extender.plugin_state import (
    SERVED_LABEL,
    STATE_ANNOTATION,
    StateError,
    decode_state,
    is_plugin_served,
)
from extender.quantity import (
    HOST_MAX,
    INTEGER,
    MIB,
    QuantityError,
    parse_bytes,
    parse_milli,
    parse_quantity,
)

__all__ = [
    "Sharing",
    "ReplicaPolicy",
    "Gpu",
    "MigSlice",
    "Device",
    "NodeInventory",
    "node_inventory",
    "GPU_RESOURCE",
    "SHARED_GPU_RESOURCE",
    "MIG_RESOURCE_PREFIX",
    "is_gpu_resource",
    "MigLabels",
    "read_mig_labels",
    "replicas_label",
    "MAX_DEVICES_PER_NODE",
    "MAX_REPLICAS",
    "NO_GPUS",
]

LABEL = "nvidia.com/"
GPU_RESOURCE = "nvidia.com/gpu"
SHARED_GPU_RESOURCE = "nvidia.com/gpu.shared"
MIG_RESOURCE_PREFIX = "nvidia.com/mig-"
_MIG_LABEL = re.compile(
    r"^nvidia\.com/mig-(\d+g\.\d+gb(?:\+me|\.me)?(?:\.[a-z0-9+]+)?)\.count$", re.ASCII
)
_MIG_SINGLE_PRODUCT = re.compile(r"-MIG-(\d+g\.\d+gb(?:\+me)?)$", re.ASCII)
_MIG_COUNT_OR_MEMORY = re.compile(r"^nvidia\.com/(mig-.+)\.(count|memory)$")
# Guards against a label typo turning one node into millions of devices.
MAX_DEVICES_PER_NODE = 512
MAX_REPLICAS = 1024
#: the problem of a node whose labels say it has no GPUs (`gpu.count` 0): not a mistake
NO_GPUS = "node advertises no GPUs"
#: a memory label's largest value, in MiB (16 TiB)
MAX_MEMORY_MIB = 1 << 24


def is_gpu_resource(name: str) -> bool:
    """Whether a resource name is one of the GPU resources the NVIDIA device plugin advertises."""
    return (
        name == GPU_RESOURCE or name == SHARED_GPU_RESOURCE or name.startswith(MIG_RESOURCE_PREFIX)
    )


class Sharing(StrEnum):
    """How pods share one device; decides what the ledger may put on it."""

    EXCLUSIVE = "exclusive"
    TIME_SLICING = "time-slicing"
    MPS = "mps"


class ReplicaPolicy(StrEnum):
    """How the physical GPU of a time-sliced replica is chosen on the nodes (the node side's
    device plugin; extender.stock_plugin has the rules and the bound that follow from it).

    `distributed`/`packed`: by the stock device plugin with that policy; vramsched keeps the
    node-level worst-case bound. `pinned`: by vramsched, handed to the container through the
    per-pod ConfigMap or the downward API (gpu-index annotation); per-GPU accounting is then exact.
    """

    DISTRIBUTED = "distributed"
    PACKED = "packed"
    PINNED = "pinned"

    @classmethod
    def live(cls, requested: ReplicaPolicy | str | None, pin_gpus: bool = False) -> ReplicaPolicy:
        """Live mode's policy: the one asked for, else the stock device plugin's default
        (`distributed`), or `pinned` with --pin-gpus. Live mode always has one: something always
        picks a time-sliced replica's GPU."""
        if requested:
            return cls(requested)
        return cls.PINNED if pin_gpus else cls.DISTRIBUTED


@dataclass(frozen=True, slots=True)
class Gpu:
    """A whole physical GPU, possibly shared by time-slicing or MPS replicas."""

    node: str
    index: int
    product: str
    memory_bytes: int
    replicas: int
    sharing: Sharing
    resource: str
    #: vramsched's device plugin serves the node (extender.plugin_state): a container gets
    #: exactly this GPU, so its books are exact whatever the replica policy
    plugin_served: bool = False

    @property
    def device_id(self) -> str:
        return str(self.index)

    @property
    def gpu_index(self) -> int:
        return self.index

    @property
    def profile(self) -> str | None:
        return None

    @property
    def per_pod_cap_bytes(self) -> int:
        """MPS caps each client at memory/replicas (the daemon's pinned-memory limit)."""
        if self.sharing is Sharing.MPS:
            return self.memory_bytes // self.replicas
        return self.memory_bytes


@dataclass(frozen=True, slots=True)
class MigSlice:
    """One MIG device: isolated memory, so it is capacity of its own, never shared with its GPU."""

    node: str
    gpu_index: int
    profile: str
    slot: int
    product: str
    memory_bytes: int
    replicas: int
    resource: str

    @property
    def device_id(self) -> str:
        return f"{self.gpu_index}:{self.profile}:{self.slot}"

    @property
    def sharing(self) -> Sharing:
        return Sharing.TIME_SLICING if self.replicas > 1 else Sharing.EXCLUSIVE

    @property
    def per_pod_cap_bytes(self) -> int:
        return self.memory_bytes


Device = Gpu | MigSlice


@dataclass(frozen=True, slots=True)
class NodeInventory:
    """What vramsched may place on a node. `problem` says why a node is not a GPU node for us."""

    name: str
    devices: tuple[Device, ...] = ()
    cpu_milli: int = 0
    memory_bytes: int = 0
    product: str = ""
    mig_strategy: str = "none"
    problem: str | None = None
    labels: Mapping[str, str] = field(default_factory=dict, repr=False, compare=False)
    resource_version: str = ""

    @property
    def gpu_count(self) -> int:
        return len({d.gpu_index for d in self.devices})


def _int_label(
    labels: Mapping[str, str], key: str, *, minimum: int = 0, maximum: int = 1 << 20
) -> int:
    """`_label_int` for a label the node's inventory needs: its problem is the node's."""
    if labels.get(key) is None:
        raise _Missing(f"missing label {key}")
    try:
        return _label_int(labels, key, minimum=minimum, maximum=maximum)
    except ValueError as exc:
        raise _Missing(str(exc)) from None


def _replicas(labels: Mapping[str, str], key: str) -> int:
    """Replicas per device; absent means unshared. 0 (MIG parent GPUs) counts as 1 here."""
    if key not in labels:
        return 1
    return max(1, _int_label(labels, key, maximum=MAX_REPLICAS))


def replicas_label(labels: Mapping[str, Any]) -> int:
    """The node's `nvidia.com/gpu.replicas` as the scheduler reads it (`_replicas`: absent or 0
    is 1); ValueError naming the label where the scheduler would refuse the node for it."""
    try:
        return _replicas(labels, LABEL + "gpu.replicas")
    except _Missing as exc:
        raise ValueError(str(exc)) from None


class _Missing(Exception):
    """A label problem; becomes the node's `problem` (the filter reason)."""


def _allocatable_count(alloc: Mapping[str, Any], resource: str) -> int | None:
    """How many of `resource` the node's allocatable lists. None when it lists nothing at all (a
    hand-written cluster file: the labels stand); 0 when it lists other resources but not this
    one, so no device plugin serves it. kube-scheduler then refuses the resource there too, unless
    DRA fills it (DRAExtendedResource), and DRA's GPUs are not in vramsched's books."""
    raw = alloc.get(resource)
    if raw is None:
        return 0 if alloc else None
    try:
        value = parse_quantity(raw)
    except QuantityError:
        return 0
    return max(0, int(value))


def node_inventory(node: Mapping[str, Any]) -> NodeInventory:
    """Inventory of one Kubernetes Node object (as a dict). Never raises for bad labels."""
    meta = node.get("metadata") or {}
    if not isinstance(meta, Mapping):
        meta = {}
    name = str(meta.get("name") or "")
    labels = meta.get("labels") or {}
    if not isinstance(labels, Mapping):
        labels = {}
    status = node.get("status") or {}
    if not isinstance(status, Mapping):
        status = {}
    alloc = status.get("allocatable") or status.get("capacity") or {}
    if not isinstance(alloc, Mapping):
        alloc = {}
    try:
        cpu = parse_milli(alloc["cpu"]) if "cpu" in alloc else 0
        mem = parse_bytes(alloc["memory"], allow_zero=True) if "memory" in alloc else 0
    except QuantityError:
        cpu, mem = 0, 0
    if cpu > HOST_MAX or mem > HOST_MAX:  # no node has that much; the arrays hold int64
        cpu, mem = 0, 0
    base = partial(
        NodeInventory,
        name=name,
        cpu_milli=cpu,
        memory_bytes=mem,
        labels=labels,
        resource_version=str(meta.get("resourceVersion") or ""),
    )
    strategy = str(labels.get(LABEL + "mig.strategy", "none") or "none")
    product = str(labels.get(LABEL + "gpu.product", ""))
    try:
        if not product and strategy != "mixed":
            raise _Missing(f"missing label {LABEL}gpu.product")
        if strategy == "mixed":
            devices = _mixed_mig(name, labels, alloc, product)
        elif strategy == "single" or _MIG_SINGLE_PRODUCT.search(product):
            devices = _single_mig(name, labels, alloc, product)
        elif strategy == "none" and is_plugin_served(labels):
            devices = _plugin_gpus(name, labels, meta.get("annotations"), alloc, product)
        elif strategy == "none":
            devices = _whole_gpus(name, labels, alloc, product)
        else:
            raise _Missing(f"label {LABEL}mig.strategy={strategy!r} is not none, single or mixed")
    except _Missing as exc:
        return base(product=product, mig_strategy=strategy, problem=str(exc))
    if not devices:
        return base(product=product, mig_strategy=strategy, problem=NO_GPUS)
    return base(devices=tuple(devices), product=product, mig_strategy=strategy)


def _sharing(labels: Mapping[str, str], product: str, replicas: int) -> Sharing:
    if replicas <= 1:
        return Sharing.EXCLUSIVE
    strategy = str(labels.get(LABEL + "gpu.sharing-strategy", "")).lower()
    if strategy == "mps":
        return Sharing.MPS
    return Sharing.TIME_SLICING


def _whole_gpus(
    name: str, labels: Mapping[str, str], alloc: Mapping[str, Any], product: str
) -> list[Device]:
    count = _int_label(labels, LABEL + "gpu.count", maximum=MAX_DEVICES_PER_NODE)
    memory_mib = _int_label(labels, LABEL + "gpu.memory", minimum=1, maximum=MAX_MEMORY_MIB)
    replicas = _replicas(labels, LABEL + "gpu.replicas")
    # renameByDefault advertises replicas as nvidia.com/gpu.shared and drops the -SHARED suffix.
    resource = SHARED_GPU_RESOURCE if SHARED_GPU_RESOURCE in alloc else GPU_RESOURCE
    advertised = _allocatable_count(alloc, resource)
    if advertised is not None and count:  # a count label of 0: no GPUs, nothing to check
        # Unhealthy devices disappear from allocatable first: believe the smaller number.
        count = min(count, advertised // replicas)
        if count == 0:
            raise _Missing(f"node allocatable has no {resource}")
    sharing = _sharing(labels, product, replicas)
    memory = memory_mib * MIB
    return [Gpu(name, i, product, memory, replicas, sharing, resource) for i in range(count)]


def _plugin_gpus(
    name: str, labels: Mapping[str, str], annotations: Any, alloc: Mapping[str, Any], product: str
) -> list[Device]:
    """Whole GPUs served by vramsched's device plugin: the healthy ones it reports, and only
    while it is registered with the kubelet (allocatable has their replicas). Refusing the node
    otherwise is what keeps a pod from being bound where nothing would hand it its GPU."""
    count = _int_label(labels, LABEL + "gpu.count", maximum=MAX_DEVICES_PER_NODE)
    memory_mib = _int_label(labels, LABEL + "gpu.memory", minimum=1, maximum=MAX_MEMORY_MIB)
    replicas = _replicas(labels, LABEL + "gpu.replicas")
    raw = annotations.get(STATE_ANNOTATION) if isinstance(annotations, Mapping) else None
    if raw is None:
        raise _Missing(f"label {SERVED_LABEL}=true but vramsched's device plugin has not reported")
    try:
        state = decode_state(raw)
    except StateError as exc:
        raise _Missing(str(exc)) from None
    if not state.registered:
        raise _Missing("vramsched's device plugin is not registered with the kubelet")
    if state.resource != GPU_RESOURCE:
        raise _Missing(f"vramsched's device plugin serves {state.resource}, not {GPU_RESOURCE}")
    if state.replicas != replicas:
        raise _Missing(
            f"vramsched's device plugin serves {state.replicas} replicas per GPU, "
            f"label {LABEL}gpu.replicas says {replicas}"
        )
    healthy = [i for i in range(min(count, state.gpus)) if i not in state.unhealthy]
    advertised = _allocatable_count(alloc, GPU_RESOURCE)
    if not healthy or advertised is None or advertised < len(healthy) * replicas:
        raise _Missing(
            f"vramsched's device plugin is not serving: allocatable {GPU_RESOURCE} is "
            f"{advertised or 0}, {len(healthy)} healthy GPUs x {replicas} expected"
        )
    sharing = _sharing(labels, product, replicas)
    return [
        Gpu(name, i, product, memory_mib * MIB, replicas, sharing, GPU_RESOURCE, True)
        for i in healthy
    ]


def _mig_gpu_slots(product: str, profile: str) -> int:
    """How many slices of `profile` one GPU holds, to number slices by physical GPU."""
    from extender import mig  # local: MIG tables are only needed for MIG nodes

    model = mig.model_for_product(product)
    if model is not None and model.has_profile(profile):
        return max(1, mig.max_uniform_count(model, profile))
    lead = re.match(r"([0-9]+)g", profile)
    g = int(lead.group(1)) if lead else 1
    return max(1, 7 // max(1, g))


def _single_mig(
    name: str, labels: Mapping[str, str], alloc: Mapping[str, Any], product: str
) -> list[Device]:
    m = _MIG_SINGLE_PRODUCT.search(product)
    if m is None:
        raise _Missing(
            f"label {LABEL}gpu.product={product!r} has no -MIG-<profile> suffix for mig.strategy=single"
        )
    profile = m.group(1)
    count = _int_label(labels, LABEL + "gpu.count", maximum=MAX_DEVICES_PER_NODE)
    memory_mib = _int_label(labels, LABEL + "gpu.memory", minimum=1, maximum=MAX_MEMORY_MIB)
    replicas = _replicas(labels, LABEL + "gpu.replicas")
    advertised = _allocatable_count(alloc, GPU_RESOURCE)
    if advertised is not None:
        count = min(count, advertised // replicas)
        if count == 0:
            raise _Missing(f"node allocatable has no {GPU_RESOURCE}")
    per_gpu = _mig_gpu_slots(product, profile)
    parent = product[: m.start()]
    return [
        MigSlice(
            name,
            i // per_gpu,
            profile,
            i % per_gpu,
            parent,
            memory_mib * MIB,
            replicas,
            GPU_RESOURCE,
        )
        for i in range(count)
    ]


def _mixed_mig(
    name: str, labels: Mapping[str, str], alloc: Mapping[str, Any], product: str
) -> list[Device]:
    devices: list[Device] = []
    profiles: list[tuple[str, int, int, int]] = []
    for key in sorted(labels):
        m = _MIG_LABEL.match(key)
        if m is None:
            continue
        profile = m.group(1)
        prefix = f"{LABEL}mig-{profile}"
        count = _int_label(labels, prefix + ".count", maximum=MAX_DEVICES_PER_NODE)
        if count == 0:
            continue
        memory_mib = _int_label(labels, prefix + ".memory", minimum=1, maximum=MAX_MEMORY_MIB)
        replicas = _replicas(labels, prefix + ".replicas")
        resource = f"{MIG_RESOURCE_PREFIX}{profile.replace('+', '.')}"
        advertised = _allocatable_count(alloc, resource)
        if advertised is not None:
            count = min(count, advertised // replicas)
        profiles.append((profile, count, memory_mib, replicas))
    if not profiles:
        # A mixed node may still have MIG-disabled GPUs advertised as nvidia.com/gpu.
        if (
            product
            and LABEL + "gpu.count" in labels
            and labels.get(LABEL + "gpu.replicas", "1") != "0"
        ):
            return _whole_gpus(name, labels, alloc, product)
        raise _Missing(f"missing labels {LABEL}mig-<profile>.count for mig.strategy=mixed")
    layout = _layout_slices(product, labels, profiles)
    for profile, count, memory_mib, replicas in profiles:
        resource = f"{MIG_RESOURCE_PREFIX}{profile.replace('+', '.')}"
        for slot, gpu_index in enumerate(layout.get(profile, [])[:count]):
            devices.append(
                MigSlice(
                    name, gpu_index, profile, slot, product, memory_mib * MIB, replicas, resource
                )
            )
    return devices


def _layout_slices(
    product: str, labels: Mapping[str, str], profiles: list[tuple[str, int, int, int]]
) -> dict[str, list[int]]:
    """GPU index of each slice. Labels give per-node counts only, so infer a valid per-GPU layout
    when the model is known, else spread slices over GPUs in order (indices are then nominal)."""
    counts = {p: c for p, c, _, _ in profiles}
    try:
        gpu_count = _int_label(labels, LABEL + "gpu.count", maximum=MAX_DEVICES_PER_NODE)
    except _Missing:
        gpu_count = 0
    try:
        from extender import mig

        model = mig.model_for_product(product) if product else None
        if model is not None and gpu_count > 0:
            layouts = mig.infer_gpu_layouts(model, gpu_count, counts)
            out: dict[str, list[int]] = {}
            for gpu_index, geometry in enumerate(layouts):
                for profile in geometry:
                    out.setdefault(profile, []).append(gpu_index)
            if all(len(out.get(p, [])) >= c for p, c in counts.items()):
                return out
    except (ValueError, KeyError):  # an odd layout must not make the node unusable
        pass
    out = {}
    for profile, count in counts.items():
        per_gpu = _mig_gpu_slots(product, profile)
        out[profile] = [i // per_gpu for i in range(count)]
    return out


# ----- MIG labels as they are, for planning geometries ---------------------------------------------


@dataclass(frozen=True, slots=True)
class MigLabels:
    """A node's MIG labels read as they are, without judging them: what `vramsched plan-mig`
    plans new geometries from. `node_inventory` is stricter (it needs every profile's memory to
    place pods); a planner takes what is missing from the MIG tables instead."""

    product: str
    #: `nvidia.com/mig.strategy`, None when the node has no such label
    strategy: str | None
    #: `nvidia.com/gpu.count`: GPUs (mixed), MIG devices (single), 0 when absent
    gpu_count: int
    #: mixed strategy: slices labelled per profile
    counts: Mapping[str, int]
    #: bytes of one slice per profile, where labelled (single: the product's profile, from
    #: `nvidia.com/gpu.memory`)
    memory: Mapping[str, int]
    #: single strategy: the profile of the product's `-MIG-<profile>` suffix, when the MIG tables
    #: know it for that product
    single_profile: str | None
    #: `nvidia.com/mig.config` as mig-manager applies it, and its state
    config: str | None
    config_state: str


def _label_int(
    labels: Mapping[str, Any],
    key: str,
    default: str | None = None,
    *,
    minimum: int = 0,
    maximum: int,
) -> int:
    """A label's integer within [minimum, maximum]; ValueError naming the label otherwise."""
    raw = labels.get(key, default)
    text = str(raw).strip()
    if not INTEGER.fullmatch(text):
        raise ValueError(f"label {key}={raw!r} is not an integer")
    value = int(text)
    if not minimum <= value <= maximum:
        raise ValueError(f"label {key}={raw!r} is out of range ({minimum} to {maximum})")
    return value


def _label_text(labels: Mapping[str, Any], key: str) -> str | None:
    raw = labels.get(key)
    if raw is not None and not isinstance(raw, str):
        raise ValueError(f"label {key}={raw!r} is not a string")
    return raw


def read_mig_labels(labels: Mapping[str, Any]) -> MigLabels | None:
    """The MIG facts in a node's labels, None for a node without MIG labels; ValueError (naming
    the label) for a number that is not one. Profiles are spelled as the MIG tables spell them
    (`1g.10gb+me`, `extender.mig`)."""
    from extender import mig  # local, as above

    counts: dict[str, int] = {}
    memory: dict[str, int] = {}
    for key in labels:
        m = _MIG_COUNT_OR_MEMORY.match(key)
        profile = mig.profile_from_resource(LABEL + m[1]) if m else None
        if m is None or profile is None:
            continue
        try:
            mig.parse_profile_name(profile)
        except ValueError as exc:  # e.g. 9g.90gb: no GPU has more than 7 compute slices
            raise ValueError(f"label {key}: {exc}") from None
        if m[2] == "count":
            counts[profile] = _label_int(labels, key, maximum=MAX_DEVICES_PER_NODE)
        else:
            memory[profile] = _label_int(labels, key, maximum=MAX_MEMORY_MIB) * MIB
    strategy = labels.get(LABEL + "mig.strategy")
    if strategy is None and not counts:
        return None
    product = str(labels.get(LABEL + "gpu.product", ""))
    single = _MIG_SINGLE_PRODUCT.search(product)
    model = mig.model_for_product(product) if single else None
    single_profile = (
        single[1] if single and model is not None and model.has_profile(single[1]) else None
    )
    if strategy == "single" and single_profile and labels.get(LABEL + "gpu.memory"):
        memory[single_profile] = (
            _label_int(labels, LABEL + "gpu.memory", maximum=MAX_MEMORY_MIB) * MIB
        )
    return MigLabels(
        product=product,
        strategy=str(strategy) if strategy is not None else None,
        gpu_count=_label_int(labels, LABEL + "gpu.count", "0", maximum=MAX_DEVICES_PER_NODE),
        counts=counts,
        memory=memory,
        single_profile=single_profile,
        config=_label_text(labels, LABEL + "mig.config"),
        config_state=str(labels.get(LABEL + "mig.config.state", "success")),
    )
