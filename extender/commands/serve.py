"""`vramsched serve`: run the extender over an embedded cluster file or a live cluster."""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import ssl
import time
from typing import TYPE_CHECKING

from aiohttp import web

from extender.cluster import DEFAULT_SCHEDULER_NAME, ClusterState
from extender.commands.argtypes import PORT, number, whole
from extender.embedded import EmbeddedBinder
from extender.inventory import ReplicaPolicy
from extender.logs import setup_logging
from extender.observe.leader import LeaseLeader, kube_lease_reader, parse_lease_name
from extender.observe.sources import load_profile
from extender.placement import warm
from extender.repack_policy import MOVES_PER_GPU
from extender.scheduler_profile import SchedulerConfigError, SchedulerProfile
from extender.server import (
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_CONCURRENCY,
    create_app,
    create_probe_app,
    start_site,
)
from extender.service import Extender, ExtenderService
from extender.source_file import ClusterFileError, read_cluster_file
from extender.webhook import launch as webhook

if TYPE_CHECKING:
    from extender.live.nominating import NominatingPlanSource
    from extender.live.repack import Repacker
    from extender.live.source import LiveSource
    from extender.planner.background import BackgroundPlanner

log = logging.getLogger("extender.serve")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve the extender HTTP API")
    src = p.add_mutually_exclusive_group()
    src.add_argument(
        "--cluster",
        metavar="FILE",
        help="embedded mode: a Kubernetes List of Nodes and Pods (YAML or JSON)",
    )
    src.add_argument(
        "--kubeconfig",
        metavar="PATH",
        help="live mode with this kubeconfig (default: in-cluster config)",
    )
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="listen address (default 127.0.0.1: a sidecar of kube-scheduler)",
    )
    p.add_argument("--port", type=PORT, default=8888)
    p.add_argument(
        "--scheduler-name",
        default=DEFAULT_SCHEDULER_NAME,
        help="pods with this spec.schedulerName are ours",
    )
    p.add_argument(
        "--headroom",
        type=number(at_least=0, at_most=1),
        default=0.0,
        help="extra fraction of VRAM reserved over the declared model memory (default 0)",
    )
    p.add_argument("--max-body-bytes", type=whole(at_least=1), default=DEFAULT_MAX_BODY_BYTES)
    p.add_argument(
        "--max-concurrency",
        type=whole(at_least=1),
        default=DEFAULT_MAX_CONCURRENCY,
        help="requests in flight before answering 503 (probes are exempt)",
    )
    p.add_argument(
        "--assume-ttl",
        type=number(above=0),
        default=60.0,
        help="seconds a bind's reservation is kept before the watch confirms it",
    )
    p.add_argument(
        "--pin-gpus", action="store_true", help="shorthand for --replica-policy pinned (live mode)"
    )
    p.add_argument(
        "--replica-policy",
        choices=[p.value for p in ReplicaPolicy],
        default=None,
        help="who picks the physical GPU of a time-sliced replica: the device plugin with its "
        "distributed (default) or packed policy, or vramsched via the pinning ConfigMap (docs/live.md)",
    )
    p.add_argument(
        "--metrics-port",
        type=PORT,
        default=0,
        help="also serve GET /metrics, /healthz, /readyz (nothing else) on this port; 0 = off",
    )
    p.add_argument(
        "--metrics-host",
        default="0.0.0.0",
        help="listen address of --metrics-port (default all interfaces)",
    )
    p.add_argument("--tls-cert", metavar="FILE")
    p.add_argument("--tls-key", metavar="FILE")
    p.add_argument(
        "--planner",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="keep a CP-SAT batch plan for the pods that wait (pending 0.5 s and more) in a background "
        "thread; prioritize and bind follow it while it is fresh, best fit answers otherwise "
        "(default on; --no-planner: greedy only; docs/packing.md)",
    )
    p.add_argument(
        "--planner-time-limit",
        type=number(above=0),
        default=1.0,
        help="seconds per background plan (default 1)",
    )
    p.add_argument(
        "--open-gpu-cost",
        type=number(at_least=0),
        default=0.0,
        metavar="F",
        help="planner (and --repack's moved pods): charge each placement F GPUs of memory per "
        "idle GPU it opens, on top of FGD's measure (default 0; 0.2 packs LLM pods onto fewer "
        "GPUs while the cluster has room, at some cost in memory allocated when it is "
        "overloaded; docs/packing.md)",
    )
    p.add_argument(
        "--plan-ahead",
        type=whole(at_least=0),
        default=0,
        metavar="N",
        help="planner: keep its one-pod choice ready for the N most common GPU pod types, so a pod "
        "kube-scheduler places at once gets the planner's rule rather than best fit; other pods "
        "get the rule run inline in prioritize (default 0: off; a round of N one-pod plans in the "
        "worker thread after each change, at most 5 a second; about 1 ms per inline pod at 100 "
        "nodes, 6 at 1,000; docs/packing.md)",
    )
    p.add_argument(
        "--legacy-failed-nodes",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also list unresolvable nodes in FailedNodes, for kube-scheduler < 1.21 which reads no "
        "other map (default: on with --cluster; live, on only if the API server is older than 1.21)",
    )
    p.add_argument(
        "--explain-all",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="give filter's reason for every refused node even when some node passes (default off: "
        "kube-scheduler reads the reasons only when no node is left, and then every refused node "
        "has one). Turn on when another filtering extender runs after vramsched",
    )
    p.add_argument(
        "--leader-lease",
        metavar="NAMESPACE/NAME",
        default="vramsched/vramsched",
        help="live mode: the Lease kube-scheduler's leader election holds (its leaderElection "
        "resourceNamespace/resourceName); vramsched_leader is 1 on the replica whose "
        "kube-scheduler holds it (default vramsched/vramsched, as deploy/; '' = always 1)",
    )
    p.add_argument(
        "--repack",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="live mode: when a pod fits nowhere only because free VRAM is split, evict the fewest "
        'pods annotated vramsched.io/movable: "true" (owned by a ReplicaSet or StatefulSet) through '
        "the Eviction API and hold the freed GPUs for it and for their re-created pods "
        "(default off; docs/repack-live.md)",
    )
    p.add_argument(
        "--preempt",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="live mode: when a pod fits no GPU's free VRAM, evict the fewest pods of lower "
        "priority that make room on one node (kube-scheduler's own preemption counts GPUs, not "
        "VRAM) through the Eviction API, and hold the freed GPUs for it; with --repack, only "
        "when no move places it (default off; docs/live.md)",
    )
    p.add_argument(
        "--scheduler-config",
        metavar="FILE",
        help="--repack, --preempt: the KubeSchedulerConfiguration of the kube-scheduler that calls vramsched, "
        "so that plans are checked with its profile's NodeResourcesFit ignored resources, "
        "PodTopologySpread default constraints and NodeAffinity added affinity (default: the "
        "defaults, as deploy/ runs it)",
    )
    p.add_argument(
        "--repack-max-moves-per-gpu",
        type=whole(at_least=1),
        default=MOVES_PER_GPU,
        metavar="N",
        help="at most N pods evicted per GPU the pod to place asks: a pod of 2 GPUs may move "
        f"2N (default {MOVES_PER_GPU})",
    )
    p.add_argument(
        "--repack-max-moves-per-pod",
        type=whole(at_least=1),
        default=None,
        metavar="N",
        help="and never more than N pods evicted to place one pod, however many GPUs it asks "
        "(default: no cap beyond --repack-max-moves-per-gpu)",
    )
    p.add_argument(
        "--repack-max-moves-per-minute",
        type=whole(at_least=1),
        default=6,
        metavar="N",
        help="at most N pods evicted by repacking in any 60 seconds (default 6)",
    )
    p.add_argument(
        "--log-level", type=str.lower, default="info", choices=["debug", "info", "warning", "error"]
    )
    webhook.add_arguments(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    setup_logging(args.log_level)
    if args.plan_ahead and not args.planner:
        raise SystemExit("--plan-ahead needs the planner (drop --no-planner)")
    if bool(args.tls_cert) != bool(args.tls_key):
        raise SystemExit("--tls-cert and --tls-key go together")
    if args.leader_lease:
        try:
            parse_lease_name(args.leader_lease)
        except ValueError as exc:
            raise SystemExit(str(exc)) from None
    if args.repack and args.cluster:
        raise SystemExit("--repack needs live mode (--kubeconfig, or in-cluster): it evicts pods")
    if args.preempt and args.cluster:
        raise SystemExit("--preempt needs live mode (--kubeconfig, or in-cluster): it evicts pods")
    webhook.check_arguments(args)
    args.scheduler_profile = _scheduler_profile(args)
    try:
        return _run_loop(_serve(args))
    except KeyboardInterrupt:
        return 0


def _scheduler_profile(args: argparse.Namespace) -> SchedulerProfile:
    """The profile of `--scheduler-config` that schedules `--scheduler-name`'s pods; a file that
    cannot be read, or has no such profile, stops the server before it starts."""
    if not args.scheduler_config:
        return SchedulerProfile(name=args.scheduler_name)
    if not (args.repack or args.preempt):
        raise SystemExit(
            "--scheduler-config is read by --repack and --preempt only: add one or drop it"
        )
    try:
        return load_profile(args.scheduler_config, args.scheduler_name)
    except SchedulerConfigError as exc:
        raise SystemExit(f"--scheduler-config {exc}") from None


def _run_loop(main) -> int:
    """uvloop when installed (libuv transports: less CPU per request on the hot path), else asyncio."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


def _ssl_context(args: argparse.Namespace) -> ssl.SSLContext | None:
    if not args.tls_cert:
        return None
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(args.tls_cert, args.tls_key)
    return ctx


def _replica_policy(args: argparse.Namespace) -> ReplicaPolicy | None:
    """Who picks a time-sliced replica's GPU. No device plugin behind a cluster file: exact
    per-GPU books unless a policy is asked for. Live mode always has one: the stock device
    plugin's `distributed` unless asked otherwise (`--pin-gpus` is `pinned`)."""
    if args.cluster:
        return ReplicaPolicy(args.replica_policy) if args.replica_policy else None
    return ReplicaPolicy.live(args.replica_policy, args.pin_gpus)


async def _serve(args: argparse.Namespace) -> int:
    started = time.monotonic()
    try:  # before anything starts: a bad certificate is the operator's to fix, not a traceback
        tls = _ssl_context(args)
    except (OSError, ssl.SSLError) as exc:
        raise SystemExit(f"--tls-cert/--tls-key: cannot load them: {exc}") from None
    cluster = ClusterState(
        scheduler_name=args.scheduler_name,
        headroom=args.headroom,
        replica_policy=_replica_policy(args),
    )
    planner = _planner(args, cluster)
    repacker: Repacker | None = None
    if args.cluster:
        try:
            # A 100,000-pod file is millions of objects that live as long as the server: collecting
            # while loading them only costs time, and scanning them later costs latency.
            gc.disable()
            try:
                cluster.load(read_cluster_file(args.cluster))
                warm(
                    cluster.ledger
                )  # device arrays, node kinds, per-resource views: before the first request
            finally:
                gc.freeze()
                gc.enable()
        except ClusterFileError as exc:  # names the file
            raise SystemExit(f"cannot load {exc}") from None
        except OSError as exc:
            raise SystemExit(f"cannot load {args.cluster}: {exc.strerror or exc}") from None
        service = ExtenderService(
            cluster,
            EmbeddedBinder(cluster),
            planner=planner,
            legacy_failed_nodes=args.legacy_failed_nodes is not False,
            explain_all=args.explain_all,
        )
        served: Extender = service
        ready = None
        source = None
        leader = None
    else:
        # only live mode needs the Kubernetes client
        from extender.live.api_client import KubeconfigError
        from extender.live.gate import live_service
        from extender.live.source import LiveSource

        try:
            source = LiveSource(cluster, kubeconfig=args.kubeconfig)
        except KubeconfigError as exc:
            raise SystemExit(str(exc)) from None
        nominating: NominatingPlanSource | None = None
        if args.repack or args.preempt:
            from extender.live.nominating import NominatingPlanSource

            repacker = _repacker(args, cluster, source)
            nominating = NominatingPlanSource(repacker, planner)
        served = gate = live_service(
            cluster,
            source,
            assume_ttl=args.assume_ttl,
            planner=nominating or planner,
            explain_all=args.explain_all,
            nominations=nominating,
        )
        service = gate.service
        ready = source.ready
        await source.start()
        leader = _leader(args, source)
        if repacker is not None:
            await _start_repacker(repacker, source, leader)
        service.legacy_failed_nodes = (
            args.legacy_failed_nodes
            if args.legacy_failed_nodes is not None
            else await _legacy_failed_nodes(source)
        )
    if planner is not None:
        await planner.start()
    # Before the verbs: once /readyz answers, the webhook serves too.
    webhook_runner = await webhook.start_webhook(args, cluster)
    app = create_app(
        served,
        max_body_bytes=args.max_body_bytes,
        max_concurrency=args.max_concurrency,
        ready=ready,
        leader=leader.value if leader is not None else None,
    )
    if repacker is not None:
        from extender.live.repack import RepackCollector
        from extender.server import METRICS_KEY

        app[METRICS_KEY].registry.register(RepackCollector(repacker))
    runner = web.AppRunner(app, access_log=None, handle_signals=True)
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port, ssl_context=tls, backlog=1024)
    await start_site(site, "--host/--port", args.host, args.port)
    probe_runner = None
    if args.metrics_port:
        probe_runner = web.AppRunner(create_probe_app(app), access_log=None, handle_signals=False)
        await probe_runner.setup()
        probe = web.TCPSite(probe_runner, args.metrics_host, args.metrics_port)
        await start_site(
            probe, "--metrics-host/--metrics-port", args.metrics_host, args.metrics_port
        )
    a = cluster.ledger.arrays
    log.info(
        "serving",
        extra={
            "fields": {
                "host": args.host,
                "port": args.port,
                "nodes": len(cluster.ledger),
                "devices": len(a.devices),
                "pods": len(cluster.pods),
                "startup_s": round(time.monotonic() - started, 3),
                "mode": "embedded" if args.cluster else "live",
            }
        },
    )
    try:
        while True:
            await asyncio.sleep(3600)
    finally:
        if planner is not None:
            await planner.stop()
        if repacker is not None:
            await repacker.stop()
        if leader is not None:
            leader.stop()
        if source is not None:
            await source.stop()
        if probe_runner is not None:
            await probe_runner.cleanup()
        if webhook_runner is not None:
            await webhook_runner.cleanup()
        await runner.cleanup()


