"""config/KubeSchedulerConfiguration.yaml (and its copy in deploy/) as kube-scheduler reads it:
known fields only, its validation rules, and settings that agree with the extender they
configure (routes, listen address, scheduler name, managed resources, weight, timeout).
"""

from __future__ import annotations

import re
from urllib.parse import urlparse

from deploy_objects import (
    CONFIG,
    CONFIG_KEY,
    DEPLOY,
    base_objects,
    container,
    deployment,
    go_duration_seconds,
    one,
    scheduler_config,
    serve_args,
    the_extender,
)

from extender import mig
from extender.inventory import GPU_RESOURCE, SHARED_GPU_RESOURCE, is_gpu_resource
from extender.server import route_paths

# Field names per level: kubernetes/kubernetes staging/src/k8s.io/kube-scheduler/config/v1/types.go
# and, for leaderElection, staging/src/k8s.io/component-base/config/v1alpha1/types.go
# (LeaderElectionConfiguration).
_SCHEMA: dict[str, set[str]] = {
    "": {
        "apiVersion",
        "kind",
        "parallelism",
        "leaderElection",
        "clientConnection",
        "percentageOfNodesToScore",
        "podInitialBackoffSeconds",
        "podMaxBackoffSeconds",
        "profiles",
        "extenders",
        "delayCacheUntilActive",
    },
    "leaderElection": {
        "leaderElect",
        "leaseDuration",
        "renewDeadline",
        "retryPeriod",
        "resourceLock",
        "resourceName",
        "resourceNamespace",
    },
    "profiles": {"schedulerName", "percentageOfNodesToScore", "plugins", "pluginConfig"},
    "extenders": {
        "urlPrefix",
        "filterVerb",
        "preemptVerb",
        "prioritizeVerb",
        "weight",
        "bindVerb",
        "enableHTTPS",
        "tlsConfig",
        "httpTimeout",
        "nodeCacheCapable",
        "managedResources",
        "ignorable",
    },
    "managedResources": {"name", "ignoredByScheduler"},
}
# Default score-plugin weights of kube-scheduler v1 (pkg/scheduler/apis/config/v1/default_plugins.go).
_USER_INTENT_SCORERS = {
    "TaintToleration": 3,
    "NodeAffinity": 2,
    "PodTopologySpread": 2,
    "InterPodAffinity": 2,
}
_VRAM_BLIND_SCORERS = {
    "NodeResourcesFit": 1,
    "NodeResourcesBalancedAllocation": 1,
    "ImageLocality": 1,
}
_MAX_NODE_SCORE, _MAX_EXTENDER_PRIORITY = 100, 10
# Upstream SLO for one mutating API call (p99); bind makes up to 3 with --pin-gpus.
_API_WRITE_SLO_S, _BIND_WRITES_WITH_PINNING = 1.0, 3
# A Kubernetes qualified name with a prefix, and not in the kubernetes.io namespace: an extended resource.
_EXTENDED_RESOURCE = re.compile(
    r"^(?!(?:[^/]*\.)?kubernetes\.io/)[a-z0-9]([-a-z0-9.]*[a-z0-9])?/[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$"
)


def test_deploy_copy_of_scheduler_config_is_identical() -> None:
    assert (DEPLOY / CONFIG_KEY).read_bytes() == CONFIG.read_bytes(), (
        "deploy/KubeSchedulerConfiguration.yaml drifted: cp config/KubeSchedulerConfiguration.yaml deploy/"
    )


def test_scheduler_config_uses_only_known_fields() -> None:
    cfg = scheduler_config()
    assert (cfg["apiVersion"], cfg["kind"]) == (
        "kubescheduler.config.k8s.io/v1",
        "KubeSchedulerConfiguration",
    )
    unknown = set(cfg) - _SCHEMA[""]
    unknown |= {
        f"leaderElection.{k}" for k in set(cfg["leaderElection"]) - _SCHEMA["leaderElection"]
    }
    for p in cfg["profiles"]:
        unknown |= {f"profiles[].{k}" for k in set(p) - _SCHEMA["profiles"]}
    for e in cfg["extenders"]:
        unknown |= {f"extenders[].{k}" for k in set(e) - _SCHEMA["extenders"]}
        for m in e.get("managedResources", []):
            unknown |= {f"managedResources[].{k}" for k in set(m) - _SCHEMA["managedResources"]}
    assert not unknown, (
        f"kube-scheduler rejects unknown fields (strict decoding): {sorted(unknown)}"
    )


