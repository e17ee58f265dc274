"""Why a node cannot take a pod, worded once per distinct reason and in vector form: node kinds
share their label-only reasons, and reasons that depend on figures are worded once per figure."""

from __future__ import annotations

from collections.abc import Callable
from enum import IntEnum
from functools import lru_cache

import numpy as np

from extender.arrays import DeviceArrays, run_starts
from extender.demand import Demand
from extender.inventory import MigSlice
from extender.ledger import Ledger
from extender.placement.cache import FIXED_REASONS_KEPT, StaticFit, cache_of
from extender.placement.fit import Fit, static_fit
from extender.placement.outcome import (
    FilterOutcome,
    SharedReasons,
    add_shared_reasons,
    mutable_unresolvable,
)
from extender.placement.pin_rule import PIN_MISSING
from extender.placement.views import node_kinds, per_node
from extender.quantity import format_bytes
from extender.stock_plugin import SharedFit


class ReasonKind(IntEnum):
    """Why a node cannot take a pod, in the order `explain` tests them: the first that holds
    names the node. The first four depend on labels and the demand only, so the node is
    unresolvable (no preemption helps); the last two depend on what is in use.

    The vector code compares `.value`: numpy compares a plain int several times faster than an
    IntEnum member."""

    NOT_A_GPU_NODE = 0  # the node's labels describe no usable GPU
    NO_SUCH_RESOURCE = 1  # no device of the resource (or of an allowed product)
    TOO_FEW_DEVICES = 2  # fewer devices of the resource than the pod asks for
    DEVICES_TOO_SMALL = 3  # enough devices, too few big enough for the pod
    NO_FREE_REPLICA = 4  # too few of them have a free replica now
    NOT_ENOUGH_VRAM = 5  # too few of them have the free VRAM now


#: the kinds below this one are unresolvable
_RESOLVABLE = ReasonKind.NO_FREE_REPLICA.value
#: the kinds below this one depend on labels and the demand's resource, products and GPU count
#: only (not on its bytes): the same for every pod of that shape on a candidate list
_BY_BYTES = ReasonKind.DEVICES_TOO_SMALL.value
#: distinct reasons worded once and kept (`lru_cache`): pure functions of their figures
_WORDINGS_KEPT = 1 << 16


