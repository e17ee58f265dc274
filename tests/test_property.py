"""Property: no sequence of filter / prioritize / bind / delete ever puts a GPU over its VRAM; the
node prioritize scores 10 strands no more memory than any other node the pod fits, and bind's
devices there strand exactly that much."""

import asyncio

from builders import cluster, gpu_node, mig_mixed_node, mig_single_node, pod, service
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from test_hot_path_stranding import least_stranded, stranded_now

from extender.demand import pod_demand
from extender.ledger import check_invariant
from extender.quantity import MIB
from extender.wire import ExtenderArgs, ExtenderBindingArgs

NODES = ["ts", "mps", "excl", "mig", "ts2", "t4", "migs"]
RESOURCES = ["nvidia.com/gpu"] * 4 + ["nvidia.com/mig-1g.10gb", "nvidia.com/mig-3g.40gb"]
memories = st.one_of(
    st.none(),
    st.integers(1, 90).map(lambda g: f"{g}Gi"),
    st.integers(500, 90000).map(lambda m: f"{m}Mi"),
)


class Scheduling(RuleBasedStateMachine):
    @initialize()
    def setup(self):
        self.cluster = cluster(
            gpu_node("ts", count=2, replicas=4),
            gpu_node("mps", count=2, replicas=3, strategy="mps"),
            gpu_node("excl", count=2, memory_mib=40960),
            mig_mixed_node("mig", {"1g.10gb": (2, 9984), "3g.40gb": (1, 40192)}),
            gpu_node("ts2", count=2, replicas=2),  # last replicas come soon
            gpu_node("t4", count=2, memory_mib=15360, product="Tesla-T4"),
            mig_single_node("migs", "1g.10gb", slices=3, memory_mib=9984),
        )
        self.svc = service(self.cluster)
        self.n = 0
        self.bound: dict[str, str] = {}

    @rule(
        memory=memories,
        gpus=st.integers(1, 3),
        resource=st.sampled_from(RESOURCES),
        prio=st.integers(0, 3),
        pick=st.integers(0, 10),
        wrong=st.booleans(),
    )
    def schedule(self, memory, gpus, resource, prio, pick, wrong):
        self.n += 1
        p = pod(
            f"p{self.n}",
            memory,
            gpus=1 if "mig" in resource else gpus,
            resource=resource,
            priority=prio,
        )
        self.svc.explain_all = True
        full = self.svc.filter(ExtenderArgs(Pod=p, NodeNames=NODES))
        self.svc.explain_all = False  # the default: reasons only when no node passes
        out = self.svc.filter(ExtenderArgs(Pod=p, NodeNames=NODES))
        if out.Error:
            assert full.Error == out.Error
            return
        assert set(full.NodeNames) | set(full.FailedNodes) | set(
            full.FailedAndUnresolvableNodes
        ) == set(NODES)
        assert out.NodeNames == full.NodeNames
        if out.NodeNames:
            assert out.FailedNodes == out.FailedAndUnresolvableNodes == {}
        else:
            assert (out.FailedNodes, out.FailedAndUnresolvableNodes) == (
                full.FailedNodes,
                full.FailedAndUnresolvableNodes,
            )
        scores = self.svc.prioritize(ExtenderArgs(Pod=p, NodeNames=out.NodeNames))
        assert all(0 <= h.Score <= 10 for h in scores)
        if out.NodeNames and p["spec"]["containers"][0]["resources"]["limits"]:
            # one node stands out (filter passed it, so the pod fits there): kube-scheduler has no tie to break
            assert len({h.Host for h in scores if h.Score == 10}) == 1, scores
        top = [h.Host for h in scores if h.Score == 10]
        lost = None
        if top:  # it strands no more than any node the pod fits (to the MiB the scores count)
            demand = pod_demand(p)
            ledger = self.cluster.ledger
            lost = least_stranded(ledger, demand, top[0])
            least = min(least_stranded(ledger, demand, n) for n in out.NodeNames)
            assert -(-lost // MIB) == -(-least // MIB), (top, lost, least)
        if wrong:  # a bind kube-scheduler would not send: to a node that did not pass filter
            target = NODES[pick % len(NODES)]
        elif out.NodeNames:
            target = max(scores, key=lambda h: h.Score).Host
        else:
            return
        args = ExtenderBindingArgs(
            PodName=p["metadata"]["name"],
            PodNamespace="default",
            PodUID=p["metadata"]["uid"],
            Node=target,
        )
        before = stranded_now(self.cluster.ledger)
        result = asyncio.run(self.svc.bind(args))
        if not result.Error:
            self.bound[f"default/{p['metadata']['name']}"] = target
            if target in top and lost is not None:  # bind's devices strand what prioritize counted
                assert stranded_now(self.cluster.ledger) - before == lost
        elif not wrong:
            raise AssertionError(f"bind to a filtered node failed: {result.Error}")

    @rule(i=st.integers(0, 1000))
    def delete(self, i):
        if self.bound:
            key = sorted(self.bound)[i % len(self.bound)]
            self.cluster.delete_pod(key)
            del self.bound[key]

    @rule(i=st.integers(0, 1000))
    def finish(self, i):
        if self.bound:
            key = sorted(self.bound)[i % len(self.bound)]
            p = self.cluster.pod(key)
            self.cluster.upsert_pod(dict(p, status={"phase": "Succeeded"}))
            del self.bound[key]

    @invariant()
    def never_oversubscribed(self):
        assert check_invariant(self.cluster.ledger, self.cluster.live_pod_keys()) == []
        held = {r.key for r in self.cluster.ledger.reservations()}
        gpu_pods = {k for k in self.bound if self.cluster.ledger.reservation(k) is not None}
        assert gpu_pods <= held


TestScheduling = Scheduling.TestCase
TestScheduling.settings = settings(
    max_examples=60,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
