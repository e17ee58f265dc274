"""What live repacking reads before it checks default topology spread: the Services and the
controllers that the scheduler profile's default constraints select by (`spread_defaults`).

Read per plan, and only when the profile has `DoNotSchedule` default constraints and a pod the
plan sends somewhere states no constraint of its own: one LIST of Services per namespace of such
pods, and one of each kind of controller (ReplicationController, ReplicaSet, StatefulSet) that
controls one. A list the API does not answer (no RBAC, a timeout) refuses the plan: vramsched
does not move a pod where it cannot tell which of its neighbours kube-scheduler counts.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any

from extender.live.api_client import ApiError, KubeApi
from extender.object_fields import name, namespace
from extender.spread_defaults import SpreadDefaults, controller_ref, wants_defaults

__all__ = ["read_spread_defaults"]

#: controller kind -> the list `KubeApi.list_in` reads
_LISTS = {
    "ReplicationController": "replicationcontrollers",
    "ReplicaSet": "replicasets",
    "StatefulSet": "statefulsets",
}


async def read_spread_defaults(
    api: KubeApi,
    call: Callable[..., Awaitable[Any]],
    constraints: tuple[Mapping[str, Any], ...],
    sent: Iterable[Mapping[str, Any]],
) -> tuple[SpreadDefaults | None, str | None]:
    """(the defaults with what their selectors need, None), (None, None) when no pod `sent`
    gets a default constraint, or (None, why) when a list could not be read. `call` runs a
    blocking `api` method off the event loop."""
    wanting = [p for p in sent if wants_defaults(p)]
    if not constraints or not wanting:
        return None, None
    services: list[Mapping[str, Any]] = []
    controllers: dict[tuple[str, str, str], Mapping[str, Any]] = {}
    lists = {("services", ns) for ns in map(namespace, wanting)}
    lists |= {(_LISTS[ref[0]], ref[1]) for p in wanting if (ref := controller_ref(p))}
    kinds = {v: k for k, v in _LISTS.items()}
    for kind, ns in sorted(lists):
        try:
            found = await call(api.list_in, kind, ns)
        except ApiError as exc:
            why = exc.reason or str(exc.status)
            return None, (
                f"the {kind} of namespace {ns} that its default topology spread selects by could "
                f"not be read ({why})"
            )
        if kind == "services":
            services += found
        else:
            controllers.update({(kinds[kind], ns, name(o)): o for o in found})
    return SpreadDefaults(constraints, services, controllers), None