def explain(
    ledger: Ledger,
    fit: Fit,
    demand: Demand,
    bad: np.ndarray,
    out: FilterOutcome,
    n_ok: np.ndarray,
    asked: np.ndarray | None = None,
    one: tuple[np.ndarray | None, np.ndarray] | None = None,
    summary: tuple[np.ndarray, np.ndarray] | None = None,
    books_short: bool = False,
) -> None:
    """A reason for every node in `bad`, in vector form: each node gets its `ReasonKind`, then
    each distinct reason is worded once. `books_short`: no node in `bad` has room for the pod on
    the books (`_filter_plugin`), so the device plugin's bound refuses none of them (see
    `_explain_shared`).

    The kinds below DEVICES_TOO_SMALL depend on labels and the demand's resource, products and
    GPU count only: for a candidate list seen before (`asked`, the rows of the request, from the candidate_rows
    cache) and such a demand, their reasons are the same dict as last time and only the other
    nodes are looked at.
    """
    a = fit.a
    names, kind, problem = node_kinds(ledger, a)
    n_nodes = len(a.node_names)
    k = demand.gpu_count
    dkey = (demand.resource, demand.bytes_per_gpu, demand.allowed_products, k)
    cache = cache_of(a)
    fixed_cache = cache.fixed
    ckey = (id(asked), demand.resource, demand.allowed_products, k)  # label-only kinds
    known = fixed_cache.get(ckey) if asked is not None else None
    base = None
    if known is not None and known[0] is asked:
        base = known[2]
        bad = bad[~known[1][bad]]
        if not len(bad):
            add_shared_reasons(out, base)
            return
    n_match, n_big, big_enough = _static_counts(a, fit, demand, kind)
    if (
        one is not None
    ):  # from _filter_one (k == 1): a free replica on a big-enough device iff largest >= 0
        with_slot, largest = one
        n_slot = (largest >= 0).astype(np.int64)
    elif (
        summary is not None
    ):  # from _filter_summary: per node, devices with a free replica and largest free
        n_slot, largest = summary
    else:
        with_slot = big_enough & (a.used_replicas < a.replicas)
        n_slot = per_node(a, with_slot)
    # np.select's first matching condition, as masked assignments from the last to the first (cheaper)
    cat = np.full(len(bad), ReasonKind.NOT_ENOUGH_VRAM.value, np.int64)
    cat[n_slot[bad] < k] = ReasonKind.NO_FREE_REPLICA.value
    cat[n_big[bad] < k] = ReasonKind.DEVICES_TOO_SMALL.value
    matching = n_match[bad]
    cat[matching < k] = ReasonKind.TOO_FEW_DEVICES.value
    cat[matching == 0] = ReasonKind.NO_SUCH_RESOURCE.value
    cat[problem[bad]] = ReasonKind.NOT_A_GPU_NODE.value
    fixed = cat < _RESOLVABLE
    if base is not None:
        add_shared_reasons(out, base)
    if fixed.any():
        rows = bad[fixed]
        worded = cache.kind_reasons
        row_kinds = kind[rows]
        present = np.flatnonzero(np.bincount(row_kinds)).tolist()  # a handful of kinds
        by_kind = np.empty(present[-1] + 1, dtype=object)
        for kd in present:
            msg = worded.get((kd, dkey))
            if msg is None:
                i = int(np.argmax(row_kinds == kd))
                r = int(rows[i])
                msg = worded[(kd, dkey)] = _fixed_reason(
                    ledger, fit, demand, ReasonKind(int(cat[fixed][i])), r, int(n_match[r])
                )
            by_kind[kd] = msg
        mutable_unresolvable(out).update(zip(names[rows].tolist(), by_kind[row_kinds].tolist()))
    if asked is not None and known is None:
        if len(fixed_cache) >= FIXED_REASONS_KEPT:
            fixed_cache.clear()
        label_only = cat < _BY_BYTES  # "too small" depends on the pod's bytes
        is_fixed = np.zeros(n_nodes, bool)
        is_fixed[bad[label_only]] = True
        fixed_cache[ckey] = (
            asked,
            is_fixed,
            SharedReasons({n: out.unresolvable[n] for n in names[bad[label_only]].tolist()}),
        )
    slot = cat == ReasonKind.NO_FREE_REPLICA.value
    if slot.any():
        rows = bad[slot]
        out.failed.update(_worded(names[rows].tolist(), n_slot[rows], lambda c: _slot_reason(c, k)))
    mem = cat == ReasonKind.NOT_ENOUGH_VRAM.value
    if not mem.any():
        return
    rows = bad[mem]
    need = demand.bytes_per_gpu
    if fit.shared is not None:
        rows = _explain_shared(
            fit, fit.shared, demand, rows, names, n_match, out, books_short
        )  # what is left fails on memory
        if not len(rows):
            return
    out.failed.update(_worded(names[rows].tolist(), n_ok[rows], lambda c: _mem_reason(need, c, k)))


def explain_blocked(
    a: DeviceArrays, s: SharedFit, rows: np.ndarray, names: np.ndarray, out: FilterOutcome
) -> None:
    """What `_explain_shared` says of nodes with room on the books that the bound refuses, when
    the bound is the same for all their devices (`_filter_plugin`): read at each node's first
    device. A pod that cannot take a pin is refused for good; else the worst case is named."""
    first = a.node_start[rows]
    pin = s.needs_pin[first]
    if pin.any():
        mutable_unresolvable(out).update(dict.fromkeys(names[rows[pin]].tolist(), PIN_MISSING))
    first, rows = first[~pin], rows[~pin]
    if not len(rows):
        return
    out.failed.update(
        zip(names[rows].tolist(), stack_reasons(s.policy, s.worst[first], a.capacity[first]))
    )


def stack_reasons(policy: str, worst: np.ndarray, cap: np.ndarray) -> list[str]:
    """The reason for each (worst case, GPU size) pair, the plugin may put that much on one GPU,
    each distinct pair worded once."""
    order = np.lexsort((cap, worst))
    new = run_starts(worst[order]) | run_starts(cap[order])
    which = np.empty(len(worst), np.int64)
    which[order] = np.cumsum(new) - 1
    words = np.array(
        [
            _stack_reason(policy, w, c)
            for w, c in zip(worst[order][new].tolist(), cap[order][new].tolist())
        ],
        dtype=object,
    )
    return list(words[which].tolist())


