"""Live mode's `Binder`: the assignment annotations, the pin ConfigMap, then the Binding.

Both pod writes carry the version bind booked as a precondition, so an edit of the pod's
`model-memory` landing after bind read it fails them rather than binding a pod its booking
no longer covers.

The API calls run in a thread pool; the reservation was already taken synchronously by the
service before the first await. After a bind it hands one `VramschedAssigned` Event to the
`EventRecorder`, which posts it later: an event never delays or fails a bind.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from extender.assignment import encode_assignment
from extender.bind_event import bind_event, bind_message
from extender.cluster import ClusterState
from extender.demand import (
    ASSIGNMENT,
    GPU_INDEX,
    PIN_ENV,
    DemandError,
    asks_same_gpus,
    pod_demand,
    pod_ref,
    reads_pin_annotation,
)
from extender.ledger import Reservation
from extender.live.api_client import ApiError, KubeApi, annotation_patch
from extender.live.events import EventRecorder
from extender.object_fields import mapping, meta, spec, uid_of, version_of
from extender.pinning import pin_configmap_name, pin_environment, references_pin_configmap
from extender.quantity import format_bytes
from extender.service import BindError
from extender.sizing.handoff import FRACTION_ANNOTATION, bind_fraction
from extender.stock_plugin import is_time_sliced

__all__ = ["BindUncertain", "KubeBinder"]

log = logging.getLogger(__name__)

#: writes of one bind retried after a 409 whose pod still asks the same GPUs (a status or
#: label update landed in between); a pod changing faster than that is refused, to retry
WRITE_ATTEMPTS = 3


class BindUncertain(BindError):
    """The Binding may or may not have landed (timeout, 5xx): keep the reservation as assumed;
    its TTL or the watch settles it, and kube-scheduler's retry finds the pod already bound."""

    keep_reservation = True


