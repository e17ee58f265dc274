"""Room kept for pods kube-scheduler nominated to a node after preempting for them.

When kube-scheduler preempts for a pod, it sets the pod's `status.nominatedNodeName` and, until the
pod is bound, counts it on that node whenever its own filters judge a pod of lower or equal
priority (the framework's `addNominatedPods`). Extenders are not told, so without this a pod of
lower priority could take the VRAM the victims freed, and the nominated pod would preempt again.
Here the nominated pods are placed, for the length of one check, on the node's devices as bind
would place them, and the pod asking must fit beside them. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from extender.demand import Demand
from extender.ledger import Ledger, LedgerError, Reservation
from extender.placement.choose import choose_devices
from extender.placement.filter import filter_nodes

__all__ = ["held_for_nominated"]


def held_for_nominated(
    ledger: Ledger, demand: Demand, nominated: Mapping[str, Sequence[Demand]]
) -> dict[str, str]:
    """Of the nodes of `nominated` (node -> the demands of the pods nominated there; the caller
    passes the nodes that otherwise fit `demand`), those where these pods would leave no room for
    `demand`: node -> reason. Only nominated pods of at least `demand`'s priority count, as in
    kube-scheduler, and not `demand`'s own pod nor one that already holds GPUs (its bind is under
    way). The ledger is changed only during the call."""
    out: dict[str, str] = {}
    for node, pods in nominated.items():
        ahead = [
            d
            for d in pods
            if d.pod.key != demand.pod.key
            and d.wants_gpu
            and d.priority >= demand.priority
            and ledger.reservation(d.pod.key) is None
        ]
        if not ahead:
            continue
        held: list[Reservation] = []
        try:
            for d in sorted(ahead, key=lambda d: (-d.priority, d.pod.key)):
                res = choose_devices(ledger, d, node)
                if isinstance(res, str):
                    continue  # it no longer fits there itself: nothing to keep for it
                try:
                    held.append(ledger.reserve(res))
                except LedgerError:
                    continue
            if held and not filter_nodes(ledger, demand, [node]).feasible:
                names = ", ".join(r.key for r in held)
                out[node] = f"GPU memory here is kept for {names}, nominated by preemption"
        finally:
            for r in held:
                ledger.release(r.key)
    return out
