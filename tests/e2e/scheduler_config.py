"""KubeSchedulerConfiguration files as the e2e kube-schedulers load them.

- kube-scheduler 1.25+ (the suite's 1.36) reads ``kubescheduler.config.k8s.io/v1``, so a config
  given as text is loaded **as it is**, changed only by the overlay (:func:`overlay_v1`): every
  extender's ``urlPrefix`` line points at the test's extender, and a ``clientConnection:
  kubeconfig:`` block is appended (in a cluster the scheduler uses its pod's service account; here
  it needs a file). Nothing else is touched: comments, order and every other byte stay, and the
  leader-election settings stay too (the harness toggles election with ``--leader-elect``, a
  flag kube-scheduler applies over the file).
- kube-scheduler 1.20 reads ``v1beta1``: :func:`to_v1beta1` translates (same profile/extender
  fields) and the harness sets its own addresses in the document.

This module deliberately does not import pytest.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

SCHEDULER_API_V1 = "kubescheduler.config.k8s.io/v1"
SCHEDULER_API_V1BETA1 = "kubescheduler.config.k8s.io/v1beta1"

# An extender's urlPrefix line: "  - urlPrefix: ..." or "    urlPrefix: ..." (never a comment).
_URL_PREFIX_LINE = re.compile(
    r"^(?P<lead>[ \t]*(?:-[ \t]+)?urlPrefix:[ \t]*)(?P<value>\S.*?)[ \t]*$", re.M
)


class SchedulerConfigError(ValueError):
    """The config cannot be loaded by this kube-scheduler, or the overlay cannot apply to it."""


def overlay_fields(
    doc: Mapping[str, Any], *, kubeconfig: Path | str, extender_url: str | None
) -> dict[str, Any]:
    """The parsed document with the overlay's fields set: what kube-scheduler must end up reading."""
    out = copy.deepcopy(dict(doc))
    out["clientConnection"] = {**(out.get("clientConnection") or {}), "kubeconfig": str(kubeconfig)}
    if extender_url is not None:
        if not out.get("extenders"):
            raise SchedulerConfigError("extender_url given but the config has no extenders")
        for ext in out["extenders"]:
            ext["urlPrefix"] = extender_url
    return out


def overlay_v1(
    config: str | Mapping[str, Any], *, kubeconfig: Path | str, extender_url: str | None = None
) -> str:
    """The file a v1-reading kube-scheduler gets: ``config`` plus the overlay, nothing else.

    Text is edited line by line (so the result is the given bytes except the ``urlPrefix`` lines
    and two appended lines); a mapping is the caller's own config and is simply dumped with the
    overlay's fields set. Either way the result parses to exactly :func:`overlay_fields`.
    """
    if not isinstance(config, str):
        doc = overlay_fields(config, kubeconfig=kubeconfig, extender_url=extender_url)
        return yaml.safe_dump(doc, sort_keys=False)
    parsed = yaml.safe_load(config)
    if not isinstance(parsed, dict):
        raise SchedulerConfigError("the scheduler config is not a YAML mapping")
    if parsed.get("apiVersion") != SCHEDULER_API_V1:
        raise SchedulerConfigError(
            f"apiVersion {parsed.get('apiVersion')!r}: this kube-scheduler reads {SCHEDULER_API_V1}"
        )
    if "clientConnection" in parsed:
        raise SchedulerConfigError(
            "the overlay appends clientConnection; the config must not set it already"
        )
    want = overlay_fields(parsed, kubeconfig=kubeconfig, extender_url=extender_url)
    text = config if config.endswith("\n") else config + "\n"
    if extender_url is not None:
        lines = _URL_PREFIX_LINE.findall(text)
        if len(lines) != len(parsed["extenders"]):
            raise SchedulerConfigError(
                f"found {len(lines)} urlPrefix lines for {len(parsed['extenders'])} extenders"
            )
        text = _URL_PREFIX_LINE.sub(lambda m: m.group("lead") + json.dumps(extender_url), text)
    text += f"clientConnection:\n  kubeconfig: {json.dumps(str(kubeconfig))}\n"
    if yaml.safe_load(text) != want:  # the line edits must mean exactly the overlay
        raise SchedulerConfigError("the overlay's line edits changed more than its fields")
    return text


