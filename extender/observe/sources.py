"""Where `top` and `why` read the cluster: the Kubernetes API, a running extender, a cluster file.

The API's nodes and pods go through `LiveSource.apply`, the very code the live informers feed, so
the ledger built here is the one a freshly started vramsched would hold: same GFD label parsing,
same assignment annotations read back, same guesses for pods bound by someone else. A cluster
file goes through `ClusterState.load`, as `serve --cluster` does. `load_storage` reads the
PersistentVolumeClaims and PersistentVolumes beside them, for `plan-defrag`; `load_profile` a
scheduler configuration's profile (`serve --repack` and `plan-defrag`), and `load_spread_defaults`
what its default spread selects by.
"""

from __future__ import annotations

import argparse
import os
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import orjson

from extender.cluster import DEFAULT_SCHEDULER_NAME, ClusterState
from extender.inventory import ReplicaPolicy
from extender.scheduler_profile import (
    SchedulerConfigError,
    SchedulerProfile,
    parse_scheduler_profile,
)
from extender.source_file import STORAGE_KINDS, ClusterFileError, read_cluster_file
from extender.spread_defaults import SPREAD_LISTS, SpreadDefaults
from extender.volume_rules import ATTACH_KINDS, ATTACH_LISTS, Storage

__all__ = [
    "SourceError",
    "add_source_args",
    "default_kubeconfig",
    "cluster_from_file",
    "cluster_from_kube",
    "state_from_server",
    "load_cluster",
    "load_storage",
    "load_profile",
    "load_spread_defaults",
]


class SourceError(Exception):
    """The cluster could not be read; the message says from where and why, in one line."""

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(message.split()))


def add_source_args(p: argparse.ArgumentParser, *, server: bool) -> None:
    """Flags as kubectl users expect them, plus the other two sources."""
    p.add_argument(
        "--kubeconfig",
        metavar="PATH",
        help="read the cluster from the API server of this kubeconfig (default: $KUBECONFIG, "
        "~/.kube/config, else the in-cluster ServiceAccount)",
    )
    if server:
        p.add_argument(
            "--server",
            metavar="URL",
            help="read a running extender's GET /state instead (e.g. http://127.0.0.1:8888 "
            "through kubectl port-forward)",
        )
    p.add_argument(
        "--cluster",
        metavar="FILE",
        help="read a cluster file instead (a List of Nodes and Pods, as `serve --cluster`)",
    )
    p.add_argument(
        "--replica-policy",
        choices=[r.value for r in ReplicaPolicy],
        default=None,
        help="the device plugin's replica policy the extender runs with (API default: "
        "distributed, as `serve`; a cluster file: none)",
    )
    p.add_argument("--scheduler-name", default=DEFAULT_SCHEDULER_NAME)


def default_kubeconfig(explicit: str | None) -> str | None:
    """kubectl's order: the flag, the first file of $KUBECONFIG, ~/.kube/config; None: in-cluster."""
    if explicit:
        return explicit
    env = os.environ.get("KUBECONFIG", "")
    for path in env.split(os.pathsep):
        if path and Path(path).exists():
            return path
    home = Path.home() / ".kube" / "config"
    return str(home) if home.exists() else None


def cluster_from_file(
    path: str,
    *,
    scheduler_name: str = DEFAULT_SCHEDULER_NAME,
    headroom: float = 0.0,
    replica_policy: str | None = None,
) -> ClusterState:
    cluster = ClusterState(
        scheduler_name=scheduler_name, headroom=headroom, replica_policy=replica_policy
    )
    try:
        cluster.load(read_cluster_file(path))
    except ClusterFileError as exc:  # names the file
        raise SourceError(f"cannot read {exc}") from None
    except OSError as exc:
        raise SourceError(f"cannot read {path}: {exc.strerror or exc}") from None
    return cluster


def cluster_from_kube(
    kubeconfig: str | None,
    *,
    scheduler_name: str = DEFAULT_SCHEDULER_NAME,
    headroom: float = 0.0,
    replica_policy: str | None = None,
) -> ClusterState:
    """One list of nodes, then of pods, applied as the informers' first sync applies them."""
    from extender.live.api_client import ApiError, ClientApi, KubeconfigError
    from extender.live.source import LiveSource

    where = kubeconfig or "the in-cluster ServiceAccount"
    try:
        api = ClientApi(kubeconfig)
    except KubeconfigError as exc:
        raise SourceError(str(exc)) from None
    cluster = ClusterState(
        scheduler_name=scheduler_name,
        headroom=headroom,
        replica_policy=ReplicaPolicy.live(replica_policy),
    )
    source = LiveSource(cluster, api=api)
    try:
        for kind in ("nodes", "pods"):
            try:
                items, _ = api.list(kind)
            except ApiError as exc:
                raise SourceError(
                    f"cannot list {kind} from the API server ({where}): {exc}"
                ) from None
            source.apply(kind, "replace", items)
    finally:
        source.binder.close()
    return cluster


def state_from_server(url: str, timeout: float = 30.0) -> dict[str, Any]:
    """GET <url>/state of a running extender."""
    if not url.startswith(("http://", "https://")):
        raise SourceError(f"--server {url!r} is not an http:// or https:// URL")
    target = url.rstrip("/") + "/state"
    try:
        with urllib.request.urlopen(target, timeout=timeout) as resp:
            body = resp.read()
    except urllib.error.HTTPError as exc:
        raise SourceError(f"{target}: HTTP {exc.code} {exc.reason}") from None
    except (urllib.error.URLError, OSError, ValueError) as exc:  # ValueError: a malformed URL
        raise SourceError(f"cannot reach {target}: {getattr(exc, 'reason', exc)}") from None
    try:
        state = orjson.loads(body)
    except orjson.JSONDecodeError:
        raise SourceError(f"{target} did not answer JSON: is it a vramsched extender?") from None
    if not isinstance(state, dict):
        raise SourceError(f"{target} did not answer a JSON object: is it a vramsched extender?")
    return state


