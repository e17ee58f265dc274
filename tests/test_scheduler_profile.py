"""A kube-scheduler profile's arguments that live repacking re-checks with
(`extender.scheduler_profile`), the default spread constraints they give a pod
(`extender.spread_defaults`), and what both change in `target_rules`.

The cases kube-scheduler itself decides (1.20 and 1.36) are in
tests/e2e/test_scheduler_profile_e2e.py; these pin the reading, the errors and the selector's
parts one at a time.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from extender.scheduler_profile import (
    SchedulerConfigError,
    SchedulerProfile,
    is_extended_resource,
    parse_scheduler_profile,
    scheduler_profile,
)
from extender.spread_defaults import SpreadDefaults, controller_ref
from extender.target_rules import room_problem, schedulable_on, target_problem
from extender.topology_spread import has_hard_spread, spread_problem

ZONE = {"maxSkew": 1, "topologyKey": "zone", "whenUnsatisfiable": "DoNotSchedule"}
ANYWAY = {"maxSkew": 1, "topologyKey": "host", "whenUnsatisfiable": "ScheduleAnyway"}


def _config(args: dict[str, Any], *, version: str = "v1", name: str = "vramsched") -> str:
    doc = {
        "apiVersion": f"kubescheduler.config.k8s.io/{version}",
        "kind": "KubeSchedulerConfiguration",
        "profiles": [
            {"schedulerName": "default-scheduler"},
            {
                "schedulerName": name,
                "pluginConfig": [{"name": k, "args": v} for k, v in args.items()],
            },
        ],
    }
    return yaml.safe_dump(doc)


# ----- reading the file ---------------------------------------------------------------------------


def test_the_profiles_arguments_are_read() -> None:
    text = _config(
        {
            "NodeResourcesFit": {
                "ignoredResources": ["example.com/nic"],
                "ignoredResourceGroups": ["example.org"],
            },
            "PodTopologySpread": {"defaultingType": "List", "defaultConstraints": [ZONE, ANYWAY]},
        }
    )
    profile = parse_scheduler_profile(text, "vramsched")
    assert profile.ignored_resources == {"example.com/nic"}
    assert profile.ignored_groups == {"example.org"}
    assert profile.default_spread == (ZONE,)  # ScheduleAnyway refuses no node
    # another profile of the same file is read as the defaults
    assert parse_scheduler_profile(text, "default-scheduler") == SchedulerProfile(
        name="default-scheduler"
    )


def test_the_shipped_configuration_reads_as_the_defaults() -> None:
    shipped = Path(__file__).resolve().parents[1] / "config" / "KubeSchedulerConfiguration.yaml"
    profile = parse_scheduler_profile(shipped.read_text(), "vramsched")
    assert profile == SchedulerProfile()


def test_defaulting_type_defaults_as_each_version_does() -> None:
    spread = {"PodTopologySpread": {"defaultConstraints": [ZONE]}}
    # v1beta1 (kube-scheduler 1.19-1.21): List when constraints are given
    assert parse_scheduler_profile(_config(spread, version="v1beta1"), "vramsched").default_spread
    # later versions default to System, and refuse constraints with it
    for version in ("v1beta2", "v1beta3", "v1"):
        with pytest.raises(SchedulerConfigError, match="must be empty when defaultingType is"):
            parse_scheduler_profile(_config(spread, version=version), "vramsched")
    system = {"PodTopologySpread": {"defaultingType": "System"}}
    assert parse_scheduler_profile(_config(system), "vramsched").default_spread == ()


GPU_POOL = {"matchExpressions": [{"key": "pool", "operator": "In", "values": ["gpu"]}]}


def test_the_added_node_affinity_keeps_every_pod_to_its_nodes() -> None:
    required = {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [GPU_POOL]}}
    text = _config({"NodeAffinity": {"addedAffinity": required}})
    profile = parse_scheduler_profile(text, "vramsched")
    assert profile.added_affinity == (GPU_POOL,)
    gpu = {"metadata": {"name": "g", "labels": {"pool": "gpu"}}, "spec": {}}
    cpu = {"metadata": {"name": "c", "labels": {"pool": "cpu"}}, "spec": {}}
    pod: dict[str, Any] = {"metadata": {"name": "p"}, "spec": {}}
    assert schedulable_on(pod, gpu, profile=profile) is None
    assert schedulable_on(pod, cpu) is None
    assert schedulable_on(pod, cpu, profile=profile) == (
        "node c does not match the scheduler profile's added node affinity"
    )
    # preferred terms only weigh scores
    preferred = {"preferredDuringSchedulingIgnoredDuringExecution": [{"weight": 1}]}
    text = _config({"NodeAffinity": {"addedAffinity": preferred}})
    assert parse_scheduler_profile(text, "vramsched").added_affinity == ()
    for bad in ({"requiredDuringSchedulingIgnoredDuringExecution": {}}, [1]):
        with pytest.raises(SchedulerConfigError, match="addedAffinity"):
            parse_scheduler_profile(_config({"NodeAffinity": {"addedAffinity": bad}}), "vramsched")


def test_no_profiles_is_the_default_scheduler_alone() -> None:
    doc = {"apiVersion": "kubescheduler.config.k8s.io/v1", "kind": "KubeSchedulerConfiguration"}
    assert scheduler_profile(doc, "default-scheduler") == SchedulerProfile(name="default-scheduler")
    with pytest.raises(SchedulerConfigError, match="no profile has schedulerName 'vramsched'"):
        scheduler_profile(doc, "vramsched")


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("a: [", "not YAML"),
        ("- 1", "not a YAML object"),
        ("apiVersion: v1\nkind: ConfigMap", "apiVersion 'v1' is not"),
        ("apiVersion: kubescheduler.config.k8s.io/v1\nkind: Pod", "kind 'Pod' is not"),
        (
            "apiVersion: kubescheduler.config.k8s.io/v1\nkind: KubeSchedulerConfiguration\n"
            "profiles: 3",
            "profiles must be a list",
        ),
        (_config({"NodeResourcesFit": {"ignoredResources": "x/y"}}), "ignoredResources must be"),
        (_config({"NodeResourcesFit": {"ignoredResourceGroups": [1]}}), "ignoredResourceGroups"),
        (_config({"NodeResourcesFit": ["x"]}), "NodeResourcesFit args must be an object"),
        (
            _config({"PodTopologySpread": {"defaultingType": "Some"}}),
            "defaultingType 'Some' is not List or System",
        ),
        (
            _config(
                {
                    "PodTopologySpread": {
                        "defaultingType": "List",
                        "defaultConstraints": [{**ZONE, "maxSkew": 0}],
                    }
                }
            ),
            r"defaultConstraints\[0\].maxSkew must be",
        ),
        (
            _config(
                {
                    "PodTopologySpread": {
                        "defaultingType": "List",
                        "defaultConstraints": [{**ZONE, "labelSelector": {}}],
                    }
                }
            ),
            r"labelSelector must not be set",
        ),
        (
            _config(
                {
                    "PodTopologySpread": {
                        "defaultingType": "List",
                        "defaultConstraints": [{**ZONE, "whenUnsatisfiable": "Never"}],
                    }
                }
            ),
            "whenUnsatisfiable must be",
        ),
        (
            _config(
                {
                    "PodTopologySpread": {
                        "defaultingType": "List",
                        "defaultConstraints": [{**ZONE, "topologyKey": ""}],
                    }
                }
            ),
            "topologyKey must be a label key",
        ),
    ],
)
def test_a_file_kube_scheduler_would_refuse_is_refused_naming_the_field(
    text: str, error: str
) -> None:
    with pytest.raises(SchedulerConfigError, match=error):
        parse_scheduler_profile(text, "vramsched")


@pytest.mark.parametrize(
    ("name", "extended"),
    [
        ("example.com/nic", True),
        ("nvidia.com/gpu", True),
        ("cpu", False),
        ("hugepages-2Mi", False),
        ("ephemeral-storage", False),
        ("kubernetes.io/foo", False),
        ("node.kubernetes.io/bar", False),
        ("requests.example.com/x", False),
        ("example.com/-bad", False),
    ],
)
def test_only_extended_resources_can_be_ignored(name: str, extended: bool) -> None:
    assert is_extended_resource(name) is extended
    profile = SchedulerProfile(ignored_resources=frozenset({name}))
    assert profile.ignores(name) is extended


def test_ignored_resources_are_not_checked_for_room() -> None:
    node = {
        "metadata": {"name": "n"},
        "status": {"allocatable": {"pods": "10", "example.net/fpga": "1"}},
    }

    def asking(requests: dict[str, str]) -> dict[str, Any]:
        container = {"name": "c", "resources": {"requests": requests}}
        return {"metadata": {"name": "p"}, "spec": {"containers": [container]}}

    nic = asking({"example.com/nic": "1", "example.org/licence": "3"})
    profile = SchedulerProfile(
        ignored_resources=frozenset({"example.com/nic"}), ignored_groups=frozenset({"example.org"})
    )
    assert room_problem(node, [], [nic]) == (
        "node n has 0 of example.com/nic free and the pods sent there ask 1"
    )
    assert room_problem(node, [], [nic], profile) is None
    # a resource the profile does not name is still checked
    fpga = asking({"example.com/nic": "1", "example.net/fpga": "2"})
    assert room_problem(node, [], [fpga], profile) == (
        "node n has 1 of example.net/fpga free and the pods sent there ask 2"
    )


# ----- the default selector -----------------------------------------------------------------------


def _pod(name: str, labels: dict[str, str], owner: tuple[str, str, str] | None = None) -> Any:
    meta: dict[str, Any] = {"name": name, "namespace": "ml", "labels": labels}
    if owner is not None:
        version, kind, owner_name = owner
        meta["ownerReferences"] = [
            {"apiVersion": "apps/v1", "kind": "Deployment", "name": "d", "uid": "0"},
            {
                "apiVersion": version,
                "kind": kind,
                "name": owner_name,
                "uid": "1",
                "controller": True,
            },
        ]
    return {"metadata": meta, "spec": {}}


def _service(name: str, selector: dict[str, str] | None, ns: str = "ml") -> dict[str, Any]:
    spec = {"selector": selector} if selector is not None else {}
    return {"metadata": {"name": name, "namespace": ns}, "spec": spec}


SERVICES = [
    _service("llm", {"app": "llm"}),
    _service("llm-r1", {"app": "llm", "rev": "r1"}),
    _service("headless", None),
    _service("other-ns", {"app": "llm", "zone": "x"}, ns="other"),
    _service("chat", {"app": "chat"}),
]
CONTROLLERS = {
    ("ReplicaSet", "ml", "rs"): {
        "spec": {
            "selector": {
                "matchLabels": {"tier": "gpu"},
                "matchExpressions": [{"key": "rev", "operator": "In", "values": ["r1", "r2"]}],
            }
        }
    },
    ("StatefulSet", "ml", "ss"): {"spec": {"selector": {"matchLabels": {"app": "llm"}}}},
    ("ReplicationController", "ml", "rc"): {"spec": {"selector": {"rev": "r9"}}},
}
DEFAULTS = SpreadDefaults((ZONE,), SERVICES, CONTROLLERS)


def test_the_selector_merges_every_service_that_selects_the_pod() -> None:
    # llm and llm-r1 select it; a Service without a selector, of another namespace or wanting
    # other labels does not
    assert DEFAULTS.selector(_pod("p", {"app": "llm", "rev": "r1"})) == {
        "matchLabels": {"app": "llm", "rev": "r1"},
        "matchExpressions": [],
    }
    assert DEFAULTS.selector(_pod("p", {"app": "solo"})) is None
    assert DEFAULTS.for_pod(_pod("p", {"app": "solo"})) == []


def test_a_replicaset_or_statefulset_adds_its_requirements() -> None:
    p = _pod("p", {"app": "llm", "tier": "gpu", "rev": "r2"}, ("apps/v1", "ReplicaSet", "rs"))
    assert DEFAULTS.selector(p) == {
        "matchLabels": {"app": "llm"},
        "matchExpressions": [
            {"key": "tier", "operator": "In", "values": ["gpu"]},
            {"key": "rev", "operator": "In", "values": ["r1", "r2"]},
        ],
    }
    ss = _pod("p", {"app": "chat"}, ("apps/v1", "StatefulSet", "ss"))
    # the Service's app=chat and the StatefulSet's app=llm are both required: no pod matches both
    assert DEFAULTS.selector(ss) == {
        "matchLabels": {"app": "chat"},
        "matchExpressions": [{"key": "app", "operator": "In", "values": ["llm"]}],
    }


def test_a_replication_controller_merges_its_labels_over_the_services() -> None:
    p = _pod("p", {"app": "llm", "rev": "r1"}, ("v1", "ReplicationController", "rc"))
    assert DEFAULTS.selector(p) == {
        "matchLabels": {"app": "llm", "rev": "r9"},
        "matchExpressions": [],
    }


def test_a_controller_not_found_or_of_another_kind_adds_nothing() -> None:
    for owner in (
        ("apps/v1", "ReplicaSet", "gone"),
        ("batch/v1", "Job", "rs"),
        ("extensions/v1beta1", "ReplicaSet", "rs"),
    ):
        p = _pod("p", {"app": "chat"}, owner)
        assert DEFAULTS.selector(p) == {"matchLabels": {"app": "chat"}, "matchExpressions": []}
    assert controller_ref(_pod("p", {}, ("batch/v1", "Job", "j"))) is None
    assert controller_ref(_pod("p", {}, ("apps/v1", "StatefulSet", "s"))) == (
        "StatefulSet",
        "ml",
        "s",
    )


def _node(name: str, zone: str) -> dict[str, Any]:
    return {"metadata": {"name": name, "labels": {"zone": zone}}, "spec": {}}


NODES = {"n1": _node("n1", "z1"), "n2": _node("n2", "z2")}
RUNNING = [(_pod("a", {"app": "llm"}), "n1"), (_pod("b", {"app": "chat"}), "n2")]


def test_a_pod_without_constraints_gets_the_defaults() -> None:
    p = _pod("p", {"app": "llm"})
    assert has_hard_spread(p, DEFAULTS) and not has_hard_spread(p)
    assert spread_problem(p, "n1", RUNNING, NODES) is None
    assert spread_problem(p, "n1", RUNNING, NODES, DEFAULTS) == (
        "node n1: its zone z1 would hold 2 more matching pods than the emptiest domain, over its "
        "maxSkew 1"
    )
    assert spread_problem(p, "n2", RUNNING, NODES, DEFAULTS) is None
    # a pod that states constraints, even only ScheduleAnyway ones, gets no default
    anyway = _pod("p", {"app": "llm"})
    anyway["spec"]["topologySpreadConstraints"] = [ANYWAY]
    assert not has_hard_spread(anyway, DEFAULTS)
    assert spread_problem(anyway, "n1", RUNNING, NODES, DEFAULTS) is None


def test_target_problem_checks_the_defaults_it_is_given() -> None:
    pods = {"ml/a": {**RUNNING[0][0], "spec": {"nodeName": "n1"}}}
    p = _pod("p", {"app": "llm"})
    assert target_problem(NODES, pods, [(None, p, "n1")], set()) is None
    why = target_problem(NODES, pods, [("ml/p", p, "n1")], set(), spread=DEFAULTS)
    assert why is not None and why[1] == "ml/p" and "over its maxSkew 1" in why[0]
    # the running pod leaving empties z1
    assert target_problem(NODES, pods, [(None, p, "n1")], {"ml/a"}, spread=DEFAULTS) is None


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-2, 3) | st.sampled_from(["", "List", "zone", "a/b"]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner),
    max_leaves=8,
)


@settings(max_examples=500, deadline=None)
@given(fit=_JSON, kind=_JSON, constraints=_JSON, name=_JSON, added=_JSON)
def test_any_arguments_are_read_or_refused_by_name(
    fit: Any, kind: Any, constraints: Any, name: Any, added: Any
) -> None:
    doc = {
        "apiVersion": "kubescheduler.config.k8s.io/v1beta1",
        "kind": "KubeSchedulerConfiguration",
        "profiles": [
            {"schedulerName": name},
            {
                "schedulerName": "vramsched",
                "pluginConfig": [
                    {"name": "NodeResourcesFit", "args": fit},
                    {
                        "name": "PodTopologySpread",
                        "args": {"defaultingType": kind, "defaultConstraints": constraints},
                    },
                    {"name": "NodeAffinity", "args": {"addedAffinity": added}},
                ],
            },
        ],
    }
    try:
        profile = scheduler_profile(doc, "vramsched")
    except SchedulerConfigError as exc:
        assert str(exc)
        return
    assert all(c["whenUnsatisfiable"] == "DoNotSchedule" for c in profile.default_spread)
    node = {"metadata": {"name": "n", "labels": {"a/b": "zone"}}}
    refusal = profile.added_affinity_refusal(node)
    assert refusal is None or "added node affinity" in refusal
