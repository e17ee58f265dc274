"""The VRAM ledger: which pod holds how much memory on which device.

The one invariant of vramsched lives here: on every device the reserved bytes never
exceed its memory and the pods on it never exceed its replicas. `reserve` is a
synchronous check-and-set, so callers on one event loop can never double-book even
when binds race; nothing here awaits or does I/O.

Per-device state is also kept in numpy arrays (extender.arrays: one row per device, rows of a
node contiguous) so that filter/prioritize over thousands of nodes are vector operations.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from operator import attrgetter

import numpy as np

from extender.arrays import (
    DeviceArrays,
    NodeSummary,
    first_k_per_node,
    offsets,
    run_starts,
    slot_free_bytes,
    slot_free_of,
    sole_share,
    summary_of,
)
from extender.demand import PodRef
from extender.inventory import Device, NodeInventory, ReplicaPolicy

__all__ = [
    "Reservation",
    "Ledger",
    "LedgerError",
    "Violation",
    "check_invariant",
    # the column store the ledger keeps (extender.arrays), importable from here too
    "DeviceArrays",
    "NodeSummary",
    "summary_of",
    "slot_free_of",
    "run_starts",
    "first_k_per_node",
    "offsets",
]


class LedgerError(Exception):
    """A reservation that would break the invariant or conflicts with an existing one."""


@dataclass(slots=True)
class Reservation:
    """A pod's hold on devices of one node. `assumed` until the API confirms it (live mode)."""

    pod: PodRef
    node: str
    device_ids: tuple[str, ...]
    bytes_per_device: tuple[int, ...]
    priority: int = 0
    assumed: bool = False
    expires_at: float | None = None
    declared: bool = True

    @property
    def key(self) -> str:
        return self.pod.key

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes_per_device)

    def same_placement(self, other: Reservation) -> bool:
        return (self.node, self.device_ids, self.bytes_per_device) == (
            other.node,
            other.device_ids,
            other.bytes_per_device,
        )


@dataclass(frozen=True, slots=True)
class Violation:
    """One broken invariant, for tests and `/state`."""

    what: str
    where: str

    def __str__(self) -> str:
        return f"{self.where}: {self.what}"