def _worded(names: list[str], counts: np.ndarray, word: Callable[[int], str]) -> dict[str, str]:
    """{name: word(count)} for nodes whose reason differs only by a small count (0..k-1 devices):
    each distinct count is worded once."""
    present = np.flatnonzero(np.bincount(counts)).tolist()
    if len(present) == 1:
        return dict.fromkeys(names, word(present[0]))
    msgs = np.empty(present[-1] + 1, dtype=object)
    for c in present:
        msgs[c] = word(c)
    return dict(zip(names, msgs[counts].tolist()))


def _static_counts(a: DeviceArrays, fit: Fit, demand: Demand, kind: np.ndarray) -> StaticFit:
    """Per node: devices of the resource (and product), and those big enough for the pod; plus
    the big-enough mask. They depend on labels and the demand only, so they are kept per demand,
    and counted on one node per kind (nodes of a kind have the same devices) instead of all."""
    kept = cache_of(a)
    cache = kept.static_counts.room()
    key = (demand.resource, demand.bytes_per_gpu, demand.allowed_products)
    hit = cache.get(key)
    if hit is None:
        reps = kept.kind_reps
        if reps is None:
            reps = kept.kind_reps = (
                np.unique(kind, return_index=True)[1] if len(kind) else np.zeros(0, np.int64)
            )
        bounds = list(zip(a.node_start[reps].tolist(), a.node_start[reps + 1].tolist()))
        big_enough = static_fit(a, demand)[2]
        per_kind = np.zeros((2, int(kind.max()) + 1 if len(kind) else 0), np.int64)
        for j, (lo, hi) in enumerate(bounds):
            per_kind[0, kind[reps[j]]] = np.count_nonzero(fit.matches[lo:hi])
            per_kind[1, kind[reps[j]]] = np.count_nonzero(big_enough[lo:hi])
        hit = cache[key] = (per_kind[0][kind], per_kind[1][kind], big_enough)
    return hit


@lru_cache(maxsize=_WORDINGS_KEPT)
def _mem_reason(need: int | None, n_ok: int, k: int) -> str:
    """No per-node figure in the wording: kube-scheduler's event counts nodes per distinct reason
    ("0/5000 nodes are available: 1200 no GPU with 20Gi free, ..."), and a figure per node would
    split that into hundreds of one-node entries. /state shows each GPU's free VRAM."""
    want = "a whole free GPU" if need is None else f"{format_bytes(need)} free"
    if k == 1:
        return f"no GPU with {want}"
    return f"only {n_ok} of {k} GPUs with {want}"


@lru_cache(maxsize=_WORDINGS_KEPT)
def _slot_reason(free: int, k: int) -> str:
    return f"all GPU replicas in use: {free} of {k} needed GPUs have a free replica"


@lru_cache(maxsize=_WORDINGS_KEPT)
def _stack_reason(policy: str, worst: int, cap: int) -> str:
    return f"device plugin ({policy}) may stack {format_bytes(worst)} on a {format_bytes(cap)} GPU"


def _fixed_reason(
    ledger: Ledger, fit: Fit, demand: Demand, kind: ReasonKind, r: int, n_match: int
) -> str:
    """The wording of an unresolvable `kind` for node row `r` (one node stands for its kind)."""
    name = fit.a.node_names[r]
    if kind is ReasonKind.NOT_A_GPU_NODE:
        inv = ledger.node(name)
        return f"not a GPU node: {inv.problem if inv is not None else 'unknown'}"
    if kind is ReasonKind.NO_SUCH_RESOURCE:
        return _no_resource(ledger, name, demand)
    if kind is ReasonKind.TOO_FEW_DEVICES:
        return f"node has {n_match} {_unit(demand)}, pod needs {demand.gpu_count}"
    return _too_small(ledger, name, demand, fit)


