"""Free capacity as the planner sees it: the ledger's GPUs plus each node's free CPU and memory,
and a workload profile to judge which free VRAM is *stranded*.

kube-scheduler enforces CPU/memory itself, but a GPU plan that ignores them proposes nodes the
scheduler will reject; so every planner and simulator policy works on this snapshot.

Stranded VRAM follows the FGD paper's fragmentation measure (Weng et al., USENIX ATC'23): for a
pending-demand type t, the free memory of a GPU is a fragment when a t pod cannot use it (too
little memory left, no replica left, wrong product), and *all* free GPU memory of a node is a
fragment when a t pod cannot run on that node at all (CPU, memory or GPU count). Weighting by the
share of each type gives the expected stranded bytes. `FragIndex` keeps the per-node terms so a
candidate placement is judged with a few vector operations.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import repeat

import numpy as np

from extender.demand import Demand
from extender.ledger import (
    DeviceArrays,
    Ledger,
    LedgerError,
    Reservation,
    first_k_per_node,
    run_starts,
)
from extender.planner.pressure import ProductPressure

__all__ = [
    "Capacity",
    "Workload",
    "demand_kind",
    "Kind",
    "FragIndex",
    "Candidates",
    "device_matches",
    "candidates",
    "MAX_TYPES",
]

#: the workload profile keeps the most frequent demand types (their weights renormalised).
MAX_TYPES = 48


def _product_allowed(product: str, allowed: frozenset[str]) -> bool:
    base = product[: -len("-SHARED")] if product.endswith("-SHARED") else product
    return base in allowed or product in allowed


def device_matches(a: DeviceArrays, resource: str, allowed: frozenset[str] | None) -> np.ndarray:
    """Devices offering `resource` of an allowed product (the same rule as `placement`)."""
    rid = a.resources.get(resource, -1)
    m: np.ndarray = a.resource_id == rid
    if allowed is not None:
        ok = [pid for name, pid in a.products.items() if _product_allowed(name, allowed)]
        m &= np.isin(a.product_id, np.asarray(ok, np.int32))
    return m


# A device's state as `Capacity.signatures` compares it, and the two independent 64-bit hashes of
# it: per hash, odd weights for the columns and a seed.
_SIG_COLUMNS = (
    "resource_id",
    "product_id",
    "capacity",
    "per_pod_cap",
    "replicas",
    "used",
    "used_replicas",
)
_SIG_SEEDS = np.array([0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F], np.uint64)
_SIG_WEIGHTS = (
    np.random.default_rng(7).integers(1, 1 << 62, (len(_SIG_COLUMNS), 2)) * 2 + 1
).astype(np.uint64)


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: every input bit moves every output bit (uint64, wraps)."""
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        out: np.ndarray = x ^ (x >> np.uint64(31))
        return out


def _device_hashes(a: DeviceArrays) -> np.ndarray:
    """(devices, 2): two hashes of each device's `_SIG_COLUMNS` (weighted sums, mixed)."""
    block = (
        np.stack([getattr(a, c) for c in _SIG_COLUMNS], axis=1).astype(np.int64).astype(np.uint64)
    )
    with np.errstate(over="ignore"):
        return _mix64(block @ _SIG_WEIGHTS + _SIG_SEEDS)


def row_hashes(key: np.ndarray, seed: int = 11) -> np.ndarray:
    """(rows, 2): two independent 64-bit hashes of each row of an integer matrix."""
    weights = (np.random.default_rng(seed).integers(1, 1 << 62, (key.shape[1], 2)) * 2 + 1).astype(
        np.uint64
    )
    with np.errstate(over="ignore"):
        return _mix64(key.astype(np.uint64) @ weights + _SIG_SEEDS)