class Ledger:
    """Inventory of every node plus every reservation, with the per-device totals derived from them."""

    def __init__(self, replica_policy: ReplicaPolicy | str | None = None) -> None:
        #: how time-sliced replicas get their physical GPU, fixed for the ledger's life (every
        #: cache of placement and of the device plugin's bound assumes it does not change);
        #: None = the per-device books are exact (embedded cluster, simulator: no device plugin).
        self._replica_policy = ReplicaPolicy(replica_policy) if replica_policy is not None else None
        self._nodes: dict[str, NodeInventory] = {}
        self._reservations: dict[str, Reservation] = {}
        #: pod keys per node. Immutable sets, replaced on change rather than changed in place, so a
        #: clone shares them: copying 100,000 keys in 5,000 sets took 10 ms of the planner's
        #: snapshot on the event loop; replacing a node's set costs its few dozen keys per change.
        self._by_node: dict[str, frozenset[str]] = {}
        self._arrays = DeviceArrays()
        self._row: dict[tuple[str, str], int] = {}
        self._node_row: dict[str, int] = {}
        #: keys of reservations stored as assumed, so expire() does not scan every reservation.
        self._assumed: dict[str, None] = {}  # ordered like the reservations
        self._dirty = True
        #: bumped on every change; the planner uses it to know whether its plan is stale.
        self.generation = 0
        #: per-node generation, so a change invalidates only plans touching that node.
        self.node_generation: dict[str, int] = {}
        #: nodes in the order they changed, from absolute position `touched_base`: lets a cache
        #: refresh only what changed since it last looked instead of comparing every node.
        self.touched: list[str] = []
        #: beside `touched`, each node's row in the arrays at the time, plus 1 (0: no row), so a
        #: reader of these very arrays gets the rows without a lookup per name (`touched_rows_since`);
        #: the first len(touched) entries are in use
        self._touched_rows = np.empty(1024, np.int32)
        self.touched_base = 0
        #: per resource id, per node row: free VRAM of its devices of that resource, largest first,
        #: and how many have a free replica (see `NodeSummary`); derived state, built on first use,
        #: kept current by refreshing the node rows `_apply` marked stale, verified by `check_invariant`.
        self._summaries: dict[int, NodeSummary] = {}
        self._stale_rows: set[int] = set()
        #: bumped whenever a node's inventory object is replaced or removed (see `allocatable`)
        self._inventory_version = 0
        #: (node names, inventory version, CPU, memory) of the last `allocatable` answer
        self._allocatable: tuple[Sequence[str], int, np.ndarray, np.ndarray] | None = None

    def clone(self, *, reservations: bool = True) -> Ledger:
        """A private copy for a reader on another thread (the background planner), in milliseconds
        rather than the seconds a rebuild from every pod takes at 100,000 pods.

        Shared, because this ledger never changes them in place: node inventories, the static
        device columns and indexes (a rebuild makes new ones), the per-node key sets, and the
        reservations (whose `assumed` flag alone is flipped in place on confirmation; the copy's
        reader must not rely on it). Copied: the used columns, the reservation maps and the
        counters. Summaries are rebuilt by the copy on first use.

        `reservations=False` gives a *capacity* copy: the same used columns, but no record of
        who holds them (no reservations, per-node keys or assumed set: `pods_on` sees only what
        the copy itself reserves, and `check_invariant` does not hold on it). The planner needs no
        more: it reserves and releases its own trial placements on free capacity, and copying
        100,000 reservations was 2 of the snapshot's 5 ms on the event loop.
        """
        a = self.arrays  # rebuilt first if the inventory changed
        c = Ledger(self._replica_policy)
        c._nodes = dict(self._nodes)
        if reservations:
            c._reservations = dict(self._reservations)
            c._by_node = dict(self._by_node)  # immutable sets: shared
            c._assumed = dict(self._assumed)
        c._arrays = replace(
            a,
            used=a.used.copy(),
            used_replicas=a.used_replicas.copy(),
            node_used_replicas=a.node_used_replicas.copy(),
            resource_rows={},
            nonempty_nodes=None,
            cache=None,
        )
        c._row, c._node_row = self._row, self._node_row
        c._allocatable, c._inventory_version = self._allocatable, self._inventory_version
        c._dirty = False
        c.generation = self.generation
        c.node_generation = dict(self.node_generation)
        c.touched_base = self.position
        return c

    @property
    def replica_policy(self) -> ReplicaPolicy | None:
        """How the nodes' device plugin picks a time-sliced replica's GPU (None: exact books)."""
        return self._replica_policy

    def allocatable(self) -> tuple[np.ndarray, np.ndarray]:
        """Allocatable CPU millicores and memory bytes per node row (0 where a node does not state
        them), read-only. Kept until a node is added, replaced or removed (and shared with clones):
        the planner's snapshot read them from 5,000 inventories on the event loop each time."""
        a = self.arrays
        hit = self._allocatable
        if hit is None or hit[0] is not a.node_names or hit[1] != self._inventory_version:
            invs = list(map(self._nodes.__getitem__, a.node_names))
            cpu = np.fromiter(map(attrgetter("cpu_milli"), invs), np.int64, len(invs))
            mem = np.fromiter(map(attrgetter("memory_bytes"), invs), np.int64, len(invs))
            cpu.flags.writeable = mem.flags.writeable = False
            hit = self._allocatable = (a.node_names, self._inventory_version, cpu, mem)
        return hit[2], hit[3]

    # ----- inventory -------------------------------------------------------------------
    def upsert_node(self, inventory: NodeInventory) -> None:
        old = self._nodes.get(inventory.name)
        self._inventory_version += 1
        if (
            old is not None
            and old.devices == inventory.devices
            and old.problem == inventory.problem
        ):
            self._nodes[inventory.name] = inventory
            return
        self._nodes[inventory.name] = inventory
        self._touch(inventory.name)
        self._dirty = True

    def remove_node(self, name: str) -> None:
        if self._nodes.pop(name, None) is not None:
            self._inventory_version += 1
            self._touch(name)
            self._dirty = True

    def node(self, name: str) -> NodeInventory | None:
        return self._nodes.get(name)

    def nodes(self) -> Iterable[NodeInventory]:
        return self._nodes.values()

    def __contains__(self, name: object) -> bool:
        return name in self._nodes

    def __len__(self) -> int:
        return len(self._nodes)

    # ----- reservations ------------------------------------------------------------------
    def reservation(self, pod_key: str) -> Reservation | None:
        return self._reservations.get(pod_key)

    def reservations(self) -> Iterator[Reservation]:
        return iter(list(self._reservations.values()))

    def pods_on(self, node: str) -> list[Reservation]:
        return [self._reservations[k] for k in sorted(self._by_node.get(node, ()))]

    def keys_on(self, node: str) -> frozenset[str]:
        """The pods holding GPUs on `node`."""
        return self._by_node.get(node, frozenset())

    def holders(self) -> dict[str, frozenset[str]]:
        """`keys_on` of every node, as of now (the sets are immutable: the copy is cheap)."""
        return dict(self._by_node)

    def fits(self, res: Reservation) -> str | None:
        """Why `res` cannot be applied now, or None when it fits."""
        a = self.arrays
        if res.node not in self._nodes:
            return f"node {res.node} is not known"
        if len(set(res.device_ids)) != len(res.device_ids):
            return "the same device is listed twice"
        for dev_id, nbytes in zip(res.device_ids, res.bytes_per_device):
            i = self._row.get((res.node, dev_id))
            if i is None:
                return f"node {res.node} has no GPU device {dev_id}"
            if nbytes < 0:
                return "negative reservation"
            if a.used_replicas[i] + 1 > a.replicas[i]:
                return f"GPU {dev_id} on {res.node} has no free replica"
            if a.used[i] + nbytes > a.capacity[i] or nbytes > a.per_pod_cap[i]:
                return f"GPU {dev_id} on {res.node} has not enough free VRAM"
        return None

    def reserve(self, res: Reservation) -> Reservation:
        """Atomically hold devices for a pod. Idempotent for an identical placement."""
        existing = self._reservations.get(res.key)
        if existing is not None:
            if existing.same_placement(res):
                if not res.assumed:
                    existing.assumed, existing.expires_at = False, None
                return existing
            raise LedgerError(f"pod {res.key} already holds GPUs on {existing.node}")
        why = self.fits(res)
        if why is not None:
            raise LedgerError(why)
        return self._insert(res)

    def record(self, res: Reservation) -> Reservation:
        """Account for a pod that is already running there, even if that oversubscribes a device.

        The API is the truth: a pod bound before vramsched started (or by someone else) holds its
        memory whether or not it should; hiding it would let us place more on top of it.
        """
        existing = self._reservations.get(res.key)
        if existing is not None:
            if existing.same_placement(res):
                existing.assumed, existing.expires_at = res.assumed, res.expires_at
                if res.assumed:
                    self._assumed[res.key] = None
                return existing
            self.release(res.key)
        return self._insert(res)

    def _insert(self, res: Reservation) -> Reservation:
        """Count `res` on its devices and index it; callers checked (or chose to skip) the fit."""
        self._apply(res, +1)
        self._reservations[res.key] = res
        if res.assumed:
            self._assumed[res.key] = None
        self._by_node[res.node] = self._by_node.get(res.node, frozenset()) | {res.key}
        self._touch(res.node)
        return res

    def release(self, pod_key: str) -> Reservation | None:
        res = self._reservations.pop(pod_key, None)
        self._assumed.pop(pod_key, None)
        if res is None:
            return None
        self._apply(res, -1)
        keys = self._by_node.get(res.node)
        if keys is not None:
            keys = keys - {pod_key}
            if keys:
                self._by_node[res.node] = keys
            else:
                del self._by_node[res.node]
        self._touch(res.node)
        return res

    def expire(self, now: float | None = None) -> list[Reservation]:
        """Drop assumed reservations whose TTL passed (a bind whose pod never showed up)."""
        now = time.monotonic() if now is None else now
        gone = []
        for key in list(self._assumed):
            r = self._reservations.get(key)
            if r is None or not r.assumed:
                self._assumed.pop(key, None)  # confirmed since: no longer a candidate
            elif r.expires_at is not None and r.expires_at <= now:
                gone.append(r)
        for r in gone:
            self.release(r.key)
        return gone

    # ----- arrays --------------------------------------------------------------------------
    @property
    def arrays(self) -> DeviceArrays:
        if self._dirty:
            self._rebuild()
        return self._arrays

    def row(self, node: str, device_id: str) -> int | None:
        _ = self.arrays  # numbers the rows if a change left them stale
        return self._row.get((node, device_id))

    def node_row(self, node: str) -> int | None:
        _ = self.arrays  # numbers the rows if a change left them stale
        return self._node_row.get(node)

    def node_rows(self, names: Iterable[str]) -> list[int]:
        """The row of each of `names` in `arrays`, -1 for a node the ledger does not know: one
        lookup per name, for filter and prioritize's candidate lists of thousands of nodes."""
        _ = self.arrays  # numbers the rows if a change left them stale
        get = self._node_row.get
        return [get(name, -1) for name in names]

    def _rebuild(self) -> None:
        devices: list[Device] = []
        names: list[str] = []
        node_of: list[int] = []
        starts: list[int] = [0]
        for n, inv in enumerate(self._nodes.values()):
            names.append(inv.name)
            devices.extend(inv.devices)
            node_of.extend([n] * len(inv.devices))
            starts.append(len(devices))
        resources: dict[str, int] = {}
        products: dict[str, int] = {}
        a = DeviceArrays(
            devices=devices,
            node_names=names,
            node_of=np.asarray(node_of, np.int32),
            node_start=np.asarray(starts, np.int64),
            capacity=np.fromiter((d.memory_bytes for d in devices), np.int64, len(devices)),
            per_pod_cap=np.fromiter((d.per_pod_cap_bytes for d in devices), np.int64, len(devices)),
            replicas=np.fromiter((d.replicas for d in devices), np.int32, len(devices)),
            used=np.zeros(len(devices), np.int64),
            used_replicas=np.zeros(len(devices), np.int32),
            resource_id=np.fromiter(
                (resources.setdefault(d.resource, len(resources)) for d in devices),
                np.int32,
                len(devices),
            ),
            product_id=np.fromiter(
                (products.setdefault(d.product, len(products)) for d in devices),
                np.int32,
                len(devices),
            ),
            gpu_index=np.fromiter((d.gpu_index for d in devices), np.int32, len(devices)),
            resources=resources,
            products=products,
            node_used_replicas=np.zeros(len(names), np.int64),
        )
        self._arrays = a
        self._row = {(d.node, d.device_id): i for i, d in enumerate(devices)}
        self._node_row = {name: i for i, name in enumerate(names)}
        self._summaries = {}
        self._stale_rows = set()
        self._dirty = False
        for res in self._reservations.values():
            self._apply(res, +1)

    def _apply(self, res: Reservation, sign: int) -> None:
        if self._dirty:
            return  # the rebuild will apply every reservation
        a = self._arrays
        for dev_id, nbytes in zip(res.device_ids, res.bytes_per_device):
            i = self._row.get((res.node, dev_id))
            if i is None:
                continue  # the device vanished from the node's labels; nothing to count it against
            a.used[i] += sign * nbytes
            a.used_replicas[i] += sign
            a.node_used_replicas[a.node_of[i]] += sign
            if self._summaries:
                self._stale_rows.add(int(a.node_of[i]))

    @property
    def position(self) -> int:
        """Where the log of touched nodes ends now: a cache keeps it and later asks
        `touched_since` what changed, instead of comparing every node."""
        return self.touched_base + len(self.touched)

    def touched_since(self, position: int) -> set[str] | None:
        """The nodes changed since `position` (an earlier `position`), or None when the log was
        trimmed past it: the reader then starts over."""
        if position < self.touched_base:
            return None
        return set(self.touched[position - self.touched_base :])

    def touched_rows_since(self, position: int) -> np.ndarray | None:
        """`touched_since` as sorted node rows of the current arrays (nodes without a row left
        out). Valid for a reader of `arrays`: a node added or removed rebuilds the arrays, and with
        them every cache keyed on them."""
        if position < self.touched_base:
            return None
        logged = self._touched_rows[position - self.touched_base : len(self.touched)]
        if not len(logged):
            return np.empty(0, np.int64)
        return np.flatnonzero(np.bincount(logged)[1:])

    def _touch(self, node: str) -> None:
        self.generation += 1
        self.node_generation[node] = self.node_generation.get(node, 0) + 1
        n = len(self.touched)
        if n == len(self._touched_rows):
            self._touched_rows = np.resize(self._touched_rows, 2 * n)
        self._touched_rows[n] = self._node_row.get(node, -1) + 1
        self.touched.append(node)
        if n + 1 > 1 << 16:  # readers that fell this far behind rescan everything
            del self.touched[: 1 << 15]
            self._touched_rows[: n + 1 - (1 << 15)] = self._touched_rows[1 << 15 : n + 1].copy()
            self.touched_base += 1 << 15

    # ----- per-node summaries ------------------------------------------------------------------
    def summary(self, resource_id: int) -> NodeSummary:
        """Per node row, its devices of `resource_id` as filter sees them (see `NodeSummary`), so
        filter works per node (5,000 rows) instead of per device (40,000). Read-only for callers."""
        a = self.arrays
        if self._stale_rows:
            self._refresh_summaries()
        s = self._summaries.get(resource_id)
        if s is None:
            s = self._summaries[resource_id] = summary_of(a, resource_id)
        return s

    def slot_free(self, resource_id: int) -> np.ndarray:
        """Per node row: the largest free VRAM on a device of `resource_id` with a free replica,
        -1 where none has one (the max of `slot_free_bytes` over those devices)."""
        return self.summary(resource_id).largest

    def _refresh_summaries(self) -> None:
        """Recompute the summaries of the node rows changed since the last read: O(devices of
        those nodes), or one vector pass per resource when many nodes changed."""
        a = self._arrays
        stale, self._stale_rows = self._stale_rows, set()
        if len(stale) > 64 and len(stale) * 16 > len(a.node_names):
            for rid in list(self._summaries):
                self._summaries[rid] = summary_of(a, rid)
            return
        starts = a.node_start
        for r in stale:
            lo, hi = int(starts[r]), int(starts[r + 1])
            has_slot = a.used_replicas[lo:hi] < a.replicas[lo:hi]
            idle = a.used_replicas[lo:hi] == 0
            free = slot_free_bytes(a.capacity[lo:hi], a.used[lo:hi], has_slot)
            sole = sole_share(
                a.capacity[lo:hi],
                a.used[lo:hi],
                a.per_pod_cap[lo:hi],
                a.replicas[lo:hi],
                a.used_replicas[lo:hi],
            )
            rids = a.resource_id[lo:hi]
            for rid in set(
                rids.tolist()
            ):  # the node's other resources have no device here to change
                s = self._summaries.get(rid)
                if s is None:
                    continue
                mine = rids == rid
                busy, spare = mine & has_slot & ~idle, mine & has_slot & idle
                s.set_row(
                    r,
                    free[mine],
                    int(np.count_nonzero(has_slot & mine)),
                    free[busy],
                    free[spare],
                    sole[busy],
                    sole[spare],
                )

    # ----- totals ----    # ----- totals ---------------------------------------------------------------------------
    def totals(self) -> tuple[int, int]:
        """(allocated, capacity) bytes over every device, for the metrics gauges."""
        a = self.arrays
        return int(a.used.sum()), int(a.capacity.sum())


