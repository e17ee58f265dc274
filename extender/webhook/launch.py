"""`vramsched serve --webhook-port ...`: the flags, and starting the listener next to the extender."""

from __future__ import annotations

import argparse
import asyncio
import logging
import ssl

from aiohttp import web

from extender.cluster import ClusterState
from extender.commands.argtypes import PORT
from extender.live.api_client import KubeconfigError, load_client
from extender.server import start_site
from extender.webhook.admission import LargestDevice
from extender.webhook.certs import service_hosts
from extender.webhook.server import create_webhook_app, ssl_context

__all__ = ["add_arguments", "check_arguments", "start_webhook", "largest_device"]

log = logging.getLogger("extender.webhook")


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("admission webhook (docs/sizing.md)")
    g.add_argument(
        "--webhook-port",
        type=PORT,
        default=0,
        help="serve POST /mutate over TLS on this port; 0 = off",
    )
    g.add_argument(
        "--webhook-host",
        default="0.0.0.0",
        help="listen address of the webhook (default all interfaces)",
    )
    g.add_argument("--webhook-cert", metavar="FILE", help="serving certificate (PEM)")
    g.add_argument("--webhook-key", metavar="FILE", help="its private key (PEM)")
    g.add_argument(
        "--webhook-secret",
        metavar="NAMESPACE/NAME",
        help="instead of files: keep a self-signed CA + certificate in this Secret, made at start-up if absent",
    )
    g.add_argument(
        "--webhook-service",
        metavar="NAME.NAMESPACE",
        help="the Service kube-apiserver calls: its DNS names go into the generated certificate",
    )
    g.add_argument(
        "--webhook-hosts",
        default="",
        help="more names or IPs for the generated certificate, comma-separated",
    )
    g.add_argument(
        "--webhook-configuration",
        metavar="NAME",
        help="MutatingWebhookConfiguration whose caBundle gets the generated CA",
    )


def _hosts(args: argparse.Namespace) -> list[str]:
    hosts = service_hosts(args.webhook_service) if args.webhook_service else []
    hosts += [h.strip() for h in args.webhook_hosts.split(",") if h.strip()]
    return hosts


def check_arguments(args: argparse.Namespace) -> None:
    """One-line SystemExit for a flag combination that cannot work."""
    if not args.webhook_port:
        return
    files = bool(args.webhook_cert) + bool(args.webhook_key)
    if files == 1:
        raise SystemExit("--webhook-cert and --webhook-key go together")
    if files == 0 and not args.webhook_secret:
        raise SystemExit("--webhook-port needs --webhook-cert/--webhook-key or --webhook-secret")
    if args.webhook_secret:
        if getattr(args, "cluster", None):
            raise SystemExit(
                "--webhook-secret needs the live mode (a cluster API to keep the Secret in)"
            )
        if "/" not in args.webhook_secret:
            raise SystemExit("--webhook-secret is NAMESPACE/NAME")
        try:
            if not _hosts(args):
                raise SystemExit(
                    "--webhook-secret needs --webhook-service or --webhook-hosts (the certificate's names)"
                )
        except ValueError as exc:
            raise SystemExit(f"--webhook-service: {exc}") from None


class _LargestDevice:
    """The largest memory one pod may hold on a device of the ledger now (None before any GPU
    node), for the webhook's "fits no GPU" warning.

    Called on every GPU pod created, on the extender's event loop: a loop over every device cost
    ~18 ms at 5,000 nodes x 8 GPUs. The answer depends on labels only, and the ledger replaces its
    device arrays whenever a node's devices change (added, removed, relabelled), so it is kept
    with the arrays it was read from and recomputed, with one numpy max, only for new ones.
    """

    __slots__ = ("_cluster", "_arrays", "_answer")

    def __init__(self, cluster: ClusterState) -> None:
        self._cluster = cluster
        self._arrays: object = None
        self._answer: int | None = None

    def __call__(self) -> int | None:
        a = self._cluster.ledger.arrays
        if a is not self._arrays:
            cap = a.per_pod_cap
            self._answer = int(cap.max()) if len(cap) else None
            self._arrays = a
        return self._answer


def largest_device(cluster: ClusterState) -> LargestDevice:
    """A callable: the largest device memory in the ledger now (None before any GPU node)."""
    return _LargestDevice(cluster)


async def _bootstrap(args: argparse.Namespace) -> ssl.SSLContext:
    from extender.webhook.bootstrap import ensure_serving_cert, patch_ca_bundle

    namespace, name = args.webhook_secret.split("/", 1)
    client = load_client(getattr(args, "kubeconfig", None))
    cert = await asyncio.to_thread(ensure_serving_cert, client, namespace, name, _hosts(args))
    if args.webhook_configuration:
        await asyncio.to_thread(patch_ca_bundle, client, args.webhook_configuration, cert.ca_pem)
    return ssl_context(cert=cert)


async def start_webhook(args: argparse.Namespace, cluster: ClusterState) -> web.AppRunner | None:
    """Start the listener when --webhook-port is set; the runner to clean up, or None."""
    if not args.webhook_port:
        return None
    try:
        if args.webhook_secret:
            ctx = await _bootstrap(args)
        else:
            ctx = ssl_context(cert_file=args.webhook_cert, key_file=args.webhook_key)
    except (OSError, ssl.SSLError, KubeconfigError) as exc:
        raise SystemExit(f"webhook certificate: {exc}") from None
    except Exception as exc:  # an API error while bootstrapping: one line, then exit
        reason = getattr(exc, "reason", None) or type(exc).__name__
        status = getattr(exc, "status", None)
        raise SystemExit(f"webhook certificate: {status or ''} {reason}".strip()) from None
    app = create_webhook_app(
        scheduler_name=args.scheduler_name, largest_device=largest_device(cluster)
    )
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, args.webhook_host, args.webhook_port, ssl_context=ctx)
    await start_site(site, "--webhook-host/--webhook-port", args.webhook_host, args.webhook_port)
    log.info(
        "webhook serving", extra={"fields": {"host": args.webhook_host, "port": args.webhook_port}}
    )
    return runner
