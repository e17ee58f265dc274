"""What live repacking reads before it checks default topology spread: the Services and the
controllers that the scheduler profile's default constraints select by (`spread_defaults`).

Read only when the profile has `DoNotSchedule` default constraints and a pod a plan sends
somewhere states no constraint of its own: one LIST of Services per namespace of such pods, and
one of each kind of controller (ReplicationController, ReplicaSet, StatefulSet) that controls one,
each at most once per repack attempt however many plans it makes (`read`). A list the API does
not answer (no RBAC, a timeout) refuses the plan: vramsched does not move a pod where it cannot
tell which of its neighbours kube-scheduler counts.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any

from extender.live.api_client import ApiError, KubeApi
from extender.object_fields import namespace
from extender.spread_defaults import SPREAD_LISTS, SpreadDefaults, controller_ref, wants_defaults

__all__ = ["read_spread_defaults"]


async def read_spread_defaults(
    api: KubeApi,
    call: Callable[..., Awaitable[Any]],
    constraints: tuple[Mapping[str, Any], ...],
    sent: Iterable[Mapping[str, Any]],
    read: dict[tuple[str, str], list[Mapping[str, Any]]] | None = None,
) -> tuple[SpreadDefaults | None, str | None]:
    """(the defaults with what their selectors need, None), (None, None) when no pod `sent`
    gets a default constraint, or (None, why) when a list could not be read. `call` runs a
    blocking `api` method off the event loop; `read` keeps the lists made, by kind and
    namespace, for the attempt's next plans."""
    read = {} if read is None else read
    wanting = [p for p in sent if wants_defaults(p)]
    if not constraints or not wanting:
        return None, None
    lists = {("Service", ns) for ns in map(namespace, wanting)}
    lists |= {(ref[0], ref[1]) for p in wanting if (ref := controller_ref(p))}
    objects: list[Mapping[str, Any]] = []
    for kind, ns in sorted(lists):
        if (kind, ns) not in read:
            plural = SPREAD_LISTS[kind]
            try:
                found = await call(api.list_in, plural, ns)
            except ApiError as exc:
                why = exc.reason or str(exc.status)
                return None, (
                    f"the {plural} of namespace {ns} that its default topology spread selects "
                    f"by could not be read ({why})"
                )
            read[kind, ns] = [{**o, "kind": kind} for o in found]
        objects += read[kind, ns]
    return SpreadDefaults.from_objects(constraints, objects), None
