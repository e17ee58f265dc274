"""`vramsched serve --plan-ahead` behind a real kube-scheduler (etcd + kube-apiserver 1.36).

The unit tests (tests/test_plan_ahead.py) drive filter, prioritize and bind by hand; here
kube-scheduler does, placing each pod within milliseconds of its creation, the case planning
ahead is for. Nodes are fake (labels + status, no kubelet); the running pods are created bound,
with the assignment annotation vramsched would have written.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from controlplane import ControlPlane
from test_extender_e2e import (  # noqa: F401 - fixtures are used by name
    NS,
    Extender,
    add_node,
    assert_sound,
    core,
    extender_args,
    gpu_pod,
    probe_scores,
    stack,
    wait_bound,
)

from extender.inventory import ReplicaPolicy

GIB = 1024**3


def _running(name: str, node: str, gib: int) -> dict[str, Any]:
    """A pod already bound to `node`, holding `gib` GiB of its only GPU."""
    p = gpu_pod(name, f"{gib}Gi")
    p["spec"]["nodeName"] = node
    p["metadata"]["annotations"]["vramsched.io/assignment"] = json.dumps(
        {"node": node, "devices": ["0"], "bytesPerDevice": [gib * GIB]}
    )
    return p


def _planner(ext: Extender) -> dict[str, Any]:
    return (ext.get("/state") or {}).get("planner") or {}


@pytest.mark.e2e
@pytest.mark.k8s("1.36", reason="the extender's own rule; the protocol is covered on every version")
@pytest.mark.parametrize("extender_args", [["--plan-ahead", "1"]])
def test_pods_placed_at_once_get_the_planner_rule_not_best_fit(
    stack: tuple[ControlPlane, Extender], extender_args: list[str]
) -> None:
    """Three one-GPU 80 GiB nodes, time-sliced: pa-a holds 40 GiB, pa-b 20 GiB, pa-c two 40 GiB
    pods. Best fit puts a 20 GiB pod on pa-a (20 GiB left); the planner's rule, weighing by the
    cluster's mix (mostly 40 GiB pods), keeps pa-a's 40 GiB for one of those and takes pa-b. With
    `--plan-ahead 1` only the 40 GiB type gets entries: the 20 GiB pod gets the rule inline, the
    40 GiB pod after it an entry. Without the flag both would get best fit: the 20 GiB pod pa-a,
    and the 40 GiB pod then pa-b. A prioritize for the 20 GiB pod before it exists (kube-scheduler
    can be faster than the extender's pod watch) gets the rule's node too."""
    cp, ext = stack
    for n in ("pa-a", "pa-b", "pa-c"):
        add_node(cp, n, "NVIDIA-A100-SXM4-80GB", count=1, memory_mib=81920, replicas=4)
    api = core(cp)
    for name, node, gib in (("r40", "pa-a", 40), ("r20", "pa-b", 20)):
        api.create_namespaced_pod(NS, _running(name, node, gib))
    for name in ("c1", "c2"):
        api.create_namespaced_pod(NS, _running(name, "pa-c", 40))

    def planned_with_every_pod() -> bool:
        # the inline rule weighs by the last round's mix: one made before the extender saw c1
        # and c2 would weigh the two sizes alike
        state = ext.get("/state") or {}
        ahead = state.get("planner") or {}
        return (
            state.get("allocatedBytes") == 140 * GIB
            and ahead.get("aheadTypes") == 1
            and ahead.get("aheadCurrent") is True
        )

    cp.wait_for(
        planned_with_every_pod,
        timeout=30,
        message="a round of planning ahead for the 40 GiB pods, with all four pods seen",
    )
    # kube-scheduler asking about a pod before the extender's watch delivered it: the rule
    # plans from the pod the request carries, as it does once the pod is pending
    early = probe_scores(ext, "p20", "20Gi", ["pa-a", "pa-b"])
    assert early["pa-b"] == 10 and early["pa-a"] < 10  # best fit would give pa-a the 10

    api.create_namespaced_pod(NS, gpu_pod("p20", "20Gi"))
    assert wait_bound(cp, api, ["p20"])["p20"] == "pa-b"
    state = _planner(ext)
    assert state["aheadInline"] >= 1 and state["aheadHits"] == 0
    # the 40 GiB type's entry is pa-a (an exact fit) from the round before p20, or pa-a or pa-b
    # (40 GiB left on each) from one after: valid either way
    api.create_namespaced_pod(NS, gpu_pod("n40", "40Gi"))
    assert wait_bound(cp, api, ["n40"])["n40"] in {"pa-a", "pa-b"}  # each has exactly 40 GiB
    assert _planner(ext)["aheadHits"] == 1
    state_after = assert_sound(api, ReplicaPolicy.DISTRIBUTED)
    assert state_after.ledger.keys_on("pa-c") == {"default/c1", "default/c2"}