def check_invariant(ledger: Ledger, live_pods: Iterable[str] | None = None) -> list[Violation]:
    """Everything that is wrong with the ledger; an empty list means the invariant holds.

    - on every device: reserved bytes <= memory and pods <= replicas;
    - every reservation is counted on devices that exist, and exactly once;
    - with `live_pods` (keys of pods that exist), nothing is held by a pod that is gone.
    """
    out: list[Violation] = []
    a = ledger.arrays
    used = np.zeros_like(a.used)
    used_replicas = np.zeros_like(a.used_replicas)
    seen: set[str] = set()
    for res in ledger.reservations():
        if res.key in seen:
            out.append(Violation("pod holds two reservations", res.key))
        seen.add(res.key)
        for dev_id, nbytes in zip(res.device_ids, res.bytes_per_device):
            i = ledger.row(res.node, dev_id)
            if i is None:
                out.append(
                    Violation(f"reservation on missing device {dev_id}", f"{res.node}/{res.key}")
                )
                continue
            used[i] += nbytes
            used_replicas[i] += 1
    for i in np.flatnonzero((used != a.used) | (used_replicas != a.used_replicas)).tolist():
        d = a.devices[i]
        out.append(
            Violation("derived totals disagree with reservations", f"{d.node}/GPU {d.device_id}")
        )
    for what, held, limit in (("VRAM", used, a.capacity), ("replicas", used_replicas, a.replicas)):
        for i in np.flatnonzero(held > limit).tolist():
            d = a.devices[i]
            out.append(
                Violation(
                    f"{what} oversubscribed: {int(held[i])} > {int(limit[i])}",
                    f"{d.node}/GPU {d.device_id}",
                )
            )
    for rid, name in {rid: name for name, rid in a.resources.items()}.items():
        if rid in ledger._summaries:  # the invariant checks derived state too
            for r in ledger.summary(rid).same_as(summary_of(a, rid)).tolist():
                out.append(Violation(f"stale summary of free {name}", a.node_names[r]))
    if live_pods is not None:
        alive = set(live_pods)
        for key in sorted(seen - alive):
            out.append(Violation("held by a pod that no longer exists", key))
    return out
