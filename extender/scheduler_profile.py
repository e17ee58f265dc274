"""What a kube-scheduler profile's configuration changes in the filters vramsched re-checks. Pure.

Live repacking and `plan-defrag` check every pod a plan sends somewhere against kube-scheduler's
filters (`target_rules`). Three of those filters take arguments from the scheduler's configuration
file, and without them vramsched reads them as the defaults:

- **NodeResourcesFit** `ignoredResources` and `ignoredResourceGroups`: extended resources the
  scheduler does not count (a NIC or licence resource handed out by another component). Read as
  default, vramsched refuses a move that kube-scheduler would allow.
- **PodTopologySpread** `defaultConstraints` with `defaultingType: List`: spread constraints for
  every pod that states none, selecting the pods of its Services and controller. Set to
  `DoNotSchedule` they refuse nodes; read as default, vramsched would send a model's replica where
  kube-scheduler keeps it off.
- **NodeAffinity** `addedAffinity`: a required node affinity the profile adds to every pod (a
  profile for GPU pods kept to GPU nodes). Read as default, vramsched would send a pod to a node
  outside it.

`scheduler_profile(doc, name)` reads the profile that schedules pods of `name` from a
KubeSchedulerConfiguration (v1, or the v1beta1 to v1beta3 of older kube-schedulers) and keeps
only those; `SchedulerProfile()` is the defaults. A file kube-scheduler would refuse for these
fields is refused here too (`SchedulerConfigError`, naming the field).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import yaml

from extender.node_rules import node_labels, node_name, selector_terms_hold

__all__ = [
    "SchedulerConfigError",
    "SchedulerProfile",
    "is_extended_resource",
    "parse_scheduler_profile",
    "scheduler_profile",
]

_GROUP = "kubescheduler.config.k8s.io/"
_VERSIONS = ("v1", "v1beta3", "v1beta2", "v1beta1")
_DEFAULT_SCHEDULER = "default-scheduler"
# a qualified name, as `requests.<name>` must be for a resource to be an extended one
_QUALIFIED = re.compile(
    r"^(?:[a-z0-9](?:[-a-z0-9]*[a-z0-9])?(?:\.[a-z0-9](?:[-a-z0-9]*[a-z0-9])?)*/)?"
    r"[A-Za-z0-9](?:[-A-Za-z0-9_.]*[A-Za-z0-9])?$"
)


class SchedulerConfigError(ValueError):
    """The scheduler configuration cannot be read, or kube-scheduler would refuse it."""


def is_extended_resource(name: str) -> bool:
    """Whether kube-scheduler counts `name` as an extended resource (`IsExtendedResourceName`):
    a domain-prefixed name outside `kubernetes.io/`, such as `example.com/nic`; `cpu`,
    `hugepages-2Mi` and `ephemeral-storage` are not."""
    if "/" not in name or "kubernetes.io/" in name or name.startswith("requests."):
        return False
    prefix, _, rest = ("requests." + name).partition("/")
    return len(rest) <= 63 and len(prefix) <= 253 and bool(_QUALIFIED.match(prefix + "/" + rest))


@dataclass(frozen=True)
class SchedulerProfile:
    """The profile's arguments that change what vramsched re-checks; the defaults by default."""

    #: the scheduler name of the profile read
    name: str = "vramsched"
    #: NodeResourcesFit `ignoredResources`: extended resources not counted
    ignored_resources: frozenset[str] = frozenset()
    #: NodeResourcesFit `ignoredResourceGroups`: groups (the part before `/`) not counted
    ignored_groups: frozenset[str] = frozenset()
    #: PodTopologySpread's `DoNotSchedule` default constraints (`defaultingType: List`), as written
    default_spread: tuple[Mapping[str, Any], ...] = ()
    #: NodeAffinity `addedAffinity`'s required nodeSelectorTerms (any one must hold); () for none
    added_affinity: tuple[Mapping[str, Any], ...] = ()

    def ignores(self, resource: str) -> bool:
        """Whether NodeResourcesFit leaves `resource` out (only extended resources can be)."""
        if not is_extended_resource(resource):
            return False
        group = resource.split("/", 1)[0]
        return resource in self.ignored_resources or group in self.ignored_groups

    def added_affinity_refusal(self, node: Mapping[str, Any]) -> str | None:
        """Why the profile's `addedAffinity` keeps every pod off `node`, or None."""
        if not self.added_affinity or selector_terms_hold(
            self.added_affinity, node_labels(node), node_name(node)
        ):
            return None
        return f"node {node_name(node)} does not match the scheduler profile's added node affinity"


def _strings(value: Any, where: str) -> frozenset[str]:
    if value is None:
        return frozenset()
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise SchedulerConfigError(f"{where} must be a list of strings")
    return frozenset(value)


def _version(doc: Mapping[str, Any]) -> str:
    api = doc.get("apiVersion")
    if (
        not isinstance(api, str)
        or not api.startswith(_GROUP)
        or api[len(_GROUP) :] not in _VERSIONS
    ):
        raise SchedulerConfigError(
            f"apiVersion {api!r} is not {_GROUP}v1 (or v1beta3, v1beta2, v1beta1)"
        )
    if doc.get("kind") != "KubeSchedulerConfiguration":
        raise SchedulerConfigError(f"kind {doc.get('kind')!r} is not KubeSchedulerConfiguration")
    return api[len(_GROUP) :]