class KubeBinder:
    """Annotations first, then (optionally) the pinning ConfigMap, then the Binding.

    Annotations first, so that whoever sees the pod bound also sees which devices it holds:
    a restart rebuilds the ledger from them. Idempotent: kube-scheduler calls bind again when
    its 5 s timeout expired although the Binding landed; a 409 on the Binding is success
    when the pod is bound to the same node. No lock is held: the reservation was made by the
    service before this is awaited, and every API call runs in the thread pool.
    """

    def __init__(
        self,
        api: KubeApi,
        *,
        pinned: bool = False,
        workers: int = 8,
        cluster: ClusterState | None = None,
        events: EventRecorder | None = None,
    ) -> None:
        self.api = api
        self.cluster = cluster
        self.pinned = pinned
        self.events = events if events is not None else EventRecorder(api)
        self.instance = socket.gethostname()
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="bind")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.events.close()

    async def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run a blocking client call in the binder's pool, never on the event loop."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, fn, *args)

    def annotations(
        self, pod: Mapping[str, Any], reservation: Reservation
    ) -> dict[str, str | None]:
        """The assignment always; `gpu-index` only when the GPU choice is really enforced (pinned).

        Without pinning the device plugin, not vramsched, picks the physical GPU: the devices in
        the assignment are the ledger's accounting slots, and a GPU index would be a false claim.
        """
        out: dict[str, str | None] = dict(encode_assignment(reservation))
        if not self._pins(pod, reservation):
            out[GPU_INDEX] = None
        inv = self.cluster.ledger.node(reservation.node) if self.cluster is not None else None
        out[FRACTION_ANNOTATION] = bind_fraction(
            pod, reservation.device_ids, inv.devices if inv else ()
        )
        return out

    def _pins(self, pod: Mapping[str, Any], reservation: Reservation) -> bool:
        """The pod takes a pin (either form) and this reservation gets a real one, or vramsched's
        device plugin serves the node (the index is then the GPU the container gets)."""
        if self._plugin_served(reservation):
            return True
        env = pin_environment(reservation, self.pinned, self._time_sliced(reservation))
        return PIN_ENV in env and (references_pin_configmap(pod) or reads_pin_annotation(pod))

    def _plugin_served(self, reservation: Reservation) -> bool:
        inv = self.cluster.ledger.node(reservation.node) if self.cluster is not None else None
        ids = set(reservation.device_ids)
        held = [d for d in inv.devices if d.device_id in ids] if inv is not None else []
        return bool(held) and all(getattr(d, "plugin_served", False) for d in held)

    def _time_sliced(self, reservation: Reservation) -> bool:
        inv = self.cluster.ledger.node(reservation.node) if self.cluster is not None else None
        if inv is None:
            return False
        ids = set(reservation.device_ids)
        return any(is_time_sliced(d) for d in inv.devices if d.device_id in ids)

    async def bind(
        self, pod: Mapping[str, Any], node: str, reservation: Reservation | None
    ) -> None:
        ref = pod_ref(pod)
        started = time.monotonic()
        if (
            reservation is not None
            and reads_pin_annotation(pod)
            and not self._pins(pod, reservation)
        ):
            # Its containers would start with NVIDIA_VISIBLE_DEVICES="" (no GPU at all). Filter
            # keeps such pods off unpinnable nodes; this guards any other way in. Nothing written.
            raise BindError(
                f"pod {ref.key} reads {PIN_ENV} from annotation {GPU_INDEX}, "
                f"but its GPUs on {node} cannot be pinned; it would start without a GPU"
            )
        if reservation is None:
            await self._create_binding(pod, node, None, "")
        else:
            annotations = self.annotations(pod, reservation)
            version = await self._annotate(pod, node, annotations)
            if version is not None:  # None: an earlier attempt's Binding put it there already
                if references_pin_configmap(pod):
                    try:
                        await self._configmap(pod, reservation)
                    except BindError:
                        await self._unannotate(ref)  # as for a refused Binding: still pending
                        raise
                await self._create_binding(pod, node, annotations, version)
        if reservation is not None:
            # The API accepted the Binding: the hold is now the truth, not a guess that may lapse.
            # It stays `assumed` until the watch shows the pod, but no TTL can free it meanwhile:
            # a watch lagging or reconnecting for longer than the TTL must not double-book.
            # (A relist drops it if the pod was deleted in the meantime.)
            reservation.expires_at = None
            self._record_event(pod, reservation)
        log.info(
            "bound",
            extra={
                "fields": {
                    "pod": ref.key,
                    "node": node,
                    "devices": list(reservation.device_ids) if reservation else [],
                    "bytes": reservation.total_bytes if reservation else 0,
                    "ms": round((time.monotonic() - started) * 1000, 1),
                }
            },
        )

    def _record_event(self, pod: Mapping[str, Any], reservation: Reservation) -> None:
        """One `VramschedAssigned` Event per bind, queued: never delays or fails the bind."""
        try:
            if self.cluster is not None:
                message = bind_message(
                    self.cluster.ledger, reservation, self._pins(pod, reservation)
                )
            else:
                message = f"reserved {format_bytes(reservation.total_bytes)} on {reservation.node}"
            ref = pod_ref(pod)
            self.events.emit(ref.namespace, bind_event(ref, message, time.time(), self.instance))
        except Exception:  # the bind succeeded; an event must not turn it into a failure
            log.exception("cannot build the bind event")
            self.events.failed += 1

    async def _annotate(
        self, pod: Mapping[str, Any], node: str, annotations: Mapping[str, str | None]
    ) -> str | None:
        """Write the assignment, on the pod version bind booked (its resourceVersion as
        precondition): the resourceVersion to bind at, or None when a Binding of an earlier
        attempt already put the pod on `node` with these devices. A pod changed since is read
        again: re-annotated when it asks the same GPUs (a status or label update), refused when
        its ask changed, since the booking was sized for the version bind read."""
        ref = pod_ref(pod)
        version = version_of(pod)
        for _ in range(WRITE_ATTEMPTS):
            patch = annotation_patch(ref.uid, annotations, version)
            try:
                written = await self.call(self.api.patch_pod, ref.namespace, ref.name, patch)
                return version_of(written)
            except ApiError as exc:
                if exc.status != 409 or not version:
                    raise _definite(exc, f"cannot annotate pod {ref.key}") from None
            try:
                current = await self.call(self.api.read_pod, ref.namespace, ref.name)
            except ApiError as exc:
                raise _definite(exc, f"pod {ref.key} changed and cannot be read again") from None
            if self._bound_here(ref, current, node):
                if _annotation(current, ASSIGNMENT) == annotations.get(ASSIGNMENT):
                    return None  # a retried bind whose Binding landed: success
                raise BindError(f"pod {ref.key} is already bound to {node} on other devices")
            if problem := self._changed(pod, current):
                raise BindError(problem)
            version = version_of(current)
        raise BindError(f"pod {ref.key} kept changing while being bound; retry")

    async def _create_binding(
        self,
        pod: Mapping[str, Any],
        node: str,
        annotations: Mapping[str, str | None] | None,
        version: str,
    ) -> None:
        """The Binding, with the UID and the annotated version as preconditions, so that the pod
        bound is the pod booked. A 409 is read again: a retried bind that landed is success, a
        pod changed since the annotation is bound again if it asks the same GPUs."""
        ref = pod_ref(pod)
        for _ in range(WRITE_ATTEMPTS):
            header: dict[str, str] = {"name": ref.name, "namespace": ref.namespace}
            header.update({k: v for k, v in (("uid", ref.uid), ("resourceVersion", version)) if v})
            binding = {
                "apiVersion": "v1",
                "kind": "Binding",
                "metadata": header,
                "target": {"apiVersion": "v1", "kind": "Node", "name": node},
            }
            try:
                await self.call(self.api.create_binding, ref.namespace, ref.name, binding)
                return
            except ApiError as exc:
                if exc.status == 409:
                    retry = await self._binding_conflict(pod, node, annotations, exc)
                    if retry is None:
                        return
                    version = retry
                    continue
                if exc.transient:
                    log.warning(
                        "bind outcome unknown",
                        extra={"fields": {"pod": ref.key, "node": node, "error": str(exc)}},
                    )
                    raise BindUncertain(
                        f"Binding to {node} may not have landed ({exc.status or exc.reason}); will retry"
                    ) from None
                if annotations is not None:
                    await self._unannotate(ref)
                raise _definite(exc, f"Binding to {node} rejected") from None
        if annotations is not None:
            await self._unannotate(ref)
        raise BindError(f"pod {ref.key} kept changing while being bound; retry")

    async def _binding_conflict(
        self,
        pod: Mapping[str, Any],
        node: str,
        annotations: Mapping[str, str | None] | None,
        exc: ApiError,
    ) -> str | None:
        """After a 409 on the Binding: None when the pod is bound to `node` (a retry whose first
        Binding landed), the version to bind at when it changed but asks the same GPUs, else
        an error (unannotated when the pod changed under the booking)."""
        ref = pod_ref(pod)
        try:
            current = await self.call(self.api.read_pod, ref.namespace, ref.name)
        except ApiError as read_exc:
            raise BindUncertain(
                f"Binding conflict and pod unreadable ({read_exc.status})"
            ) from None
        if self._bound_here(ref, current, node):
            return None
        if annotations is None:  # no precondition was sent: not a change of the pod
            raise BindUncertain(
                f"Binding conflict ({exc.message or exc.reason}) but pod is not bound yet"
            )
        if meta(current).get("deletionTimestamp"):
            raise BindError(f"pod {ref.key} is being deleted")
        if problem := self._changed(pod, current):
            await self._unannotate(ref)
            raise BindError(problem)
        if _annotation(current, ASSIGNMENT) != annotations.get(ASSIGNMENT):
            raise BindError(f"pod {ref.key}: its {ASSIGNMENT} annotation was rewritten meanwhile")
        return version_of(current)

    @staticmethod
    def _bound_here(ref: Any, current: Mapping[str, Any], node: str) -> bool:
        """Whether the pod read back is bound to `node`; an error when it is another pod (created
        again under the name) or bound elsewhere."""
        now = uid_of(current)
        if ref.uid and now and now != ref.uid:
            raise BindError(f"pod {ref.key} was re-created (UID {now})")
        bound = spec(current).get("nodeName")
        if bound and bound != node:
            raise BindError(f"pod {ref.key} is already bound to {bound}")
        return bound == node

    def _changed(self, pod: Mapping[str, Any], current: Mapping[str, Any]) -> str | None:
        """Why the pod read back cannot take the booking made for `pod`, or None when it asks
        the same GPUs (same count, resource, models and memory)."""
        headroom = self.cluster.headroom if self.cluster is not None else 0.0
        key = pod_ref(pod).key
        try:
            booked = pod_demand(pod, headroom=headroom)
            now = pod_demand(current, headroom=headroom)
        except DemandError as exc:
            return f"pod {key} changed while being bound: {exc}; retry"
        if asks_same_gpus(booked, now):
            return None
        return (
            f"pod {key} changed while being bound: it was booked for {booked.describe()},"
            f" it now asks {now.describe()}; retry"
        )

    async def _configmap(self, pod: Mapping[str, Any], reservation: Reservation) -> None:
        ref = pod_ref(pod)
        name = pin_configmap_name(ref.name)
        data = pin_environment(reservation, self.pinned, self._time_sliced(reservation))
        body = {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {
                "name": name,
                "namespace": ref.namespace,
                "labels": {"app.kubernetes.io/managed-by": "vramsched"},
                # No blockOwnerDeletion: that would need update on pods/finalizers.
                "ownerReferences": [
                    {"apiVersion": "v1", "kind": "Pod", "name": ref.name, "uid": ref.uid}
                ],
            },
            "data": data,
        }
        try:
            await self.call(self.api.create_configmap, ref.namespace, body)
            return
        except ApiError as exc:
            if exc.status != 409:
                raise _definite(exc, f"cannot create ConfigMap {name}") from None
        try:
            existing = await self.call(self.api.read_configmap, ref.namespace, name)
        except ApiError as exc:
            raise _definite(exc, f"ConfigMap {name} exists but is unreadable") from None
        owners = [
            o.get("uid") for o in (existing.get("metadata") or {}).get("ownerReferences") or []
        ]
        if ref.uid not in owners:
            raise BindError(
                f"ConfigMap {name} exists and belongs to another pod (garbage collection pending?)"
            )
        old = existing.get("data") or {}
        if old == data:
            return
        # This pod's own ConfigMap from an earlier bind that did not land: a Binding refused for
        # good, or one whose outcome stayed unknown until its hold lapsed (bind holds the same
        # GPUs while it may still land). The pod is not bound, so no container read it; it must
        # now name this bind's GPUs, or the pod could never bind to others. The UID and
        # resourceVersion make it fail rather than overwrite a ConfigMap changed meanwhile.
        held = meta(existing)
        patch = {
            "metadata": {k: held[k] for k in ("uid", "resourceVersion") if held.get(k)},
            "data": {**{k: None for k in old if k not in data}, **data},
        }
        try:
            await self.call(self.api.patch_configmap, ref.namespace, name, patch)
        except ApiError as exc:
            raise _definite(exc, f"cannot update ConfigMap {name} to this bind's GPUs") from None

    async def _unannotate(self, ref: Any) -> None:
        """Best effort after a definite failure: a pending pod should not carry a stale assignment.
        With the pod's UID as precondition, as the annotation was written: a pod created again
        under the name meanwhile keeps the assignment its own bind wrote."""
        patch = annotation_patch(
            ref.uid, {ASSIGNMENT: None, GPU_INDEX: None, FRACTION_ANNOTATION: None}
        )
        try:
            await self.call(self.api.patch_pod, ref.namespace, ref.name, patch)
        except ApiError:
            pass


def _annotation(obj: Mapping[str, Any], name: str) -> Any:
    return mapping(meta(obj).get("annotations")).get(name)


def _definite(exc: ApiError, what: str) -> BindError:
    detail = exc.message or exc.reason or "no answer"
    if exc.status == 404:
        return BindError(f"{what}: pod no longer exists")
    if exc.status == 403:
        return BindError(f"{what}: forbidden by RBAC ({detail})")
    if exc.status == 0:
        return BindError(f"{what}: API server unreachable ({detail})")
    return BindError(f"{what}: {exc.status} {detail}")