def _explain_shared(
    fit: Fit,
    s: SharedFit,
    demand: Demand,
    rows: np.ndarray,
    names: np.ndarray,
    n_match: np.ndarray,
    out: FilterOutcome,
    books_short: bool = False,
) -> np.ndarray:
    """Reasons owed to the device plugin's choice of GPU (extender.stock_plugin) for the failing
    nodes `rows`, in vector form; returns the rows it gave none (they fail on memory).

    A node whose matching devices the pod can only use with a pin it does not take is
    unresolvable; a node where enough devices have the memory but the plugin's node-level bound
    refuses some is named with the lowest worst case among those (the first such device).
    `books_short`: none of `rows` has enough such devices, so only the first case can hold, and
    it depends on labels alone: the used columns are not read (they may be stale in `fit.a`).
    `s` is `fit.shared`."""
    a = fit.a
    k = demand.gpu_count
    pin_missing = (n_match[rows] > 0) & (_pinnable(fit, s, demand)[rows] < k)
    if books_short:
        stacked = np.zeros(len(rows), bool)
    else:
        local = (
            fit.matches
            & (a.used_replicas < a.replicas)
            & (a.capacity - a.used >= fit.need)
            & (a.per_pod_cap >= fit.need)
        )
        blocked = local & ~s.allowed
        stacked = ~pin_missing & (per_node(a, local)[rows] >= k) & (per_node(a, blocked)[rows] > 0)
    if pin_missing.any():
        mutable_unresolvable(out).update(
            dict.fromkeys(names[rows[pin_missing]].tolist(), PIN_MISSING)
        )
    if stacked.any():
        keep = np.zeros(len(a.node_names), bool)
        keep[rows[stacked]] = True
        dev = np.flatnonzero(blocked)
        dev = dev[keep[a.node_of[dev]]]
        dev = dev[
            np.lexsort((dev, s.worst[dev], a.node_of[dev]))
        ]  # per node: lowest worst case, then row
        first = dev[run_starts(a.node_of[dev])]
        out.failed.update(
            zip(
                names[a.node_of[first]].tolist(),
                stack_reasons(s.policy, s.worst[first], a.capacity[first]),
            )
        )
    left: np.ndarray = rows[~pin_missing & ~stacked]
    return left


def _pinnable(fit: Fit, s: SharedFit, demand: Demand) -> np.ndarray:
    """Per node of `fit.a`, its devices of the demand's resource and products that do not need a
    pin the pod cannot take: labels, policy and the pod's pin ability only, so kept with the
    arrays per demand shape (per node counts over every node, read at the asked rows: cheaper
    than masking the rest)."""
    cache = cache_of(fit.a).pinnable.room()
    key = (demand.resource, demand.allowed_products, demand.pin_configmap, s.policy)
    hit = cache.get(key)
    if hit is None:
        hit = cache[key] = per_node(fit.a, fit.matches & ~s.needs_pin)
    return hit


def _unit(demand: Demand) -> str:
    return f"{demand.mig_profile} slices" if demand.mig_profile else "GPUs"


def _no_resource(ledger: Ledger, name: str, demand: Demand) -> str:
    """One text per resource, not naming what the node offers instead: kube-scheduler counts
    identical reasons (\"0/5000 nodes are available: 2856 node has no nvidia.com/gpu, ...\"), and
    a list of the node's own resources split that count into one group per kind of node (it
    was also two thirds of the bytes of a 5,000-node filter answer)."""
    inv = ledger.node(name)
    if (
        demand.allowed_products is not None
        and inv is not None
        and any(d.resource == demand.resource for d in inv.devices)
    ):
        return f"GPU product {inv.product} not in the pod's allowed products"
    return f"node has no {demand.resource}"


def _too_small(ledger: Ledger, name: str, demand: Demand, fit: Fit) -> str:
    inv = ledger.node(name)
    need = demand.bytes_per_gpu or 0
    devices = [d for d in (inv.devices if inv else ()) if d.resource == demand.resource]
    cap = max((d.per_pod_cap_bytes for d in devices), default=0)
    if demand.mig_profile is not None and inv is not None:
        fitting = sorted(
            {
                (d.memory_bytes, d.profile)
                for d in inv.devices
                if isinstance(d, MigSlice) and d.memory_bytes >= need
            }
        )
        hint = (
            f"; smallest profile on node that fits: {fitting[0][1]}"
            if fitting
            else "; no profile on this node fits"
        )
        return f"model needs {format_bytes(need)} but {demand.mig_profile} has {format_bytes(cap)}{hint}"
    if devices and devices[0].sharing.value == "mps":
        return f"need {format_bytes(need)} per GPU, MPS caps each replica at {format_bytes(cap)}"
    return f"need {format_bytes(need)} per GPU, GPUs have {format_bytes(cap)}"