def load_cluster(args: argparse.Namespace, *, headroom: float = 0.0) -> ClusterState:
    """The ClusterState `args` name: --cluster FILE, else the API server."""
    if args.cluster:
        return cluster_from_file(
            args.cluster,
            scheduler_name=args.scheduler_name,
            headroom=headroom,
            replica_policy=args.replica_policy,
        )
    return cluster_from_kube(
        default_kubeconfig(args.kubeconfig),
        scheduler_name=args.scheduler_name,
        headroom=headroom,
        replica_policy=args.replica_policy,
    )


def load_storage(args: argparse.Namespace) -> tuple[Storage, str | None]:
    """The claims and volumes of the source `load_cluster` read (after it, so the source is
    known to be readable), and why they could not be read, if so; with them what CSI attach limits
    need (`ATTACH_KINDS`). A file's are those it holds (`kubectl get
    nodes,pods,pvc,pv,csinodes,volumeattachments,storageclasses -A -o yaml`), none if it holds
    none; a file with no object of the attach kinds has not read them. Unread, every pod with a
    claim stays where it is (without the attach kinds, every pod whose volumes they would
    count)."""
    if args.cluster:
        try:
            held = list(read_cluster_file(args.cluster, STORAGE_KINDS + ATTACH_KINDS))
        except (ClusterFileError, OSError) as exc:
            return Storage(), (
                f"cannot read the claims and volumes of {args.cluster}: {exc}; "
                "pods with claims stay put"
            )
        # a file with any of them was dumped with all three (none of a kind is then none)
        dumped = any(o.get("kind") in ATTACH_KINDS for o in held)
        return Storage.from_objects(held, ATTACH_KINDS if dumped else ()), None
    from extender.live.api_client import ApiError, ClientApi, KubeconfigError

    kubeconfig = default_kubeconfig(args.kubeconfig)
    where = kubeconfig or "the in-cluster ServiceAccount"
    objects: list[dict[str, Any]] = []
    try:
        api = ClientApi(kubeconfig)
        for kind, plural in zip(STORAGE_KINDS, ("persistentvolumeclaims", "persistentvolumes")):
            items, _ = api.list(plural)
            objects += [{**item, "kind": kind} for item in items]
    except (ApiError, KubeconfigError) as exc:
        return Storage(), (
            f"cannot list claims and volumes from the API server ({where}): {exc}; "
            "pods with claims stay put"
        )
    listed: list[str] = []
    unread: list[str] = []
    for kind, plural in ATTACH_LISTS.items():
        try:
            items, _ = api.list(plural)
        except ApiError as exc:
            unread.append(f"{plural} ({exc})")
            continue
        listed.append(kind)
        objects += [{**item, "kind": kind} for item in items]
    if not unread:
        return Storage.from_objects(objects, listed), None
    return Storage.from_objects(objects, listed), (
        f"cannot list {', '.join(unread)} from the API server ({where}); "
        "pods whose volumes attach limits count stay put"
    )


def load_profile(path: str | None, scheduler_name: str) -> SchedulerProfile:
    """The profile of the scheduler configuration at `path` that schedules `scheduler_name`'s
    pods (`scheduler_profile`); the defaults without a path. SchedulerConfigError names the file
    and what is wrong with it."""
    if not path:
        return SchedulerProfile(name=scheduler_name)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise SchedulerConfigError(f"{path}: {why}") from None
    try:
        return parse_scheduler_profile(text, scheduler_name)
    except SchedulerConfigError as exc:
        raise SchedulerConfigError(f"{path}: {exc}") from None


def load_spread_defaults(
    args: argparse.Namespace, profile: SchedulerProfile
) -> SpreadDefaults | None:
    """The profile's default spread with every Service, ReplicationController, ReplicaSet and
    StatefulSet of the source `load_cluster` read (a file's are those it holds); None when the
    profile has no `DoNotSchedule` default. SourceError when they cannot be read: a pod's
    default constraints cannot be told without them."""
    if not profile.default_spread:
        return None
    if args.cluster:
        try:
            held = read_cluster_file(args.cluster, tuple(SPREAD_LISTS))
        except (ClusterFileError, OSError) as exc:
            raise SourceError(
                f"cannot read the Services and controllers of {args.cluster}: {exc}"
            ) from None
    else:
        from extender.live.api_client import ApiError, ClientApi, KubeconfigError

        kubeconfig = default_kubeconfig(args.kubeconfig)
        held = []
        try:
            api = ClientApi(kubeconfig)
            for kind, plural in SPREAD_LISTS.items():
                items, _ = api.list(plural)
                held += [{**item, "kind": kind} for item in items]
        except (ApiError, KubeconfigError) as exc:
            where = kubeconfig or "the in-cluster ServiceAccount"
            raise SourceError(
                f"cannot list the Services and controllers the scheduler profile's default "
                f"spread selects by from the API server ({where}): {exc}"
            ) from None
    return SpreadDefaults.from_objects(profile.default_spread, held)