async def _legacy_failed_nodes(source: LiveSource) -> bool:
    """From the API server's version (kube-scheduler runs the control plane's); on when unreadable."""
    from extender.live.versions import needs_legacy_failed_nodes

    try:
        version = await asyncio.to_thread(source.api.server_version)
    except Exception as exc:  # any failure: keep the answer every version reads
        log.warning(
            "cannot read the API server version (%s); listing unresolvable nodes in FailedNodes too",
            exc,
        )
        return True
    legacy = needs_legacy_failed_nodes(version)
    log.info(
        "control plane %s.%s: unresolvable nodes %s in FailedNodes",
        version.get("major"),
        version.get("minor"),
        "also" if legacy else "not",
    )
    return legacy


def _leader(args: argparse.Namespace, source: LiveSource) -> LeaseLeader | None:
    """Polls the leader Lease (extender.observe.leader) through the live source's client."""
    client = getattr(source.api, "client", None)
    if not args.leader_lease or client is None:
        return None
    leader = LeaseLeader(kube_lease_reader(client, *parse_lease_name(args.leader_lease)))
    leader.start()
    return leader


def _planner(args: argparse.Namespace, cluster: ClusterState) -> BackgroundPlanner | None:
    if not args.planner:
        return None
    from extender.planner.background import (
        BackgroundPlanner,
    )  # imports OR-Tools only when asked for

    return BackgroundPlanner(
        cluster,
        time_limit=args.planner_time_limit,
        open_cost=args.open_gpu_cost,
        plan_ahead=args.plan_ahead,
    )