def to_v1beta1(doc: Mapping[str, Any]) -> dict[str, Any]:
    """Translate a ``kubescheduler.config.k8s.io/v1`` config into the v1beta1 that 1.20 reads.

    The profile/extender fields are the same. Differences handled: plugin args apiVersions,
    profile-level ``percentageOfNodesToScore`` (1.20 only has the top-level one: hoisted, and
    refused if profiles disagree), ``delayCacheUntilActive`` (dropped: not in 1.20), ``multiPoint``
    (refused: 1.20 has no such extension point).
    """
    out = copy.deepcopy(dict(doc))
    api = out.get("apiVersion", SCHEDULER_API_V1BETA1)
    if api not in (SCHEDULER_API_V1, SCHEDULER_API_V1BETA1):
        raise SchedulerConfigError(f"kube-scheduler 1.20 cannot read apiVersion {api!r}")
    out["apiVersion"] = SCHEDULER_API_V1BETA1
    out.setdefault("kind", "KubeSchedulerConfiguration")
    out.pop("delayCacheUntilActive", None)
    percentages = set()
    for profile in out.get("profiles") or []:
        if "percentageOfNodesToScore" in profile:
            percentages.add(profile.pop("percentageOfNodesToScore"))
        if "multiPoint" in (profile.get("plugins") or {}):
            raise SchedulerConfigError("plugins.multiPoint does not exist in kube-scheduler 1.20")
        for plugin_cfg in profile.get("pluginConfig") or []:
            args = plugin_cfg.get("args")
            if isinstance(args, dict) and args.get("apiVersion") == SCHEDULER_API_V1:
                args["apiVersion"] = SCHEDULER_API_V1BETA1
    if len(percentages) > 1:
        raise SchedulerConfigError(
            f"profiles disagree on percentageOfNodesToScore {sorted(percentages)}; "
            "1.20 has only the global setting"
        )
    if percentages and "percentageOfNodesToScore" not in out:
        out["percentageOfNodesToScore"] = percentages.pop()
    return out


def build_v1(
    scheduler_name: str = "vramsched",
    *,
    extender_url: str | None = None,
    managed_resources: tuple[str, ...] | list[str] = ("nvidia.com/gpu",),
    filter_verb: str | None = "filter",
    prioritize_verb: str | None = "prioritize",
    bind_verb: str | None = None,
    preempt_verb: str | None = None,
    weight: int = 1,
    node_cache_capable: bool = False,
    http_timeout: str = "5s",
    ignorable: bool = False,
    percentage_of_nodes_to_score: int | None = 100,
) -> str:
    """A ``kubescheduler.config.k8s.io/v1`` YAML: one profile, optionally one extender.

    ``extender_url`` is the urlPrefix (the scheduler POSTs to ``<urlPrefix>/<verb>``).
    ``node_cache_capable`` defaults to False because the extender then gets full Nodes
    (with labels), which is what a stateless extender needs.
    """
    doc: dict[str, Any] = {
        "apiVersion": SCHEDULER_API_V1,
        "kind": "KubeSchedulerConfiguration",
        "leaderElection": {"leaderElect": False},
        "profiles": [{"schedulerName": scheduler_name}],
    }
    if percentage_of_nodes_to_score is not None:
        doc["profiles"][0]["percentageOfNodesToScore"] = percentage_of_nodes_to_score
    if extender_url is not None:
        ext: dict[str, Any] = {
            "urlPrefix": extender_url,
            "enableHTTPS": extender_url.startswith("https://"),
            "nodeCacheCapable": node_cache_capable,
            "httpTimeout": http_timeout,
            "ignorable": ignorable,
            "managedResources": [
                {"name": name, "ignoredByScheduler": False} for name in managed_resources
            ],
        }
        for key, verb in (
            ("filterVerb", filter_verb),
            ("prioritizeVerb", prioritize_verb),
            ("bindVerb", bind_verb),
            ("preemptVerb", preempt_verb),
        ):
            if verb:
                ext[key] = verb
        if prioritize_verb:
            ext["weight"] = weight
        doc["extenders"] = [ext]
    return yaml.safe_dump(doc, sort_keys=False)