def _profile(doc: Mapping[str, Any], name: str) -> Mapping[str, Any]:
    profiles = doc.get("profiles")
    if profiles is None:
        profiles = [{"schedulerName": _DEFAULT_SCHEDULER}]
    if not isinstance(profiles, list) or not all(isinstance(p, Mapping) for p in profiles):
        raise SchedulerConfigError("profiles must be a list of objects")
    for p in profiles:
        if (p.get("schedulerName") or _DEFAULT_SCHEDULER) == name:
            return p
    names = ", ".join(str(p.get("schedulerName") or _DEFAULT_SCHEDULER) for p in profiles)
    raise SchedulerConfigError(f"no profile has schedulerName {name!r} (the profiles: {names})")


def _args(profile: Mapping[str, Any], plugin: str) -> Mapping[str, Any]:
    configs = profile.get("pluginConfig") or []
    if not isinstance(configs, list):
        raise SchedulerConfigError("pluginConfig must be a list")
    found: Mapping[str, Any] = {}
    for c in configs:
        if not isinstance(c, Mapping):
            raise SchedulerConfigError("a pluginConfig entry is not an object")
        if c.get("name") == plugin:
            args = c.get("args") or {}
            if not isinstance(args, Mapping):
                raise SchedulerConfigError(f"pluginConfig {plugin} args must be an object")
            found = args
    return found


def _default_spread(args: Mapping[str, Any], version: str) -> tuple[Mapping[str, Any], ...]:
    constraints = args.get("defaultConstraints") or []
    where = "PodTopologySpread defaultConstraints"
    if not isinstance(constraints, list) or not all(isinstance(c, Mapping) for c in constraints):
        raise SchedulerConfigError(f"{where} must be a list of objects")
    kind = args.get("defaultingType")
    if kind is None:
        # v1beta1 (kube-scheduler 1.19-1.21) defaults to List when constraints are given; the
        # later versions always to System
        kind = "List" if version == "v1beta1" and constraints else "System"
    if kind not in ("List", "System"):
        raise SchedulerConfigError(
            f"PodTopologySpread defaultingType {kind!r} is not List or System"
        )
    if kind == "System":
        if constraints:
            raise SchedulerConfigError(f"{where} must be empty when defaultingType is System")
        return ()  # the system defaults are ScheduleAnyway: they refuse no node
    for i, c in enumerate(constraints):
        at = f"{where}[{i}]"
        if c.get("labelSelector") is not None:
            raise SchedulerConfigError(f"{at}.labelSelector must not be set")
        skew = c.get("maxSkew")
        if not isinstance(skew, int) or isinstance(skew, bool) or skew < 1:
            raise SchedulerConfigError(f"{at}.maxSkew must be a whole number of at least 1")
        if not isinstance(c.get("topologyKey"), str) or not c["topologyKey"]:
            raise SchedulerConfigError(f"{at}.topologyKey must be a label key")
        if c.get("whenUnsatisfiable") not in ("DoNotSchedule", "ScheduleAnyway"):
            raise SchedulerConfigError(
                f"{at}.whenUnsatisfiable must be DoNotSchedule or ScheduleAnyway"
            )
    return tuple(dict(c) for c in constraints if c["whenUnsatisfiable"] == "DoNotSchedule")


def _added_affinity(args: Mapping[str, Any]) -> tuple[Mapping[str, Any], ...]:
    added = args.get("addedAffinity")
    if added is None:
        return ()
    where = "NodeAffinity addedAffinity"
    if not isinstance(added, Mapping):
        raise SchedulerConfigError(f"{where} must be an object")
    required = added.get("requiredDuringSchedulingIgnoredDuringExecution")
    if required is None:
        return ()  # preferred terms only weigh scores
    terms = required.get("nodeSelectorTerms") if isinstance(required, Mapping) else None
    if not isinstance(terms, list) or not terms or not all(isinstance(t, Mapping) for t in terms):
        raise SchedulerConfigError(
            f"{where}.requiredDuringSchedulingIgnoredDuringExecution.nodeSelectorTerms must be "
            "a list of at least one term"
        )
    return tuple(dict(t) for t in terms)


def scheduler_profile(doc: Any, name: str) -> SchedulerProfile:
    """The arguments of the profile with schedulerName `name` in a KubeSchedulerConfiguration."""
    if not isinstance(doc, Mapping):
        raise SchedulerConfigError("the scheduler configuration is not a YAML object")
    version = _version(doc)
    profile = _profile(doc, name)
    fit = _args(profile, "NodeResourcesFit")
    return SchedulerProfile(
        name=name,
        ignored_resources=_strings(
            fit.get("ignoredResources"), "NodeResourcesFit ignoredResources"
        ),
        ignored_groups=_strings(
            fit.get("ignoredResourceGroups"), "NodeResourcesFit ignoredResourceGroups"
        ),
        default_spread=_default_spread(_args(profile, "PodTopologySpread"), version),
        added_affinity=_added_affinity(_args(profile, "NodeAffinity")),
    )


def parse_scheduler_profile(text: str, name: str) -> SchedulerProfile:
    """`scheduler_profile` of a configuration file's text."""
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise SchedulerConfigError(f"not YAML: {exc}") from None
    return scheduler_profile(doc, name)
