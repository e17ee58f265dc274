"""What live repacking reads of storage before it moves pods: claims, their volumes and, for CSI
attach limits, the CSINodes, VolumeAttachments and StorageClasses. GETs and LISTs made per repack
attempt rather than watched: only pods that may move (the lists only when one of them has CSI
volumes), and the pods on the nodes a plan sends such pods to, need them, and a feature that is
off by default should not hold every claim in memory.

Whatever the API does not answer for (no RBAC, a timeout) stays unread in the `Storage` returned,
and the rules that need it refuse (`volume_rules`, `attach_limits`): vramsched does not move a pod
where it cannot tell whether its volumes follow.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from dataclasses import replace
from typing import Any

from extender.attach_limits import needs_counting
from extender.demand import TERMINAL_PHASES
from extender.live.api_client import ApiError, KubeApi
from extender.object_fields import field, spec
from extender.volume_rules import (
    ATTACH_LISTS,
    CAPACITY_LISTS,
    Storage,
    claim_keys,
    pod_claims,
)

__all__ = ["StorageReads"]

log = logging.getLogger(__name__)


class StorageReads:
    """The reads, through `call` (which runs a blocking `api` method off the event loop)."""

    def __init__(self, api: KubeApi, call: Callable[..., Awaitable[Any]]) -> None:
        self.api = api
        self.call = call

    async def for_pods(
        self, pods: Mapping[str, Mapping[str, Any]], wanted: Collection[str], blocked: str
    ) -> tuple[Storage, dict[str, str]]:
        """The claims and volumes of the pods `wanted` (a GET each; most pods have none) and, when
        one of them has volumes attach limits would count (`attach_limits.needs_counting`), the
        three lists those need (a LIST each); and those pods but `blocked` whose claims, volumes
        or lists could not be read, with why: they stay where they are."""
        claims: dict[str, Mapping[str, Any] | None] = {}
        volumes: dict[str, Mapping[str, Any] | None] = {}
        #: claim key -> why it could not be read
        unread: dict[str, str] = {}
        kept: dict[str, str] = {}
        for key in wanted:
            for claim_key in claim_keys(pods.get(key) or {}):
                if (
                    claim_key.partition("/")[2]
                    and claim_key not in claims
                    and claim_key not in unread
                ):
                    why = await self.claim(claim_key, claims, volumes)
                    if why is not None:
                        unread[claim_key] = why
                if claim_key in unread and key != blocked:
                    kept.setdefault(key, unread[claim_key])
        storage = Storage(claims, volumes)
        binding = [k for k in wanted if _binds_where_placed(pods.get(k) or {}, storage)]
        if binding:
            storage, why = await self._volumes(storage)
            if why is not None:
                for key in binding:
                    if key != blocked:
                        kept.setdefault(key, why)
        counted = [k for k in wanted if k not in kept and needs_counting([pods[k]], storage)]
        if not counted:
            return storage, kept
        storage, why = await self._lists(storage)
        if why is not None:
            for key in counted:
                if key != blocked:
                    kept[key] = f"its volumes cannot be counted against attach limits: {why}"
        return storage, kept

    async def for_targets(
        self,
        storage: Storage,
        pods: Mapping[str, Mapping[str, Any]],
        sent: Sequence[tuple[Mapping[str, Any], str]],
        leaving: Collection[str],
    ) -> Storage:
        """`storage` with the claims of the pods staying on the nodes of `sent` (pod, node) where
        a pod sent has volumes to count (`attach_limits.needs_counting`): what counting attach
        limits there needs beside the lists `for_pods` read."""
        targets = {node for pod, node in sent if needs_counting([pod], storage)}
        if not targets:
            return storage
        claims, volumes = dict(storage.claims), dict(storage.volumes)
        for key, pod in pods.items():
            if (
                key in leaving
                or spec(pod).get("nodeName") not in targets
                or field(pod, "status", "phase") in TERMINAL_PHASES
            ):
                continue
            for claim_key, _ in pod_claims(pod):
                if claim_key.partition("/")[2] and claim_key not in claims:
                    await self.claim(claim_key, claims, volumes)  # unread: the check refuses
        return replace(storage, claims=claims, volumes=volumes)

    async def _volumes(self, storage: Storage) -> tuple[Storage, str | None]:
        """`storage` with every PersistentVolume (the volumes a claim that names none yet may be
        bound to), and why they could not be listed; and with the CSIDrivers and
        CSIStorageCapacities (whether a provisioner has room), None where they could not be (a
        claim whose provisioner needs them then refuses)."""
        read, why = await self._listed({"PersistentVolume": "persistentvolumes"})
        if why is not None:
            return storage, f"its claims' volumes cannot be chosen: {why}"
        room, _ = await self._listed(CAPACITY_LISTS)
        return replace(
            storage,
            volumes={**storage.volumes, **read.volumes},
            volumes_listed=True,
            drivers=room.drivers,
            capacities=room.capacities,
        ), None

    async def _lists(self, storage: Storage) -> tuple[Storage, str | None]:
        """`storage` with the CSINodes, VolumeAttachments and StorageClasses, and why one of them
        could not be listed (it stays None, so the check refuses what it would count)."""
        read, why = await self._listed(ATTACH_LISTS)
        return replace(
            storage, csinodes=read.csinodes, attachments=read.attachments, classes=read.classes
        ), why

    async def _listed(self, lists: Mapping[str, str]) -> tuple[Storage, str | None]:
        """The kinds of `lists` (kind -> plural) as a `Storage`, a kind that could not be listed
        left unread, and why the first of those could not be."""
        objects: list[Mapping[str, Any]] = []
        listed = []
        why = None
        for kind, plural in lists.items():
            try:
                found, _ = await self.call(self.api.list, plural)
            except ApiError as exc:
                log.info(
                    "repack could not list", extra={"fields": {"what": plural, "why": str(exc)}}
                )
                why = why or f"the {plural} could not be listed ({exc.status} {exc.reason})"
                continue
            listed.append(kind)
            # a list's items carry no kind of their own
            objects += [{**o, "kind": kind} for o in found if isinstance(o, Mapping)]
        return Storage.from_objects(objects, listed), why

    async def claim(
        self,
        claim_key: str,
        claims: dict[str, Mapping[str, Any] | None],
        volumes: dict[str, Mapping[str, Any] | None],
    ) -> str | None:
        """Read a claim into `claims` and its volume into `volumes`; why one could not be."""
        namespace, _, called = claim_key.partition("/")
        why, claim = await self.read(self.api.read_claim, namespace, called)
        if why is not None:
            return f"its claim {claim_key} could not be read ({why})"
        claims[claim_key] = claim
        volume = str(spec(claim).get("volumeName") or "") if claim else ""
        if volume and volume not in volumes:
            why, found = await self.read(self.api.read_volume, volume)
            if why is not None:
                return f"volume {volume} of its claim {claim_key} could not be read ({why})"
            volumes[volume] = found
        return None

    async def read(
        self, fn: Callable[..., Any], *args: Any
    ) -> tuple[str | None, Mapping[str, Any] | None]:
        """(None, the object or None if it does not exist), or (why it could not be read, None)."""
        try:
            got = await self.call(fn, *args)
        except ApiError as exc:
            if exc.status == 404:
                return None, None
            log.info("repack could not read", extra={"fields": {"what": args, "why": str(exc)}})
            return f"{exc.status} {exc.reason}".strip(), None
        return (None, got) if isinstance(got, Mapping) else ("not an object", None)


def _binds_where_placed(pod: Mapping[str, Any], storage: Storage) -> bool:
    """Whether a claim of the pod may be bound only once it is placed: one read that names no
    volume yet, or the new one an ephemeral volume makes."""
    for key, template in pod_claims(pod):
        if template is not None:
            return True
        _, claim = storage.claim(key)
        if claim is not None and not spec(claim).get("volumeName"):
            return True
    return False