def _repacker(args: argparse.Namespace, cluster: ClusterState, source: LiveSource) -> Repacker:
    """Live repacking (`--repack`) and preemption by VRAM (`--preempt`), started once the source
    runs (`_start_repacker`)."""
    from extender.live.evictions import KubeEvictions
    from extender.live.repack import Repacker
    from extender.planner.repack import plan_repack  # OR-Tools: only when asked for
    from extender.repack_policy import MoveBudget

    return Repacker(
        cluster,
        source.api,
        KubeEvictions(source.api),
        plan=plan_repack,
        budget=MoveBudget(
            args.repack_max_moves_per_gpu,
            args.repack_max_moves_per_minute,
            per_pod=args.repack_max_moves_per_pod,
        ),
        time_limit=args.planner_time_limit,
        open_cost=args.open_gpu_cost,
        profile=args.scheduler_profile,
        repack=args.repack,
        preempt=args.preempt,
    )


async def _start_repacker(
    repacker: Repacker, source: LiveSource, leader: LeaseLeader | None
) -> None:
    """Plans run on the replica whose kube-scheduler leads (always, without a leader Lease), with
    the Eviction version the API server serves."""
    from extender.live.evictions import eviction_version

    if leader is not None:
        repacker.leader = leader.value
    repacker.eviction_version = await asyncio.to_thread(eviction_version, source.api)
    await repacker.start()
