"""`vramsched device-plugin`: the kubelet device plugin that hands each container the GPUs
vramsched assigned it (extender.device_plugin; docs/device-plugin.md)."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from extender.commands.argtypes import PORT, whole
from extender.inventory import MAX_DEVICES_PER_NODE, MAX_REPLICAS, replicas_label
from extender.logs import setup_logging

log = logging.getLogger("extender.device_plugin")

REPLICAS_LABEL = "nvidia.com/gpu.replicas"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "device-plugin",
        help="run the kubelet device plugin that gives containers vramsched's GPUs",
        description="Advertises nvidia.com/gpu (GPUs x replicas) to the kubelet and answers each "
        "Allocate with exactly the GPUs of the pod's vramsched.io/assignment.",
    )
    p.add_argument(
        "--node-name",
        default=os.environ.get("NODE_NAME") or "",
        help="this node's name (default $NODE_NAME; the DaemonSet sets it from spec.nodeName)",
    )
    p.add_argument("--kubeconfig", metavar="PATH", help="default: in-cluster config")
    p.add_argument(
        "--replicas",
        type=whole(at_least=0, at_most=MAX_REPLICAS),
        default=0,
        help=f"time-slicing replicas per GPU (default: the node's {REPLICAS_LABEL} label, else 1)",
    )
    p.add_argument("--resource-name", default="nvidia.com/gpu")
    p.add_argument(
        "--device-list-strategy",
        default="envvar",
        help="how a container is told its GPUs, as NVIDIA's plugin: envvar, volume-mounts, "
        "cdi-annotations, cdi-cri, or a comma list (default envvar)",
    )
    p.add_argument(
        "--fake-gpus",
        type=whole(at_least=0, at_most=MAX_DEVICES_PER_NODE),
        default=0,
        help="N made-up GPUs instead of NVML (tests)",
    )
    p.add_argument(
        "--fake-memory-mib", type=whole(at_least=1), default=81920, help="memory of each fake GPU"
    )
    p.add_argument(
        "--fake-unhealthy",
        default="",
        help="comma list of fake GPU indices reported unhealthy at start (tests)",
    )
    p.add_argument("--device-plugin-dir", default="/var/lib/kubelet/device-plugins")
    p.add_argument("--pod-resources-socket", default="/var/lib/kubelet/pod-resources/kubelet.sock")
    p.add_argument(
        "--socket-name",
        default="vramsched-gpu.sock",
        help="our socket's name in --device-plugin-dir",
    )
    p.add_argument(
        "--probe-port",
        type=PORT,
        default=0,
        help="serve GET /healthz, /readyz (registered) and /metrics on this port; 0 = off",
    )
    p.add_argument("--probe-host", default="0.0.0.0")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.set_defaults(run=run)


def _fail(message: str) -> int:
    print(f"vramsched device-plugin: {message}", file=sys.stderr)
    return 2


def replicas_to_serve(flag: int, node: Any) -> int:
    """`--replicas`, or (0) the node's replicas label as the scheduler reads it; ValueError
    naming the label where the scheduler would refuse the node for it (`int()` took `1_6`,
    and a label of millions would have been advertised to the kubelet as so many devices)."""
    metadata = node.get("metadata") if isinstance(node, dict) else None
    labels = (metadata.get("labels") if isinstance(metadata, dict) else None) or {}
    label = labels.get(REPLICAS_LABEL) if isinstance(labels, dict) else None
    if not flag:
        try:
            return replicas_label({REPLICAS_LABEL: label} if label else {})
        except ValueError as exc:
            raise ValueError(f"node {exc}; pass --replicas") from None
    if label and label != str(flag):
        log.warning(
            "--replicas differs from the node's label: vramsched books by the label",
            extra={"fields": {"replicas": flag, "label": label}},
        )
    return flag


def run(args: argparse.Namespace) -> int:
    setup_logging(args.log_level)
    from extender.device_plugin.gpus import FakeGpus, GpuSourceError, NvmlGpus
    from extender.device_plugin.kubelet import PodResources
    from extender.device_plugin.pods import NodeApi, NodePods
    from extender.device_plugin.server import DevicePluginService, PluginRunner
    from extender.device_plugin.specs import parse_strategies
    from extender.live.api_client import ApiError, ClientApi, KubeconfigError

    if not args.node_name:
        return _fail("--node-name (or $NODE_NAME) is required")
    try:
        strategies = parse_strategies(args.device_list_strategy)
    except ValueError as exc:
        return _fail(str(exc))
    try:
        unhealthy = [int(i) for i in args.fake_unhealthy.split(",") if i.strip()]
    except ValueError:
        return _fail(f"--fake-unhealthy {args.fake_unhealthy!r} is not a comma list of indices")
    try:
        source: Any = (
            FakeGpus(args.node_name, args.fake_gpus, args.fake_memory_mib, unhealthy)
            if args.fake_gpus
            else NvmlGpus()
        )
        gpus = source.gpus()
    except GpuSourceError as exc:
        return _fail(str(exc))
    if not gpus:
        return _fail("no GPU found")
    try:
        client = ClientApi(args.kubeconfig)
    except KubeconfigError as exc:
        return _fail(str(exc))
    api = NodeApi(client, args.node_name)
    try:
        node = api.read_node()
    except ApiError as exc:
        return _fail(f"cannot read node {args.node_name}: {exc}")
    try:
        replicas = replicas_to_serve(args.replicas, node)
    except ValueError as exc:
        return _fail(str(exc))
    pods = NodePods(api)
    pods.start()
    if not pods.wait_synced(60):
        log.warning("pods of this node not listed yet; Allocate reads them from the API meanwhile")
    service = DevicePluginService(
        node=args.node_name,
        gpus=gpus,
        replicas=replicas,
        strategies=strategies,
        kubelet_pods=PodResources(args.pod_resources_socket, args.resource_name).list,
        lookup=pods.snapshot,
        reread=pods.read,
        resource=args.resource_name,
    )
    pods.on_api_read = service.metrics.api_reads.inc
    runner = PluginRunner(
        service,
        plugin_dir=Path(args.device_plugin_dir),
        socket_name=args.socket_name,
        source=source,
        publish=api.publish,
    )
    log.info(
        "vramsched device plugin starting",
        extra={
            "fields": {
                "node": args.node_name,
                "gpus": [g.uuid for g in gpus],
                "replicas": replicas,
                "strategy": list(strategies),
                "fake": bool(args.fake_gpus),
            }
        },
    )
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: runner.stop())
    probes = _probes(args, runner) if args.probe_port else None
    try:
        runner.run()
    finally:
        pods.stop()
        if probes is not None:
            probes.shutdown()
    return 0


def _probes(args: argparse.Namespace, runner: Any) -> ThreadingHTTPServer:
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    registry = runner.service.metrics.registry

    class Probe(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # http.server's spelling
            if self.path == "/healthz":
                code, body, kind = 200, b"ok\n", "text/plain"
            elif self.path == "/readyz":
                ok = runner.registered
                code, body, kind = (
                    (200 if ok else 503),
                    (b"registered\n" if ok else b"not registered\n"),
                    "text/plain",
                )
            elif self.path == "/metrics":
                code, body, kind = 200, generate_latest(registry), CONTENT_TYPE_LATEST
            else:
                code, body, kind = 404, b"not found\n", "text/plain"
            self.send_response(code)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a: Any) -> None:
            pass

    family = socket.AF_INET6 if ":" in args.probe_host else socket.AF_INET
    ThreadingHTTPServer.address_family = family
    server = ThreadingHTTPServer((args.probe_host, args.probe_port), Probe)
    threading.Thread(target=server.serve_forever, name="probes", daemon=True).start()
    return server