def hash_groups(h: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rows grouped by equal (rows, 2) hashes: (row indices ordered by group, ascending within
    one; where each group starts in that order, and the end). A sort of the hashes instead of
    `np.unique(axis=0)` on the rows themselves, which sorts them as records (0.1-0.15 s for the
    40,000 devices of 5,000 nodes). Two different rows sharing both hashes, odds about 2^-128
    per pair, would be grouped: as for `Capacity.signatures`."""
    order = np.lexsort((h[:, 1], h[:, 0]))  # stable: ascending rows within a group
    hs = h[order]
    starts = np.flatnonzero(run_starts(hs[:, 0]) | run_starts(hs[:, 1]))
    return order, np.append(starts, len(order))


def _device_states(a: DeviceArrays, lo: int, hi: int) -> Iterator[tuple[int, ...]]:
    """Rows lo..hi as exact keys: their `_SIG_COLUMNS` values, one tuple per device."""
    return zip(*(getattr(a, c)[lo:hi].tolist() for c in _SIG_COLUMNS))


def _node_keys(device_sums: np.ndarray, cpu_free: np.ndarray, mem_free: np.ndarray) -> np.ndarray:
    """(nodes, 2): each node's key from the wrapped sums of its device hashes and its free CPU and memory."""
    with np.errstate(over="ignore"):
        k = _mix64(device_sums ^ _SIG_SEEDS)
        k = _mix64(k ^ np.asarray(cpu_free).astype(np.int64).astype(np.uint64)[:, None])
        return _mix64(k + np.asarray(mem_free).astype(np.int64).astype(np.uint64)[:, None])


@dataclass
class Capacity:
    """The ledger (GPU state) plus free CPU millicores and memory bytes per ledger node row.

    Reservations go through `Ledger.reserve`, so the invariant is enforced exactly as in the server.
    """

    ledger: Ledger
    cpu_free: np.ndarray
    mem_free: np.ndarray
    cpu_total: np.ndarray
    mem_total: np.ndarray
    _sig: np.ndarray | None = None
    _sig_dirty: set[int] = field(default_factory=set)
    #: exact keys of nodes changed since the first pass -> id (ids from `_sig_base` on, after the
    #: first pass's hash classes, which are never looked up again)
    _sig_ids: dict[tuple[object, ...], int] = field(default_factory=dict)
    _sig_base: int = 0
    _sig_arrays: DeviceArrays | None = None
    #: `device_classes`: per device row its id, nodes changed since, and (as for signatures) the
    #: exact keys of rows renumbered since the first pass -> id, from `_cls_base` on
    _cls: np.ndarray | None = None
    _cls_dirty: set[int] = field(default_factory=set)
    _cls_ids: dict[tuple[object, ...], int] = field(default_factory=dict)
    _cls_base: int = 0
    #: whether `candidates` collapses identical nodes. Worth it when many pods are placed on one
    #: Capacity (the simulator, big batches: the signatures are then kept up to date per changed
    #: node); for a plan of a few pods on a fresh snapshot, the first full pass (~15 ms at 5,000
    #: nodes) costs more than scoring every candidate (~2 ms), and the choices are the same.
    dedupe: bool = True

    @classmethod
    def from_ledger(
        cls,
        ledger: Ledger,
        used_cpu: dict[str, int] | None = None,
        used_mem: dict[str, int] | None = None,
    ) -> Capacity:
        a = ledger.arrays
        names, n = a.node_names, len(a.node_names)
        # Cached allocatable columns and C-level maps, no Python loop per node: the background
        # planner's snapshot runs this on the event loop.
        cpu, mem = (x.copy() for x in ledger.allocatable())
        # A node that does not state CPU/memory is not limited by them here (kube-scheduler decides).
        cpu[cpu == 0] = 1 << 50
        mem[mem == 0] = 1 << 60
        free_cpu = cpu - np.fromiter(map((used_cpu or {}).get, names, repeat(0)), np.int64, n)
        free_mem = mem - np.fromiter(map((used_mem or {}).get, names, repeat(0)), np.int64, n)
        return cls(ledger, free_cpu, free_mem, cpu, mem)

    @property
    def arrays(self) -> DeviceArrays:
        return self.ledger.arrays

    def matches(self, resource: str, allowed: frozenset[str] | None) -> np.ndarray:
        """`device_matches`, cached: devices do not change while a plan or a replay runs. The
        array is read-only: every later placement on this capacity reads it, so a caller that
        and-ed its own conditions into it in place would hide devices from all of them."""
        a = self.arrays
        cache: dict[tuple[int, str, frozenset[str] | None], np.ndarray]
        cache = self.__dict__.setdefault("_match_cache", {})
        key = (id(a), resource, allowed)
        m = cache.get(key)
        if m is None:
            if len(cache) > 256:
                cache.clear()
            m = cache[key] = device_matches(a, resource, allowed)
            m.flags.writeable = False
        return m

    def signatures(self) -> np.ndarray:
        """Per node, an id such that nodes sharing it are in the same free state (CPU, memory and
        the multiset of device states): interchangeable for any placement rule.

        The first call keys every node by a hash (`_all_signatures`, vectorised); a node changed
        since is keyed by its exact state, which one node at a time costs less. The two kinds of
        key never share an id, so two identical nodes may carry different ids: that costs a
        duplicate candidate (every rule then picks the lower node, as with one id), never a wrong
        one."""
        a = self.arrays
        if self._sig is None or self._sig_arrays is not a:
            self._sig = self._all_signatures(a)
            self._sig_base, self._sig_ids = int(self._sig.max(initial=-1)) + 1, {}
            self._sig_arrays, self._sig_dirty = a, set()
            self._cls = None
        self._cls_dirty |= self._sig_dirty
        for (
            n
        ) in self._sig_dirty:  # a node changed since: its exact state as the key (~15 us in Python)
            lo, hi = int(a.node_start[n]), int(a.node_start[n + 1])
            key = (
                int(self.cpu_free[n]),
                int(self.mem_free[n]),
                tuple(sorted(_device_states(a, lo, hi))),
            )
            self._sig[n] = self._sig_ids.setdefault(key, self._sig_base + len(self._sig_ids))
        self._sig_dirty = set()
        return self._sig

    @property
    def signature_count(self) -> int:
        """An upper bound on `signatures()` ids (they are below it)."""
        return self._sig_base + len(self._sig_ids)

    @property
    def device_class_count(self) -> int:
        """An upper bound on `device_classes()` ids (they are below it)."""
        return self._cls_base + len(self._cls_ids)

    def device_classes(self) -> np.ndarray:
        """Per device row, an id shared by interchangeable devices: the same state
        (`_SIG_COLUMNS`) on nodes with the same `signatures` id.

        `candidates` keeps the first device of each id among those that fit. Kept like the
        signatures: the first call numbers every row at once (`hash_groups`), a node changed
        since gets its rows numbered by their exact keys. As there, two identical devices may
        carry different ids (a duplicate candidate); two different ones share one only if both
        64-bit hashes of their rows collide."""
        sig = self.signatures()
        a = self.arrays
        if self._cls is None:
            order, bounds = hash_groups(
                row_hashes(
                    np.column_stack([sig[a.node_of], *(getattr(a, c) for c in _SIG_COLUMNS)])
                )
            )
            self._cls = np.empty(len(order), np.int64)
            self._cls[order] = np.repeat(np.arange(len(bounds) - 1), np.diff(bounds))
            self._cls_base, self._cls_ids, self._cls_dirty = len(bounds) - 1, {}, set()
            return self._cls
        ids = self._cls_ids
        for n in self._cls_dirty:
            lo, hi = int(a.node_start[n]), int(a.node_start[n + 1])
            s = int(sig[n])
            self._cls[lo:hi] = [
                ids.setdefault((s, dev), self._cls_base + len(ids))
                for dev in _device_states(a, lo, hi)
            ]
        self._cls_dirty = set()
        return self._cls

    def _all_signatures(self, a: DeviceArrays) -> np.ndarray:
        """`signatures` for every node at once, vectorised: the background planner computes them
        for every fresh snapshot, on a thread that shares the GIL with the event loop, where a
        Python loop over 5,000 nodes (~60 ms) showed in the verbs' p99.

        A node's key is two independent 64-bit hashes of its free CPU, free memory and the
        multiset of its device states (a wrapped sum of per-device hashes: no sort). Two
        different states sharing both has odds of about 2^-128 per pair; it would merge two node
        classes, and a plan built on that, replayed through `Ledger.reserve` before use, would be
        refused rather than overcommit."""
        n_nodes = len(a.node_names)
        starts = a.node_start[:-1]
        nonempty = a.node_start[1:] > starts
        sums = np.zeros((n_nodes, 2), np.uint64)
        if nonempty.any():
            sums[nonempty] = np.add.reduceat(
                _device_hashes(a), starts[nonempty], axis=0, dtype=np.uint64
            )
        _, sig = np.unique(
            _node_keys(sums, self.cpu_free, self.mem_free), axis=0, return_inverse=True
        )
        return sig.astype(np.int64).ravel()

    def fits_host(self, demand: Demand) -> np.ndarray:
        """Nodes with enough free CPU and memory for the pod (kube-scheduler's NodeResourcesFit)."""
        return (self.cpu_free >= demand.cpu_milli) & (self.mem_free >= demand.memory_bytes)

    def apply(
        self, demand: Demand, res: Reservation | None, node_row: int, *, overcommit: bool = False
    ) -> None:
        """Hold the pod's GPUs (atomic check-and-set; `overcommit` records like a device plugin
        that does not know memory) and its CPU and memory."""
        if res is not None:
            if overcommit:
                self.ledger.record(res)
            else:
                self.ledger.reserve(res)
        self.cpu_free[node_row] -= demand.cpu_milli
        self.mem_free[node_row] -= demand.memory_bytes
        self._sig_dirty.add(node_row)

    def hold(self, held: Iterable[tuple[Demand, Reservation | None, str]]) -> None:
        """Hold what plan entries still hold (their GPUs, CPU and memory; demand, reservation,
        node), skipping any that no longer fits: that entry fails its own check when used."""
        for demand, res, node in held:
            row = self.ledger.node_row(node)
            if row is None:
                continue
            try:
                self.apply(demand, res, row)
            except LedgerError:
                continue

    def remove(self, demand: Demand, node_row: int) -> None:
        self.ledger.release(demand.pod.key)
        self.cpu_free[node_row] += demand.cpu_milli
        self.mem_free[node_row] += demand.memory_bytes
        self._sig_dirty.add(node_row)


#: what `demand_kind` returns
Kind = tuple[int, int, int, int, str, frozenset[str] | None]


def demand_kind(d: Demand) -> Kind:
    """What makes two pods the same demand type: GPUs, bytes per GPU (-1: whole devices), CPU,
    memory, resource and allowed products."""
    return (
        d.gpu_count,
        -1 if d.bytes_per_gpu is None else d.bytes_per_gpu,
        d.cpu_milli,
        d.memory_bytes,
        d.resource,
        d.allowed_products,
    )


@dataclass
class Workload:
    """Demand types and their shares: what the cluster's free capacity should stay useful for."""

    gpu_count: np.ndarray  # (T,)
    need: np.ndarray  # (T,) bytes per GPU, -1 for whole devices
    cpu: np.ndarray
    mem: np.ndarray
    weight: np.ndarray  # (T,) sums to 1
    resource: list[str] = field(default_factory=list)
    allowed: list[frozenset[str] | None] = field(default_factory=list)
    #: every pod set limited to some GPU models (not only the common types): (resource, allowed
    #: models, declared bytes, whole devices) of their GPU demand, for `pressure.ProductPressure`
    limited: list[tuple[str, frozenset[str], int, int]] = field(default_factory=list)
    #: declared bytes and whole devices of every GPU pod (what `limited` is a share of)
    gpu_demand: tuple[int, int] = (0, 0)
    #: (T,) pods per type, `weight`'s numerators: FragIndex weighs by them in integers
    count: np.ndarray | None = None

    @classmethod
    def from_demands(cls, demands: Iterable[Demand], max_types: int = MAX_TYPES) -> Workload:
        """The most common demand types, weighted by how many pods have them (FGD's choice), and
        the GPU demand of every pod set limited to some models."""
        return cls.from_counts(Counter(demand_kind(d) for d in demands), max_types)

    @classmethod
    def from_counts(cls, counts: Mapping[Kind, int], max_types: int = MAX_TYPES) -> Workload:
        """`from_demands` from pods counted by `demand_kind` (the live cluster's `demand_mix`:
        counted as pods come and go, so a plan does not parse every pod again)."""
        limited: dict[tuple[str, frozenset[str]], list[int]] = {}
        gpu_bytes = gpu_whole = 0
        for (gpus, need, _, _, resource, allowed), n in counts.items():
            if gpus == 0 or n <= 0:
                continue
            declared = 0 if need < 0 else n * gpus * need
            whole = n * gpus if need < 0 else 0
            gpu_bytes += declared
            gpu_whole += whole
            if allowed is not None:
                acc = limited.setdefault((resource, allowed), [0, 0])
                acc[0] += declared
                acc[1] += whole
        top = [(k, c) for k, c in Counter(counts).most_common(max_types) if c > 0]
        if not top:
            top = [((1, -1, 0, 0, "nvidia.com/gpu", None), 1)]
        total = float(sum(c for _, c in top))
        return cls(
            gpu_count=np.asarray([k[0] for k, _ in top], np.int64),
            need=np.asarray([k[1] for k, _ in top], np.int64),
            cpu=np.asarray([k[2] for k, _ in top], np.int64),
            mem=np.asarray([k[3] for k, _ in top], np.int64),
            weight=np.asarray([c / total for _, c in top], np.float64),
            count=np.asarray([c for _, c in top], np.int64),
            resource=[k[4] for k, _ in top],
            allowed=[k[5] for k, _ in top],
            limited=[(r, al, b, w) for (r, al), (b, w) in limited.items()],
            gpu_demand=(gpu_bytes, gpu_whole),
        )

    def __len__(self) -> int:
        return len(self.weight)


def open_cost_problem(value: float) -> str | None:
    """Why `value` cannot be `FragIndex.open_cost` (NaN, infinite or negative), or None: the
    check FragIndex makes, which `serve` and `simulate` make on their flag before any work."""
    if math.isfinite(value) and value >= 0:
        return None
    return f"must be a number >= 0, got {value}"


class FragIndex:
    """Per-node fragmentation terms, updated node by node as pods are placed.

    For node n and type t: `A[n,t]` free bytes on devices a t pod cannot use, `okc[n,t]` devices it
    can use, `total[n]` all free bytes. Fragment of n for t is `A` if a t pod can run on n, else `total`.

    `count_foreign=False` (the planner's rule): a node with the type's resource but none of the GPU
    models it may use is no fragment for that type, rather than all its free memory. FGD's
    count makes the models few types may use look the most fragmented, so filling them with pods
    that could go anywhere looks like progress (`pressure` says why that loses). `pressure` is the
    workload's `ProductPressure` on these devices.

    `open_cost` (the planner's option, `--open-gpu-cost`): GPUs of memory (the cluster's mean
    device memory) the planner's rule adds to the measure for each idle device a placement opens
    (`greedy.packed_pick`); 0 is FGD's measure alone.
    """

    def __init__(
        self,
        cap: Capacity,
        workload: Workload,
        *,
        count_foreign: bool = True,
        open_cost: float = 0.0,
    ) -> None:
        if problem := open_cost_problem(open_cost):
            raise ValueError(f"open_cost {problem}")
        self.cap = cap
        self.w = workload
        self.open_cost = float(open_cost)
        a = cap.arrays
        self.a = a
        n_nodes = len(a.node_names)
        T = len(workload)
        self.match = np.zeros((len(a.capacity), T), bool)
        self.need = np.zeros((len(a.capacity), T), np.int64)
        for t in range(T):
            self.match[:, t] = device_matches(a, workload.resource[t], workload.allowed[t])
            self.need[:, t] = a.per_pod_cap if workload.need[t] < 0 else workload.need[t]
        self.need_ok = self.need <= a.per_pod_cap[:, None]
        #: (nodes, types) True where the node has the type's resource but none of its allowed
        #: models; None: FGD's count
        self.foreign: np.ndarray | None = None
        if not count_foreign:
            resource = np.stack([device_matches(a, r, None) for r in workload.resource], axis=1)
            self.foreign = (a.per_node_sum(self.match, np.int64) == 0) & (
                a.per_node_sum(resource, np.int64) > 0
            )
        self.pressure = ProductPressure(a, _limited_masks(a, workload))
        self.count, self.count_total = _integer_weights(a, workload)
        #: `delta`'s results per pod kind and candidate (its first device row), for a caller
        #: that passes `refresh` every node changed since, its CPU and memory too (None: not
        #: kept). `ahead.InlineRule` keeps them: between two of its pods few nodes change, and
        #: scoring every fitting device of a large cluster was most of its cost.
        self.memo: dict[Kind, np.ndarray] | None = None
        # A GPU-less type uses no GPU memory, so none of it is a fragment for it while it can run.
        self.gpuless = workload.gpu_count == 0
        self.A = np.zeros((n_nodes, T), np.float64)
        self.okc = np.zeros((n_nodes, T), np.int64)
        self.total = np.zeros(n_nodes, np.float64)
        self.refresh()

    def usable(
        self, rows: np.ndarray | slice, free: np.ndarray, rep_left: np.ndarray
    ) -> np.ndarray:
        """(devices, types): which workload types could use each device of `rows` with `free` bytes
        and `rep_left` replicas left (GPU-less types always): FGD's per-device test, which the
        arc-flow plan and the simulator's usable free GPUs apply too."""
        ok = (
            self.match[rows]
            & self.need_ok[rows]
            & (rep_left[:, None] > 0)
            & (free[:, None] >= self.need[rows])
        )
        out: np.ndarray = ok | self.gpuless
        return out

    def refresh(self, node_rows: Sequence[int] | None = None) -> None:
        a = self.a
        if node_rows is None:
            rows = slice(None)
            free = (a.capacity - a.used).astype(np.float64)
            ok = self.usable(rows, a.capacity - a.used, a.replicas - a.used_replicas)
            fpos = np.maximum(free, 0)
            self.A = a.per_node_sum(np.where(ok, 0.0, fpos[:, None]), np.float64)
            self.okc = a.per_node_sum(ok, np.int64)
            self.total = a.per_node_sum(fpos, np.float64)
            if self.memo is not None:
                self.memo.clear()
            return
        for n in node_rows:
            lo, hi = int(a.node_start[n]), int(a.node_start[n + 1])
            for known in self.memo.values() if self.memo is not None else ():
                known[lo:hi] = np.nan
            free = a.capacity[lo:hi] - a.used[lo:hi]
            ok = self.usable(slice(lo, hi), free, a.replicas[lo:hi] - a.used_replicas[lo:hi])
            fpos = np.maximum(free, 0).astype(np.float64)
            self.A[n] = (np.where(ok, 0.0, fpos[:, None])).sum(axis=0)
            self.okc[n] = ok.sum(axis=0)
            self.total[n] = fpos.sum()

    def runnable(self, cpu_free: np.ndarray, mem_free: np.ndarray, okc: np.ndarray) -> np.ndarray:
        w = self.w
        return (
            (cpu_free[..., None] >= w.cpu) & (mem_free[..., None] >= w.mem) & (okc >= w.gpu_count)
        )

    def weigh(self, frag: np.ndarray) -> np.ndarray:
        """Sum over the last axis (types) of `frag` (whole bytes, or True/False) times the pods of
        each type (`count`): the expected stranded bytes times `count_total`.

        In integers, so it is exact: equal placements score equal, on every CPU. A float dot
        product's rounding depends on the BLAS kernel and on where a row sits in the array; near
        ties of FGD's measure then went one way on one machine and the other way on another (a
        row-wise float sum instead of the dot product moved FGD's end result on one trace list
        by 18 GPUs of memory)."""
        out: np.ndarray = frag.astype(np.int64) @ self.count
        return out

    def _node_stranded(self, rows: np.ndarray | slice) -> np.ndarray:
        """`node_frag` of `rows` times `count_total`, exact."""
        run = self.runnable(self.cap.cpu_free[rows], self.cap.mem_free[rows], self.okc[rows])
        frag = np.where(run, self.A[rows], self.total[rows][..., None])
        if self.foreign is not None:
            frag = np.where(self.foreign[rows], 0.0, frag)
        return self.weigh(frag)

    def node_frag(self, node_rows: np.ndarray | None = None) -> np.ndarray:
        """Expected stranded bytes per node (weighted over the workload types)."""
        out: np.ndarray = self._node_stranded(
            slice(None) if node_rows is None else node_rows
        ) / float(self.count_total)
        return out

    def delta(self, cand: Candidates, demand: Demand) -> np.ndarray:
        """Change of expected stranded bytes on the candidate's node if the pod went there (from
        `memo` where kept)."""
        if self.memo is None or not len(cand) or cand.devices.shape[1] == 0:
            return self._delta(cand, demand)
        key = demand_kind(demand)
        known = self.memo.get(key)
        if known is None:
            if len(self.memo) >= MEMO_KINDS:
                self.memo.clear()
            known = self.memo[key] = np.full(len(self.a.capacity), np.nan)
        first = cand.devices[:, 0]
        out: np.ndarray = known[first]
        miss = np.flatnonzero(np.isnan(out))
        if len(miss):
            out[miss] = known[first[miss]] = self._delta(cand.take(miss), demand)
        return out

    def _delta(self, cand: Candidates, demand: Demand) -> np.ndarray:
        a = self.a
        n = cand.node
        A = self.A[n].copy()
        okc = self.okc[n].copy()
        total = self.total[n].copy()
        for j in range(cand.devices.shape[1]):
            g = cand.devices[:, j]
            free = a.capacity[g] - a.used[g]
            rep = a.replicas[g] - a.used_replicas[g]
            ok = self.usable(g, free, rep)
            nb = cand.need[:, j]
            free2 = free - nb
            ok2 = self.usable(g, free2, rep - 1)
            f1 = np.maximum(free, 0).astype(np.float64)[:, None]
            f2 = np.maximum(free2, 0).astype(np.float64)[:, None]
            A += np.where(ok2, 0.0, f2) - np.where(ok, 0.0, f1)
            okc += ok2.astype(np.int64) - ok.astype(np.int64)
            total += (f2 - f1)[:, 0]
        cpu2 = self.cap.cpu_free[n] - demand.cpu_milli
        mem2 = self.cap.mem_free[n] - demand.memory_bytes
        frag = np.where(self.runnable(cpu2, mem2, okc), A, total[:, None])
        if self.foreign is not None:
            frag = np.where(self.foreign[n], 0.0, frag)
        out: np.ndarray = (self.weigh(frag) - self._node_stranded(n)) / float(self.count_total)
        return out


#: pod kinds `FragIndex.memo` keeps at most (a device row's float each)
MEMO_KINDS = 32


def _integer_weights(a: DeviceArrays, workload: Workload) -> tuple[np.ndarray, int]:
    """The workload's pods per type for `FragIndex.weigh`, and their sum, scaled down (in the same
    proportions, each at least 1) when a node's whole memory times the sum could overflow 62
    bits."""
    count = (
        workload.count.astype(np.int64)
        if workload.count is not None
        else np.rint(workload.weight * 1e6).astype(np.int64)
    )
    count = np.maximum(count, 1)
    node_max = int(a.per_node_sum(np.maximum(a.capacity, 0), np.int64).max(initial=0))
    limit = (1 << 62) // max(node_max, 1)
    if int(count.sum()) > limit:
        count = np.maximum(np.floor(count * (limit / (2 * int(count.sum())))), 1).astype(np.int64)
    return count, int(count.sum())


def _limited_masks(a: DeviceArrays, workload: Workload) -> list[tuple[np.ndarray, float]]:
    """Per pod set of `workload.limited`: the devices it may use and its share of the workload's
    GPU memory (a whole device counts as the cluster's mean device memory)."""
    if not workload.limited or not len(a.capacity):
        return []
    whole = float(a.capacity.mean())
    total = workload.gpu_demand[0] + workload.gpu_demand[1] * whole
    if total <= 0:
        return []
    return [
        (device_matches(a, resource, allowed), (declared + devices * whole) / total)
        for resource, allowed, declared, devices in workload.limited
    ]


@dataclass
class Candidates:
    """Ways to place one pod: `node[c]` and its `devices[c, :]` (ledger device rows) with `need` bytes."""

    node: np.ndarray
    devices: np.ndarray  # (C, k) int
    need: np.ndarray  # (C, k) bytes

    def __len__(self) -> int:
        return len(self.node)

    def take(self, idx: np.ndarray) -> Candidates:
        return Candidates(self.node[idx], self.devices[idx], self.need[idx])

    def opened(self, a: DeviceArrays) -> np.ndarray:
        if self.devices.shape[1] == 0:
            return np.zeros(len(self.node), np.int64)
        out: np.ndarray = (a.used_replicas[self.devices] == 0).sum(axis=1)
        return out

    def leftover(self, a: DeviceArrays) -> np.ndarray:
        if self.devices.shape[1] == 0:
            return np.zeros(len(self.node), np.int64)
        out: np.ndarray = (a.capacity[self.devices] - a.used[self.devices] - self.need).sum(axis=1)
        return out

    def reservation(self, a: DeviceArrays, c: int, demand: Demand) -> Reservation | None:
        if self.devices.shape[1] == 0:
            return None
        rows = sorted(int(g) for g in self.devices[c])
        need = {int(g): int(b) for g, b in zip(self.devices[c], self.need[c])}
        return Reservation(
            pod=demand.pod,
            node=a.node_names[int(self.node[c])],
            device_ids=tuple(a.devices[g].device_id for g in rows),
            bytes_per_device=tuple(need[g] for g in rows),
            priority=demand.priority,
            declared=demand.bytes_per_gpu is not None,
        )


def candidates(
    cap: Capacity,
    demand: Demand,
    *,
    order: str = "tight",
    dedupe: bool = True,
    overcommit: bool = False,
) -> Candidates:
    """Every distinct way to place `demand` now.

    One GPU: each fitting device. k GPUs: per node, the k devices picked by `order` ("tight":
    partly used first, then least leftover; "index": lowest index; "spread": fewest pods, as the
    device plugin's distributed allocation). No GPU: each node with room. `overcommit` ignores
    memory (replica count only). With `dedupe`, identical devices of identical nodes (same
    `signatures`) collapse to the one on the lowest node: every rule scores them the same.
    """
    a = cap.arrays
    host = cap.fits_host(demand)
    k = demand.gpu_count
    sig = cap.signatures() if dedupe and cap.dedupe else None
    if k == 0:
        nodes = np.flatnonzero(host)
        if sig is not None and len(nodes):
            nodes = nodes[_firsts(sig[nodes], cap.signature_count)]
        return Candidates(
            nodes, np.zeros((len(nodes), 0), np.int64), np.zeros((len(nodes), 0), np.int64)
        )
    matches = cap.matches(demand.resource, demand.allowed_products)
    need = (
        a.per_pod_cap
        if demand.bytes_per_gpu is None
        else np.full(len(a.capacity), demand.bytes_per_gpu, np.int64)
    )
    ok = matches & (a.used_replicas < a.replicas) & host[a.node_of]
    if not overcommit:
        ok &= (a.capacity - a.used >= need) & (a.per_pod_cap >= need)
    rows = np.flatnonzero(ok)
    if k == 1:
        if sig is not None and len(rows):
            rows = rows[
                _firsts(cap.device_classes()[rows], cap.device_class_count)
            ]  # the lowest row of each class
        return Candidates(a.node_of[rows].astype(np.int64), rows[:, None], need[rows][:, None])
    if len(rows) == 0:
        return Candidates(
            np.zeros(0, np.int64), np.zeros((0, k), np.int64), np.zeros((0, k), np.int64)
        )
    node = a.node_of[rows]
    if order == "index":
        key2 = rows
    elif order == "spread":
        key2 = a.used_replicas[rows].astype(np.int64) * (1 << 32) + rows
    else:
        empty = (a.used_replicas[rows] == 0).astype(np.int64)
        left = a.capacity[rows] - a.used[rows] - need[rows]
        key2 = np.lexsort((rows, left, empty))
        inv = np.empty_like(key2)
        inv[key2] = np.arange(len(key2))
        key2 = inv
    srt = np.lexsort((key2, node))
    rows, node = rows[srt], node[srt]
    rows = rows[first_k_per_node(node, k, len(a.node_names))].reshape(-1, k)
    if sig is not None and len(rows):
        rows = rows[
            _firsts(sig[a.node_of[rows[:, 0]]], cap.signature_count)
        ]  # nodes ascending: the lowest of each
    return Candidates(a.node_of[rows[:, 0]].astype(np.int64), rows, need[rows])


def _firsts(ids: np.ndarray, size: int) -> np.ndarray:
    """Mask of the entries that are the first of their id (ids below `size`): one scatter of
    minimum positions, no sort (a sort of the fitting devices per pod was a third of FGD's time)."""
    pos = np.arange(len(ids))
    first = np.full(size, len(ids), np.int64)
    np.minimum.at(first, ids, pos)
    out: np.ndarray = first[ids] == pos
    return out