def test_scheduler_config_passes_kube_scheduler_validation_rules() -> None:
    cfg = scheduler_config()
    le = cfg["leaderElection"]
    assert le["leaderElect"] is True and le["resourceLock"] == "leases"
    names = [p["schedulerName"] for p in cfg["profiles"]]
    assert all(names) and len(set(names)) == len(names)
    for p in cfg["profiles"]:
        assert 0 <= p.get("percentageOfNodesToScore", 0) <= 100
    assert sum(1 for e in cfg["extenders"] if e.get("bindVerb")) <= 1, (
        "only one extender can implement bind"
    )
    seen: set[str] = set()
    for e in cfg["extenders"]:
        if e.get("prioritizeVerb"):
            assert isinstance(e.get("weight"), int) and e["weight"] > 0, (
                "prioritizeVerb needs a positive weight"
            )
        for m in e.get("managedResources", []):
            assert _EXTENDED_RESOURCE.match(m["name"]), (
                f"not an extended resource name: {m['name']}"
            )
            assert m["name"] not in seen, f"duplicate managed resource {m['name']}"
            seen.add(m["name"])
            assert isinstance(m.get("ignoredByScheduler", False), bool)
        assert go_duration_seconds(e["httpTimeout"]) > 0


def test_leader_election_uses_its_own_lease_in_our_namespace() -> None:
    le = scheduler_config()["leaderElection"]
    assert le["resourceName"] == "vramsched"
    assert le["resourceName"] != "kube-scheduler", (
        "would compete with the default scheduler for its lease"
    )
    namespace = one(base_objects(), "Namespace")["metadata"]["name"]
    assert le["resourceNamespace"] == namespace


def test_one_profile_named_vramsched_scores_every_node() -> None:
    (profile,) = scheduler_config()["profiles"]
    assert profile["schedulerName"] == "vramsched"
    assert profile["percentageOfNodesToScore"] == 100


def test_every_configured_verb_is_a_route_of_the_extender() -> None:
    ext = the_extender()
    routes = route_paths()
    prefix = urlparse(ext["urlPrefix"]).path.rstrip("/")
    verbs = {k: ext.get(k) for k in ("filterVerb", "prioritizeVerb", "bindVerb", "preemptVerb")}
    # The extender implements all four verbs, so all four are configured.
    assert all(verbs.values()), f"a verb is not configured: {verbs}"
    for key, verb in verbs.items():
        # kube-scheduler POSTs to strings.TrimRight(urlPrefix, "/") + "/" + verb
        assert f"{prefix}/{verb}" in routes, (
            f"{key}={verb!r} -> {prefix}/{verb} is not served (routes: {sorted(routes)})"
        )


def test_url_prefix_points_at_the_sidecar_as_started() -> None:
    ext = the_extender()
    url = urlparse(ext["urlPrefix"])
    args = serve_args(container(deployment(), "extender")["args"])
    assert url.scheme == "http" and ext.get("enableHTTPS", False) is False and args.tls_cert is None
    assert url.hostname == args.host == "127.0.0.1", (
        "extender must listen on loopback only, where the scheduler calls it"
    )
    assert url.port == args.port


def test_extender_serves_the_profile_scheduler_name() -> None:
    args = serve_args(container(deployment(), "extender")["args"])
    assert args.scheduler_name == scheduler_config()["profiles"][0]["schedulerName"]
    assert args.pin_gpus is False, "pinning is opt-in (deploy/pin-gpus)"


def test_extender_settings_keep_the_vram_ledger_authoritative() -> None:
    ext = the_extender()
    assert ext["nodeCacheCapable"] is True
    assert ext["ignorable"] is False, (
        "an ignorable extender lets GPU pods through without a reservation"
    )
    assert all(m.get("ignoredByScheduler") is False for m in ext["managedResources"])


def test_managed_resources_cover_every_resource_the_extender_places() -> None:
    managed = {m["name"] for m in the_extender()["managedResources"]}
    known = {GPU_RESOURCE, SHARED_GPU_RESOURCE} | {
        mig.resource_name(p.name) for model in mig.MODELS.values() for p in model.profiles
    }
    assert not known - managed, (
        f"pods requesting these would bypass the extender: {sorted(known - managed)}"
    )
    assert all(is_gpu_resource(n) for n in managed), (
        "a managed resource the extender does not understand"
    )


def test_weight_lets_vram_fit_outweigh_vram_blind_scorers_but_not_user_intent() -> None:
    weight = the_extender()["weight"]
    extender_span = _MAX_EXTENDER_PRIORITY * weight * (_MAX_NODE_SCORE // _MAX_EXTENDER_PRIORITY)
    blind_span = _MAX_NODE_SCORE * sum(_VRAM_BLIND_SCORERS.values())
    intent_span = _MAX_NODE_SCORE * sum(_USER_INTENT_SCORERS.values())
    assert blind_span < extender_span < intent_span, (blind_span, extender_span, intent_span)


def test_http_timeout_leaves_room_for_a_pinning_bind() -> None:
    timeout = go_duration_seconds(the_extender()["httpTimeout"])
    assert timeout >= _BIND_WRITES_WITH_PINNING * _API_WRITE_SLO_S
