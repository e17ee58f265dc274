"""One demand against the ledger's devices: which match, how much each needs, which can take
the pod now, and the device plugin's node-level bound when a replica policy is set."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from extender.arrays import DeviceArrays, NodeSummary
from extender.demand import Demand
from extender.ledger import Ledger
from extender.placement.cache import StaticFit, cache_of
from extender.placement.views import node_arrays, uniform_labels
from extender.stock_plugin import BoundView, SharedFit, bound_view, bounds_resource, shared_fit


@dataclass(slots=True)
class Fit:
    """Per-device view of one demand against the ledger (vectors over all devices)."""

    a: DeviceArrays
    matches: np.ndarray  # device has the requested resource (and allowed product)
    need: np.ndarray  # bytes the pod needs on each device
    ok: np.ndarray  # device can take the pod now
    #: node-level bound for time-sliced GPUs whose physical GPU the device plugin picks
    shared: SharedFit | None = None

    @property
    def leftover(self) -> np.ndarray:
        left: np.ndarray = self.a.capacity - self.a.used - self.need
        return left


def device_need(a: DeviceArrays, demand: Demand) -> np.ndarray:
    """Bytes the pod takes on each device: what it declared, or the whole device when undeclared.

    A whole device is its per-pod cap: the full memory of an exclusive or time-sliced GPU
    (so it only fits an empty one), a 1/replicas share of an MPS GPU, a whole MIG slice.
    """
    if demand.bytes_per_gpu is None:
        return a.per_pod_cap
    # one value for every device, read-only: kept per demand shape (`static_fit`), a full
    # column per shape was 640 KB at 80,000 devices, 160 MB of RSS for the 256 shapes kept
    return np.broadcast_to(np.int64(demand.bytes_per_gpu), (len(a.capacity),))


def demand_fit(
    ledger: Ledger,
    demand: Demand,
    local: DeviceArrays | None = None,
    with_ok: bool = True,
    node_rows: slice | np.ndarray | None = None,
    bounded: bool = False,
) -> Fit:
    """The demand against every device, or against `local` (one node's rows, see `node_arrays`,
    or one resource's, see `resource_arrays`). `with_ok=False` leaves `ok` empty for callers
    that do not read it (`_filter_one`). `node_rows`: `local` is these device rows (one node's
    slice, or several nodes' rows, see `nodes_arrays`), and the device plugin's bound applies
    to them (bind, kept scores, under a replica policy). `bounded`: `local` is the resource's
    view and the bound applies to it."""
    a = ledger.arrays if local is None else local
    matches, need, big_enough = static_fit(a, demand)
    if not with_ok:
        return Fit(a, matches, need, np.zeros(0, bool), None)
    ok = big_enough & (a.used_replicas < a.replicas) & (a.capacity - a.used >= need)
    shared = None
    if demand.wants_gpu and node_rows is not None:
        shared = shared_fit(
            plugin_view(ledger), need, demand.gpu_count, demand.pin_configmap, node_rows
        )
    elif demand.wants_gpu and bounded:
        shared = bound_at_resource(ledger, demand)
    elif demand.wants_gpu and local is None:
        shared = kept_bound(ledger, demand, a, need)
    if shared is not None:
        ok &= shared.allowed
    return Fit(a, matches, need, ok, shared)


def kept_bound(
    ledger: Ledger, demand: Demand, a: DeviceArrays, need: np.ndarray, resource: int | None = None
) -> SharedFit | None:
    """`shared_fit` over every device of `a` (every device of the ledger), or at the rows of
    `resource` only, kept for the ledger state and demand shape: the same pod's prioritize
    follows its filter, usually with nothing changed in between."""
    key = (
        ledger.generation,
        demand.bytes_per_gpu,
        demand.gpu_count,
        demand.pin_configmap,
        resource,
    )
    cache = cache_of(a)
    hit = cache.bound
    if hit is None or hit[0] != key or hit[2] is not need:
        fit = shared_fit(
            plugin_view(ledger), need, demand.gpu_count, demand.pin_configmap, resource=resource
        )
        hit = cache.bound = (key, fit, need)
    return hit[1]


def plugin_view(ledger: Ledger) -> BoundView | None:
    """The device plugin's view of the ledger (what its bound needs), kept with the ledger's
    arrays and brought up to date on each use; None without a replica policy (exact books)."""
    if ledger.replica_policy is None:
        return None
    cache = cache_of(ledger.arrays)
    view = cache.plugin = bound_view(ledger, cache.plugin)
    return view


def bound_at_resource(ledger: Ledger, demand: Demand) -> SharedFit | None:
    """The bound at the rows of the demand's resource, as `resource_arrays` has them (None when it
    applies to none of them)."""
    full = ledger.arrays
    rid = full.resources.get(demand.resource)
    if rid is None or not bounds_resource(plugin_view(ledger), rid):
        return None
    return kept_bound(ledger, demand, full, shape_need(full, demand), rid)


def shape_need(a: DeviceArrays, demand: Demand) -> np.ndarray:
    """`device_need` kept per demand shape (the same object for the same shape, as `kept_bound`'s
    cache compares it by identity): `static_fit` takes it from here, and the bound reads it
    without `static_fit`'s two other columns, which over every device of the cluster, on a shape
    asked for the first time, cost more than the bound itself."""
    cache = cache_of(a).need.room()
    hit = cache.get(demand.bytes_per_gpu)
    if hit is None:
        hit = cache[demand.bytes_per_gpu] = device_need(a, demand)
    return hit


def static_fit(a: DeviceArrays, demand: Demand) -> StaticFit:
    """(devices of the resource and products, bytes needed on each, those big enough for it):
    labels and demand only, so kept with `a` per demand shape. Callers never write them."""
    cache = cache_of(a).static_fit.room()
    key = (demand.resource, demand.bytes_per_gpu, demand.allowed_products)
    hit = cache.get(key)
    if hit is None:
        matches = a.resource_id == a.resources.get(demand.resource, -1)
        if demand.allowed_products is not None:
            allowed = [
                pid
                for name, pid in a.products.items()
                if product_allowed(name, demand.allowed_products)
            ]
            matches &= np.isin(a.product_id, np.asarray(allowed, np.int32))
        need = shape_need(a, demand)
        hit = cache[key] = (matches, need, matches & (a.per_pod_cap >= need))
    return hit


def product_allowed(product: str, allowed: frozenset[str]) -> bool:
    """`NVIDIA-H100-80GB-HBM3-SHARED` is still an `NVIDIA-H100-80GB-HBM3`."""
    base = product[: -len("-SHARED")] if product.endswith("-SHARED") else product
    return base in allowed or product in allowed


def node_ok(a: DeviceArrays, demand: Demand) -> tuple[np.ndarray, np.ndarray] | None:
    """Per node of `a`: its devices are big enough and of an allowed product (all or none of
    them, see `uniform_labels`), and the bytes the pod needs on each. Labels only: cached per demand."""
    uniform = uniform_labels(a)
    if uniform is None:
        return None
    cache = cache_of(a).node_ok.room()
    key = (demand.bytes_per_gpu, demand.allowed_products)
    hit = cache.get(key)
    if hit is None:
        cap, prod = uniform
        if demand.bytes_per_gpu is None:  # a whole device: its per-pod cap, which it always has
            need, ok = cap, cap >= 0
        else:
            need = np.full(len(cap), demand.bytes_per_gpu, np.int64)
            ok = cap >= demand.bytes_per_gpu
        if demand.allowed_products is not None:
            allowed = [
                pid
                for name, pid in a.products.items()
                if product_allowed(name, demand.allowed_products)
            ]
            ok &= np.isin(prod, np.asarray(allowed, np.int64))
        hit = cache[key] = (ok, need)
    return hit


def one_largest(ledger: Ledger, a: DeviceArrays, demand: Demand) -> np.ndarray | None:
    """What `_filter_one` computes per device, from the ledger's per-node summary instead: per
    node of the resource view `a`, the most free VRAM on a big-enough allowed device with a free
    replica (-1 when none). None when the summary cannot stand for the devices (`uniform_labels`)."""
    hit = node_ok(a, demand)
    if hit is None:
        return None
    return np.where(hit[0], ledger.slot_free(int(a.resource_id[0])), -1)


def node_fit(
    ledger: Ledger, a: DeviceArrays, demand: Demand
) -> tuple[np.ndarray, np.ndarray, NodeSummary] | None:
    """(node ok, bytes needed per node, the ledger's summary) for `_filter_summary`, or None."""
    hit = node_ok(a, demand)
    if hit is None:
        return None
    return hit[0], hit[1], ledger.summary(int(a.resource_id[0]))


def fit_on_node(ledger: Ledger, demand: Demand, r: int) -> Fit:
    """The demand against node row `r`'s devices only, with the device plugin's bound on them
    when a replica policy is set: bind's cost does not grow with the cluster."""
    a = ledger.arrays
    rows = slice(int(a.node_start[r]), int(a.node_start[r + 1]))
    return demand_fit(
        ledger,
        demand,
        node_arrays(a, r),
        node_rows=rows if ledger.replica_policy else None,
    )
