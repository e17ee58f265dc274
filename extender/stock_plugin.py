"""What the stock NVIDIA device plugin does with time-sliced GPUs, and the accounting that stays
sound under it. Pure: no I/O.

vramsched can choose the node, not the physical GPU: kubelet asks the device plugin
(`GetPreferredAllocation`) which replica of which GPU a container gets. For time-sliced GPUs
(`replicas > 1`, not MPS) the plugin's `greedyAlloc` takes one replica at a time from the
physical GPU ranked first by `--shared-devices-allocation-policy`
(k8s-device-plugin internal/rm/allocate.go):

- `distributed` (default): fewest allocated replicas first; ties by GPUs picked least in this
  request, then in no defined order (a Go map / heap order). So which of two equally loaded GPUs
  gets the pod is unknowable, and the pods sharing a GPU can never be predicted.
- `packed` (v0.20+): most allocated replicas first.

The plugin counts replicas, never memory. So for these GPUs a per-GPU VRAM ledger is a fiction
unless the choice is pinned (`NVIDIA_VISIBLE_DEVICES` hand-off). What *can* be guaranteed is a
bound on the worst GPU over every choice the plugin may make:

- a replica lands on a GPU whose allocated count is minimal (distributed); with U replicas
  on n GPUs that minimum is at most floor((U-1)/n), so it shares its GPU with at most
  ceil(U/n) - 1 others, taken from the replicas already on the node;
- under `packed` (or any policy) a GPU holds at most `replicas` of them.

Hence the node-level rule: after adding the pod, the sum of the `depth` largest replica
reservations on the node's time-sliced GPUs of one resource is at most one GPU's memory, with
depth = ceil(U/n) (distributed) or min(replicas, U) (packed). Checked at every bind against
every pod then on the node, it holds whatever order kubelet admits them in, because each
admission lands next to pods that the latest bind among them already counted. Departures only
lower both sides.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from extender.inventory import Gpu, ReplicaPolicy, Sharing

if TYPE_CHECKING:
    from extender.ledger import DeviceArrays, Ledger, Reservation

__all__ = [
    "is_time_sliced",
    "stack_depth",
    "worst_case_load",
    "plugin_candidates",
    "BoundView",
    "bound_view",
    "SharedFit",
    "shared_fit",
    "bounds_resource",
    "refused_per_node",
    "allowed_without",
]

# ----- the device plugin's choice, and the bound -------------------------------------------------


def is_time_sliced(device: Any) -> bool:
    """A device whose replicas share memory with no limit: time-slicing with replicas > 1.

    MPS is not: the MPS daemon caps every client at memory/replicas, so any placement fits.
    """
    return device.sharing is Sharing.TIME_SLICING and device.replicas > 1


def stack_depth(policy: ReplicaPolicy, units: int, gpus: int, replicas: int) -> int:
    """Most replicas that may share one GPU once `units` replicas are on `gpus` GPUs."""
    if units <= 0 or gpus <= 0:
        return 0
    if policy is ReplicaPolicy.DISTRIBUTED:
        return min(replicas, -(-units // gpus))
    return min(replicas, units)


def worst_case_load(
    existing: Sequence[int], size: int, count: int, gpus: int, replicas: int, policy: ReplicaPolicy
) -> int:
    """Largest VRAM one GPU may hold if `count` replicas of `size` bytes join `existing`.

    = the sum of the `depth` largest replicas of the new multiset (a GPU may hold any
    `depth` of them, the plugin's ties being unspecified).
    """
    sizes = sorted((int(s) for s in existing), reverse=True)
    depth = stack_depth(policy, len(sizes) + count, gpus, replicas)
    prefix = (
        np.concatenate(([0], np.cumsum(np.asarray(sizes, np.int64))))
        if sizes
        else np.zeros(1, np.int64)
    )
    best = 0
    for j in range(0, min(count, depth) + 1):
        rest = min(depth - j, len(sizes))
        best = max(best, j * size + int(prefix[rest]))
    return best


def plugin_candidates(
    allocated: Sequence[int], replicas: Sequence[int], policy: ReplicaPolicy
) -> list[int]:
    """GPUs the plugin may give the next single replica to (all tied ones: the tie is not ours).

    `allocated[i]` replicas of GPU i are in use out of `replicas[i]`.
    """
    free = [i for i, (u, r) in enumerate(zip(allocated, replicas)) if u < r]
    if not free:
        return []
    pick = min if policy is ReplicaPolicy.DISTRIBUTED else max
    best = pick(allocated[i] for i in free)
    return [i for i in free if allocated[i] == best]


# ----- the bound over a whole ledger, for placement ----------------------------------------------


@dataclass(slots=True)
class _Group:
    """Time-sliced devices of one resource on one node: the unit the plugin chooses within."""

    rows: np.ndarray
    gpus: int
    replicas: int
    capacity: int
    policy: ReplicaPolicy
    sizes: list[int] = field(default_factory=list)
    index: int = 0  # its row in the view's per-group arrays


@dataclass
class BoundView:
    """What the bound needs of a ledger's arrays under one policy: which rows it applies to, their
    groups, and each group's replica sizes (kept up to date node by node, `bound_view`)."""

    arrays: DeviceArrays
    policy: ReplicaPolicy
    generation: int = -1
    position: int = 0  # how far into ledger.touched this view is up to date
    groups: dict[str, list[_Group]] = field(default_factory=dict)
    subject: np.ndarray = field(default_factory=lambda: np.zeros(0, bool))
    pin_rows: np.ndarray = field(default_factory=lambda: np.zeros(0, bool))
    base_t: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    base_t1: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    #: per group (`_Group.index`): its first device row, GPUs, replicas, whether the plugin spreads
    #: (distributed) or stacks, how many replica sizes it holds, those sizes largest first (padded
    #: with -1) and their prefix sums (padded with the total); per device row, its group or -1.
    #: `shared_fit` reads them to bound a multi-GPU pod on every group at once (`_group_worst`).
    g_first: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    g_gpus: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    g_replicas: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    g_spread: np.ndarray = field(default_factory=lambda: np.zeros(0, bool))
    g_count: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    g_sizes: np.ndarray = field(default_factory=lambda: np.zeros((0, 1), np.int64))
    g_prefix: np.ndarray = field(default_factory=lambda: np.zeros((0, 2), np.int64))
    row_group: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    #: `g_sizes` flattened into one ascending array of keys (`_group_keys`): how many of a group's
    #: sizes exceed a given size is then one binary search, not a pass over every group's row
    g_keys: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    #: (needs_pin, distributed, any refused) per (pin_configmap flag, resource id or None for
    #: every row): see `static_masks`
    masks: dict = field(default_factory=dict)
    #: per (resource id, pin_configmap flag): its groups' nodes and rows, its pin-refused rows
    #: per node (`group_layout`)
    layouts: dict = field(default_factory=dict)
    #: device rows the bound or the pin rule applies to (`subject | pin_rows`): a small share of
    #: a cluster's rows (15% in the load test's), the only ones `shared_fit` computes
    bounded: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    #: resource ids with at least one bounded row (`bounds_resource`)
    bounded_resources: frozenset = frozenset()
    #: per resource id: its rows, and the positions among them of its bounded rows (`resource_rows`)
    by_resource: dict = field(default_factory=dict)
    #: per resource id: its groups and where their rows are (`resource_groups`)
    groups_by_resource: dict = field(default_factory=dict)

    def resource_rows(self, resource: int) -> tuple[np.ndarray, np.ndarray]:
        """(the device rows of `resource`, the positions among them of those `bounded`): labels and
        policy only, so kept with the view."""
        hit = self.by_resource.get(resource)
        if hit is None:
            at = self.arrays.rows_of(resource)
            hit = self.by_resource[resource] = (
                at,
                np.flatnonzero(self.subject[at] | self.pin_rows[at]),
            )
        return hit

    def resource_groups(self, resource: int) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """(the groups of `resource`, the positions of their rows among the resource's rows, each
        such row's index into those groups), or None when some group's devices differ in memory
        or per-pod cap: then the bound is not one value per group. Labels and policy only."""
        if resource not in self.groups_by_resource:
            rows_of, _ = self.resource_rows(resource)
            pos = np.flatnonzero(self.subject[rows_of])
            row_group = self.row_group[rows_of[pos]]
            groups, local = np.unique(row_group, return_inverse=True)
            a, first = self.arrays, self.g_first[groups]
            same = (a.capacity[rows_of[pos]] == a.capacity[first][local]).all() and (
                a.per_pod_cap[rows_of[pos]] == a.per_pod_cap[first][local]
            ).all()
            self.groups_by_resource[resource] = (groups, pos, local) if same else None
        return self.groups_by_resource[resource]

    def group_layout(
        self, resource: int, pin_configmap: bool
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(per group of `resource`: its node, its rows; per node: its rows of `resource` the pin
        rule refuses) for `refused_per_node`. Labels, policy and the pod's pin ability only."""
        key = (resource, pin_configmap)
        hit = self.layouts.get(key)
        if hit is None:
            grouped = self.resource_groups(resource)
            assert grouped is not None  # asked only when the bound is one value per group
            groups = grouped[0]
            a = self.arrays
            needs_pin = self.static_masks(pin_configmap, resource)[0]
            pinned = np.bincount(
                a.node_of[self.resource_rows(resource)[0][needs_pin]], minlength=len(a.node_names)
            )
            pinned.flags.writeable = False  # handed out as is when no group refuses
            hit = self.layouts[key] = (a.node_of[self.g_first[groups]], self.g_gpus[groups], pinned)
        return hit

    def static_masks(
        self, pin_configmap: bool, resource: int | None = None
    ) -> tuple[np.ndarray, np.ndarray, bool]:
        """(rows refused because they pin GPUs and the pod cannot take a pin, rows where the
        plugin spreads replicas, whether any row is refused): labels, policy and the pod's pin
        ability only. With `resource`, at that resource's rows only (`resource_rows`)."""
        hit = self.masks.get((pin_configmap, resource))
        if hit is None:
            if resource is None:
                needs_pin = self.pin_rows & (not pin_configmap)
                distributed = self.subject & (self.policy is ReplicaPolicy.DISTRIBUTED)
            else:
                every_pin, every_distributed, _ = self.static_masks(pin_configmap)
                at = self.resource_rows(resource)[0]
                needs_pin, distributed = every_pin[at], every_distributed[at]
            needs_pin.flags.writeable = distributed.flags.writeable = False
            hit = self.masks[(pin_configmap, resource)] = (
                needs_pin,
                distributed,
                bool(needs_pin.any()),
            )
        return hit


@dataclass(slots=True)
class SharedFit:
    """Per device row: may the pod go there under the node-level bound, and the worst case."""

    allowed: np.ndarray
    worst: np.ndarray  # worst-case bytes on one GPU of the row's group if the pod joins it
    needs_pin: np.ndarray  # rows refused because the node pins GPUs and the pod cannot be pinned
    distributed: np.ndarray  # rows where the plugin spreads: bookkeeping should pick the least used
    policy: str = ""


def bound_view(ledger: Ledger, view: BoundView | None) -> BoundView | None:
    """The bound's view of `ledger` now, or None without a replica policy (exact per-device
    books). `view` is the one kept with the ledger's arrays (placement keeps it, None at first):
    it is brought up to date from the ledger's log of touched nodes, or replaced when the arrays
    were rebuilt. Every function below reads the view this returns."""
    policy = ledger.replica_policy
    if policy is None:
        return None
    a = ledger.arrays
    v = view
    if v is None or v.arrays is not a or v.policy is not policy:
        v = BoundView(arrays=a, policy=policy)
        n = len(a.devices)
        v.subject = np.zeros(n, bool)
        v.pin_rows = np.zeros(n, bool)
        v.base_t = np.zeros(n, np.int64)
        v.base_t1 = np.zeros(n, np.int64)
        by_group: dict[tuple[str, str], list[int]] = {}
        for i, d in enumerate(a.devices):
            if not is_time_sliced(d) or getattr(d, "plugin_served", False):
                continue  # vramsched's own plugin hands out exactly the booked GPU: exact books
            if policy is ReplicaPolicy.PINNED and isinstance(d, Gpu):
                v.pin_rows[i] = True  # exact per-GPU accounting; the pod must take the pin
                continue
            v.subject[i] = True
            by_group.setdefault((d.node, d.resource), []).append(i)
        every: list[_Group] = []
        for (node, _resource), rows in by_group.items():
            d0 = a.devices[rows[0]]
            # MIG replicas cannot be pinned by index: whatever the plugin's policy, assume the worst.
            gpolicy = ReplicaPolicy.PACKED if policy is ReplicaPolicy.PINNED else policy
            g = _Group(
                np.asarray(rows, np.int64),
                len(rows),
                int(d0.replicas),
                int(d0.memory_bytes),
                gpolicy,
                index=len(every),
            )
            every.append(g)
            v.groups.setdefault(node, []).append(g)
        v.g_first = np.asarray([int(g.rows[0]) for g in every], np.int64)
        v.g_gpus = np.asarray([g.gpus for g in every], np.int64)
        v.g_replicas = np.asarray([g.replicas for g in every], np.int64)
        v.g_spread = np.asarray([g.policy is ReplicaPolicy.DISTRIBUTED for g in every], bool)
        v.g_count = np.zeros(len(every), np.int64)
        width = max((g.gpus * g.replicas for g in every), default=1)
        v.g_sizes = np.full((len(every), width), -1, np.int64)
        v.g_prefix = np.zeros((len(every), width + 1), np.int64)
        v.g_keys = _group_keys(v.g_sizes)
        v.row_group = np.full(n, -1, np.int64)
        for g in every:
            v.row_group[g.rows] = g.index
        v.bounded = np.flatnonzero(v.subject | v.pin_rows)
        v.bounded_resources = frozenset(a.resource_id[v.bounded].tolist())
        dirty: Iterable[str] = list(v.groups)
    elif v.generation == ledger.generation:
        return v
    else:
        touched = ledger.touched_since(v.position)
        dirty = (
            list(v.groups) if touched is None else [n for n in touched if n in v.groups]
        )  # None: fell behind the log
    for node in dirty:
        _refresh(ledger, v, node)
    v.generation = ledger.generation
    v.position = ledger.position
    return v


def _refresh(ledger: Ledger, v: BoundView, node: str) -> None:
    groups = v.groups.get(node, [])
    if not groups:
        return
    member: dict[int, _Group] = {}
    for g in groups:
        g.sizes = []
        for r in g.rows.tolist():
            member[r] = g
    for res in ledger.pods_on(node):
        for dev, nbytes in zip(res.device_ids, res.bytes_per_device):
            r = ledger.row(node, dev)
            owner = member.get(r) if r is not None else None
            if owner is not None:
                owner.sizes.append(int(nbytes))
    for g in groups:
        g.sizes.sort(reverse=True)
        prefix = (
            np.concatenate(([0], np.cumsum(np.asarray(g.sizes, np.int64))))
            if g.sizes
            else np.zeros(1, np.int64)
        )
        u = len(g.sizes)
        t = stack_depth(g.policy, u + 1, g.gpus, g.replicas)
        v.base_t[g.rows] = prefix[min(t, u)]
        v.base_t1[g.rows] = prefix[min(max(t - 1, 0), u)]
        if (
            u > v.g_sizes.shape[1]
        ):  # more replicas recorded than the group has (the API is the truth)
            grow = u - v.g_sizes.shape[1]
            v.g_sizes = np.pad(v.g_sizes, ((0, 0), (0, grow)), constant_values=-1)
            v.g_prefix = np.concatenate(
                [v.g_prefix, np.repeat(v.g_prefix[:, -1:], grow, axis=1)], axis=1
            )
            v.g_keys = _group_keys(v.g_sizes)
        v.g_count[g.index] = u
        v.g_sizes[g.index] = -1
        v.g_sizes[g.index, :u] = g.sizes
        width = v.g_sizes.shape[1]
        v.g_keys[g.index * width : (g.index + 1) * width] = _group_keys(
            v.g_sizes[g.index : g.index + 1], g.index
        )
        v.g_prefix[g.index, : u + 1] = prefix
        v.g_prefix[g.index, u + 1 :] = prefix[-1]


# `_group_keys`: key = group * _KEY_ROW + (_KEY_OFF - size), sizes clipped below _KEY_OFF (64 TiB
# per replica: none is near), padding (-1) after every real size; exact below _KEY_GROUPS groups.
_KEY_OFF = 1 << 46
_KEY_ROW = 1 << 47
_KEY_GROUPS = 1 << 15


def _size_key(group: np.ndarray, size: np.ndarray) -> np.ndarray:
    """The key of `size` bytes in row `group` of `g_keys`: the sizes above it are the keys below."""
    return group * _KEY_ROW + (_KEY_OFF - np.minimum(size, _KEY_OFF - 1))


def _group_keys(sizes: np.ndarray, first: int = 0) -> np.ndarray:
    """Rows `first`.. of `g_sizes` (largest first, -1 padded) as ascending int64 keys, row after row."""
    return _size_key(np.arange(first, first + len(sizes), dtype=np.int64)[:, None], sizes).ravel()


def _group_worst(v: BoundView, g: np.ndarray, size: np.ndarray, count: int) -> np.ndarray:
    """`worst_case_load` of the groups `g` at once, for `count` replicas of `size[i]` bytes on g[i].

    The worst GPU holds the `depth` largest replicas of the group's sizes plus the new ones; with
    `m` sizes above the new size, that is the `depth` largest if depth <= m, else the `m` largest,
    as many new ones as fit in depth, and the largest of the rest after them."""
    u = v.g_count[g]
    total = u + count
    depth = np.minimum(
        v.g_replicas[g], np.where(v.g_spread[g], -(-total // np.maximum(v.g_gpus[g], 1)), total)
    )
    if len(v.g_sizes) < _KEY_GROUPS:
        width = v.g_sizes.shape[1]
        m = np.searchsorted(v.g_keys, _size_key(g, size)) - g * width
    else:
        m = (v.g_sizes[g] > size[:, None]).sum(axis=1)
    p = v.g_prefix
    within = p[g, np.minimum(depth, u)]
    beyond = np.minimum(count, depth - m) * size + p[g, np.minimum(np.maximum(m, depth - count), u)]
    return np.where(depth <= m, within, beyond)


def bounds_resource(view: BoundView | None, resource_id: int) -> bool:
    """Whether the bound or the pin rule applies to any device of the resource (a MIG profile
    that no node time-slices has none): else `shared_fit` would allow every one of its rows."""
    return view is not None and resource_id in view.bounded_resources


def shared_fit(
    view: BoundView | None,
    need: np.ndarray,
    gpu_count: int,
    pin_configmap: bool,
    rows: slice | np.ndarray | None = None,
    resource: int | None = None,
) -> SharedFit | None:
    """The node-level bound for every time-sliced device row, or None when the ledger's
    per-device accounting is exact (no policy set: embedded cluster, simulator).

    `rows`: only these device rows, every row of the nodes they touch (one node's slice, for
    bind: its cost then does not grow with the cluster; or several nodes' sorted rows; or those
    nodes' rows of one resource, a group never spanning two); `need` and the result are then
    indexed like `rows`. `resource` (without `rows`): at that resource's rows only (`need`
    still over every row), for filter and prioritize, which look at nothing else: the whole
    cluster's columns and a gather from them cost a third of live filter."""
    if view is None:
        return None
    v, policy = view, view.policy
    if rows is None:
        if not len(v.bounded):
            return None
        # every other row: no bound (worst 0), allowed; only the bounded rows are worked out, and
        # the masks that depend on labels and policy alone are kept with the view (read-only)
        rows_of, at = (None, v.bounded) if resource is None else v.resource_rows(resource)
        grouped = None if resource is None else v.resource_groups(resource)
        worst = np.zeros(len(v.subject) if rows_of is None else len(rows_of), np.int64)
        allowed = np.ones(len(worst), bool)
        if (
            grouped is not None
        ):  # one value per group, spread to its rows (8 rows a group in the load test)
            groups, pos, local = grouped
            if len(groups):
                group_worst, group_allowed = _bound_per_group(v, groups, need, gpu_count)
                worst[pos], allowed[pos] = group_worst[local], group_allowed[local]
        else:
            bounded = at if rows_of is None else rows_of[at]
            worst[at], allowed[at] = _bound(v, bounded, need[bounded], gpu_count, need[v.g_first])
        needs_pin, distributed, refused = v.static_masks(pin_configmap, resource)
    else:
        subject, pin_rows = v.subject[rows], v.pin_rows[rows]
        if not subject.any() and not pin_rows.any():
            return None
        worst, allowed = _bound(
            v, rows, need, gpu_count, None, (rows.start or 0) if isinstance(rows, slice) else 0
        )
        needs_pin = pin_rows & (not pin_configmap)
        distributed = subject & (policy is ReplicaPolicy.DISTRIBUTED)
        refused = True
    if refused:
        allowed &= ~needs_pin
    return SharedFit(
        allowed=allowed,
        worst=worst,
        needs_pin=needs_pin,
        distributed=distributed,
        policy=policy.value,
    )


def refused_per_node(
    view: BoundView | None, need: np.ndarray, gpu_count: int, pin_configmap: bool, resource: int
) -> np.ndarray | None:
    """Per node: how many of its device rows of `resource` the bound or the pin rule refuses, the
    counts `shared_fit(..., resource=resource)` gives row by row, worked out on one value per
    group (`_bound_per_group`; a group is one node's devices of one resource) instead of spread
    to the rows and counted back: filter needs no more when some node passes. The pin rule's rows
    (GPUs under the pinned policy) are never in a group, so the two counts add up. None without
    a policy, or when the bound is not one value per group (`resource_groups`). `need` over
    every row, as `shared_fit` takes it."""
    if view is None:
        return None
    v = view
    grouped = v.resource_groups(resource)
    if grouped is None:
        return None
    groups = grouped[0]
    group_node, group_rows, pinned = v.group_layout(resource, pin_configmap)
    if not len(groups):
        return pinned
    _, group_allowed = _bound_per_group(v, groups, need, gpu_count)
    bad = np.flatnonzero(~group_allowed)
    if not len(bad):
        return pinned
    refused = pinned.copy()
    np.add.at(refused, group_node[bad], group_rows[bad])
    return refused


def _bound(
    v: BoundView,
    sel: slice | np.ndarray,
    need: np.ndarray,
    gpu_count: int,
    group_size: np.ndarray | None,
    offset: int = 0,
) -> tuple[np.ndarray, np.ndarray]:
    """(worst case, allowed by the bound before the pin rule) of the device rows `sel`, with
    `need` indexed like `sel`: either every bounded row, with `group_size` the pod's bytes per
    GPU on every group, or whole nodes' rows (a slice starting at `offset`, or sorted rows),
    whose groups' sizes are read from `need` at each group's first row."""
    subject = v.subject[sel]
    cap = v.arrays.capacity[sel]
    worst = np.maximum(v.base_t[sel], need + v.base_t1[sel])
    if gpu_count > 1 and len(v.g_first):
        row_group = v.row_group[sel]
        grouped = row_group >= 0
        if grouped.any():
            if group_size is not None:
                g, size = np.arange(len(v.g_first)), group_size
            else:  # the groups in a slice, or in whole nodes' sorted rows
                present = np.zeros(len(v.g_first), bool)
                present[row_group[grouped]] = True
                g = np.flatnonzero(present)  # np.unique, without its sort
                first = v.g_first[g]
                size = (
                    need[first - offset]
                    if isinstance(sel, slice)
                    else need[np.searchsorted(sel, first)]
                )
            per_group = np.zeros(len(v.g_first), np.int64)
            per_group[g] = _group_worst(v, g, size, gpu_count)
            worst[grouped] = per_group[row_group[grouped]]
    worst = np.where(subject, worst, 0)
    return worst, ~subject | (worst <= cap)


def _bound_per_group(
    v: BoundView, groups: np.ndarray, need: np.ndarray, gpu_count: int
) -> tuple[np.ndarray, np.ndarray]:
    """`_bound` of the groups `groups` (each one value for all its rows: a group's devices share
    their memory and per-pod cap, see `resource_groups`), read at each group's first row; `need`
    over every row."""
    first = v.g_first[groups]
    if gpu_count > 1:
        worst = _group_worst(v, groups, need[first], gpu_count)
    else:
        worst = np.maximum(v.base_t[first], need[first] + v.base_t1[first])
    return worst, worst <= v.arrays.capacity[first]


def allowed_without(
    ledger: Ledger,
    view: BoundView | None,
    lo: int,
    hi: int,
    victims: Sequence[Reservation],
    need: np.ndarray,
    gpu_count: int,
) -> np.ndarray:
    """Rows lo..hi (one node) where the node-level bound admits the pod once `victims` are gone:
    preemption must not evict pods whose departure would still leave the pod refused."""
    out = np.ones(hi - lo, bool)
    if view is None or hi <= lo:
        return out
    v = view
    node = v.arrays.devices[lo].node
    gone: dict[int, list[int]] = {}
    for res in victims:
        for dev, nbytes in zip(res.device_ids, res.bytes_per_device):
            r = ledger.row(res.node, dev)
            if r is not None:
                gone.setdefault(r, []).append(int(nbytes))
    for g in v.groups.get(node, []):
        sizes = list(g.sizes)
        for r in g.rows.tolist():
            for nbytes in gone.get(r, []):
                if nbytes in sizes:
                    sizes.remove(nbytes)
        worst = worst_case_load(
            sizes, int(need[g.rows[0]]), gpu_count, g.gpus, g.replicas, g.policy
        )
        if worst > g.capacity:
            out[g.rows - lo] = False
    return out
