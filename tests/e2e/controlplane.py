"""A real Kubernetes control plane (etcd + kube-apiserver + kube-scheduler 1.20) on loopback.

Why: the extender's contract is with a real kube-scheduler, so the e2e tests run one against a
real API server instead of a fake. No kubelet or controller-manager is needed: Nodes are plain
API objects and binding only writes ``spec.nodeName``. Everything listens on 127.0.0.1, on free
ports, so several test sessions can run side by side.

Binaries come from ``scripts/control-plane/build.sh`` (cached outside the repo); etcd is Debian's
``/usr/bin/etcd``. Facts: /work/shared/reference/real-control-plane.md, docs/control-plane.md.

Usage::

    with ControlPlane(tmp_dir) as cp:
        cp.create_gpu_node("gpu-0", {"nvidia.com/gpu.product": "A100"}, {"nvidia.com/gpu": "8"})
        cp.start_scheduler(ControlPlane.scheduler_config(extender_url="http://127.0.0.1:8888"))
        core = kubernetes.client.CoreV1Api(cp.api_client())

This module deliberately does not import pytest.
"""

from __future__ import annotations

import atexit
import copy
import datetime as _dt
import os
import secrets
import shutil
import signal
import socket
import ssl
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import kubernetes.client
import kubernetes.config
import urllib3
import yaml

T = TypeVar("T")

K8S_VERSION = "1.20.2"
SCHEDULER_API_V1 = "kubescheduler.config.k8s.io/v1"
SCHEDULER_API_V1BETA1 = "kubescheduler.config.k8s.io/v1beta1"
NOT_READY_TAINT = "node.kubernetes.io/not-ready"
REPO_ROOT = Path(__file__).resolve().parents[2]
BUILD_SCRIPT = REPO_ROOT / "scripts" / "control-plane" / "build.sh"

# Transient errors while a component is (re)starting; wait_for keeps polling through them.
TRANSIENT_ERRORS: tuple[type[BaseException], ...] = (
    kubernetes.client.ApiException,
    urllib3.exceptions.HTTPError,
    ConnectionError,
    TimeoutError,
)


def default_bin_dir() -> Path:
    """Where build.sh caches kube-apiserver and kube-scheduler."""
    cache = os.environ.get("VRAMSCHED_CACHE") or str(Path.home() / ".cache" / "vramsched")
    return Path(cache) / f"k8s-{K8S_VERSION}" / "bin"


def build_binaries(timeout: float = 3600.0) -> Path:
    """Run build.sh (a no-op when cached) and return the bin dir; raise with its output on failure."""
    proc = subprocess.run(
        ["bash", str(BUILD_SCRIPT)],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if proc.returncode != 0:
        raise ControlPlaneError(
            f"{BUILD_SCRIPT} failed (exit {proc.returncode}):\n{proc.stdout}{proc.stderr}"
        )
    return default_bin_dir()


class ControlPlaneError(RuntimeError):
    """A component failed to start or a wait timed out; the message carries the log tails."""


def free_port() -> int:
    """A loopback port that is free right now (the OS picks it)."""
    return free_ports(1)[0]


def free_ports(count: int) -> list[int]:
    """``count`` distinct free loopback ports (all held open while picking, so no repeats)."""
    socks = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(count)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


def tail(path: Path, lines: int = 40) -> str:
    """Last lines of a log file, for error messages."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 64 * 1024))
            text = f.read().decode("utf-8", "replace")
    except OSError as exc:
        return f"<cannot read {path}: {exc}>"
    return "\n".join(text.splitlines()[-lines:])


# --- process bookkeeping: nothing may outlive the test session ---------------------------------

_LIVE: dict[int, subprocess.Popen[bytes]] = {}
_LIVE_LOCK = threading.Lock()


def _kill_group(proc: subprocess.Popen[bytes], grace: float = 10.0) -> None:
    """SIGTERM the process group, then SIGKILL it if it lingers."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass
    try:  # children that ignored SIGTERM, or the leader itself
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass
    with _LIVE_LOCK:
        _LIVE.pop(proc.pid, None)


@atexit.register
def _kill_all_at_exit() -> None:
    with _LIVE_LOCK:
        procs = list(_LIVE.values())
    for proc in procs:
        _kill_group(proc, grace=3.0)


class Component:
    """One long-running binary: its own process group, its own log file."""

    def __init__(self, name: str, argv: Sequence[str], log_path: Path) -> None:
        self.name = name
        self.argv = list(argv)
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            stamp = _dt.datetime.now(_dt.UTC).isoformat()
            log.write(f"\n=== {stamp} starting: {' '.join(self.argv)}\n".encode())
            log.flush()
            # setpriv --pdeathsig: the component dies with the test process even on SIGKILL,
            # where atexit never runs. start_new_session: killpg reaches all its children.
            argv = self.argv
            if shutil.which("setpriv"):
                argv = ["setpriv", "--pdeathsig", "KILL", "--", *argv]
            self.proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        with _LIVE_LOCK:
            _LIVE[self.proc.pid] = self.proc

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        if self.proc is not None:
            _kill_group(self.proc)
            self.proc = None

    def describe(self, lines: int = 40) -> str:
        state = "not started"
        if self.proc is not None:
            rc = self.proc.poll()
            state = "running" if rc is None else f"exited with {rc}"
        return f"--- {self.name} ({state}), last lines of {self.log_path}:\n{tail(self.log_path, lines)}"


class ControlPlane:
    """etcd + kube-apiserver (+ optionally kube-scheduler) on 127.0.0.1, rooted in ``workdir``.

    Attributes ready after :meth:`start`: ``server_url``, ``kubeconfig_path`` (admin),
    ``admin_token``, ``ca_path``. Tokens are static (``--token-auth-file``): the admin is in
    ``system:masters``; the scheduler runs as ``system:kube-scheduler`` so the bootstrap RBAC applies.
    """

    def __init__(
        self,
        workdir: Path | str,
        *,
        bin_dir: Path | str | None = None,
        etcd_bin: str | None = None,
        startup_timeout: float = 90.0,
        apiserver_verbosity: int = 1,
        scheduler_verbosity: int = 2,
    ) -> None:
        self.workdir = Path(workdir).resolve()
        self.bin_dir = Path(bin_dir) if bin_dir else default_bin_dir()
        self.etcd_bin = etcd_bin or shutil.which("etcd") or "/usr/bin/etcd"
        self.startup_timeout = startup_timeout
        self.apiserver_verbosity = apiserver_verbosity
        self.scheduler_verbosity = scheduler_verbosity
        self.logs_dir = self.workdir / "logs"
        self.pki_dir = self.workdir / "pki"
        self.etcd_data_dir = self.workdir / "etcd-data"
        self.kubeconfig_path = self.workdir / "admin.kubeconfig"
        self.scheduler_kubeconfig_path = self.workdir / "scheduler.kubeconfig"
        self.ca_path = self.pki_dir / "ca.crt"
        self.admin_token = secrets.token_hex(16)
        self.scheduler_token = secrets.token_hex(16)
        self.etcd_port = 0
        self.etcd_peer_port = 0
        self.apiserver_port = 0
        self.scheduler_healthz_port = 0
        self.scheduler_metrics_port = 0
        self.scheduler_config_path: Path | None = None
        self.etcd: Component | None = None
        self.apiserver: Component | None = None
        self.scheduler: Component | None = None

    # --- lifecycle -----------------------------------------------------------------------------

    def __enter__(self) -> ControlPlane:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def server_url(self) -> str:
        return f"https://127.0.0.1:{self.apiserver_port}"

    def start(self) -> ControlPlane:
        """Start etcd and kube-apiserver, wait for /readyz, write the kubeconfigs."""
        for binary in (self.bin_dir / "kube-apiserver", self.bin_dir / "kube-scheduler"):
            if not os.access(binary, os.X_OK):
                raise ControlPlaneError(f"{binary} missing: run {BUILD_SCRIPT} first")
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._make_pki()
        self._write_token_file()
        try:
            self._start_with_port_retries(self._start_etcd, "etcd")
            self._start_with_port_retries(self._start_apiserver_fresh_port, "kube-apiserver")
        except BaseException:
            self.stop()
            raise
        self._write_kubeconfig(self.kubeconfig_path, "admin", self.admin_token)
        self._write_kubeconfig(
            self.scheduler_kubeconfig_path, "kube-scheduler", self.scheduler_token
        )
        return self

    def stop(self) -> None:
        """Kill every component (scheduler, apiserver, etcd); safe to call twice."""
        for comp in (self.scheduler, self.apiserver, self.etcd):
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
        """Run kube-scheduler 1.20 with a KubeSchedulerConfiguration (YAML text or dict).

        ``kubescheduler.config.k8s.io/v1`` is translated to ``v1beta1`` (what 1.20 reads). The
        client kubeconfig, healthz and metrics addresses are always ours (free loopback ports).
        ``extender_url`` replaces the ``urlPrefix`` of every extender (e.g. the shipped
        config/KubeSchedulerConfiguration.yaml pointed at a test extender's port).
        Leader election is forced off unless ``leader_elect``; with it, the config's lease
        namespace is created and ``system:kube-scheduler`` may use that lease, as deploy/ grants.
        Returns the written config path; the scheduler is up (healthz) when this returns.
        """
        self.stop_scheduler()
        if config is None:
            config = self.scheduler_config()
        doc = yaml.safe_load(config) if isinstance(config, str) else copy.deepcopy(dict(config))
        doc = to_v1beta1(doc)
        if extender_url is not None:
            if not doc.get("extenders"):
                raise ControlPlaneError("extender_url given but the config has no extenders")
            for ext in doc["extenders"]:
                ext["urlPrefix"] = extender_url
        self.scheduler_healthz_port, self.scheduler_metrics_port, secure_port = free_ports(3)
        doc["clientConnection"] = {
            **(doc.get("clientConnection") or {}),
            "kubeconfig": str(self.scheduler_kubeconfig_path),
        }
        doc["healthzBindAddress"] = f"127.0.0.1:{self.scheduler_healthz_port}"
        doc["metricsBindAddress"] = f"127.0.0.1:{self.scheduler_metrics_port}"
        election = dict(doc.get("leaderElection") or {})
        election["leaderElect"] = bool(leader_elect)
        doc["leaderElection"] = election
        if leader_elect:
            self._grant_scheduler_lease(
                election.get("resourceNamespace", "kube-system"),
                election.get("resourceName", "kube-scheduler"),
            )
        self.scheduler_config_path = self.workdir / "kube-scheduler.config.yaml"
        self.scheduler_config_path.write_text(yaml.safe_dump(doc, sort_keys=False))
        argv = [
            str(self.bin_dir / "kube-scheduler"),
            f"--config={self.scheduler_config_path}",
            "--bind-address=127.0.0.1",
            f"--secure-port={secure_port}",
            f"--cert-dir={self.workdir / 'scheduler-certs'}",
            f"--authentication-kubeconfig={self.scheduler_kubeconfig_path}",
            f"--authorization-kubeconfig={self.scheduler_kubeconfig_path}",
            f"--v={self.scheduler_verbosity}",
            *extra_args,
        ]
        self.scheduler = Component("kube-scheduler", argv, self.logs_dir / "kube-scheduler.log")
        self.scheduler.start()
        self._wait_ready(self.scheduler, self._scheduler_healthy)
        return self.scheduler_config_path

    def stop_scheduler(self) -> None:
        if self.scheduler is not None:
            self.scheduler.stop()

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
        return f"http://127.0.0.1:{self.scheduler_metrics_port}/metrics"

    @staticmethod
    def scheduler_config(
        scheduler_name: str = "vramsched",
        *,
        extender_url: str | None = None,
        managed_resources: Sequence[str] = ("nvidia.com/gpu",),
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

    # --- API access ----------------------------------------------------------------------------

    def api_client(self) -> kubernetes.client.ApiClient:
        """A fresh admin ApiClient (from the admin kubeconfig); the caller closes it."""
        return kubernetes.config.new_client_from_config(config_file=str(self.kubeconfig_path))

    def core_v1(self) -> kubernetes.client.CoreV1Api:
        return kubernetes.client.CoreV1Api(self.api_client())

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
        self._write_kubeconfig(path, f"{namespace}-{name}", resp.status.token)
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
                    "kubeletVersion": f"v{K8S_VERSION}",
                    "kubeProxyVersion": f"v{K8S_VERSION}",
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
        return "\n".join(
            c.describe(lines) for c in (self.etcd, self.apiserver, self.scheduler) if c
        )

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
        pki = self.pki_dir
        return [
            str(self.bin_dir / "kube-apiserver"),
            "--advertise-address=127.0.0.1",
            "--bind-address=127.0.0.1",
            f"--secure-port={self.apiserver_port}",
            "--insecure-port=0",
            f"--etcd-servers=http://127.0.0.1:{self.etcd_port}",
            f"--cert-dir={self.workdir / 'apiserver-certs'}",
            f"--tls-cert-file={pki / 'apiserver.crt'}",
            f"--tls-private-key-file={pki / 'apiserver.key'}",
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
            f"--service-account-key-file={pki / 'sa.pub'}",
            f"--service-account-signing-key-file={pki / 'sa.key'}",
            "--service-cluster-ip-range=10.0.0.0/24",
            "--disable-admission-plugins=ServiceAccount",
            "--allow-privileged=true",
            "--profiling=false",
            f"--v={self.apiserver_verbosity}",
        ]

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
        return _http_ok(f"http://127.0.0.1:{self.etcd_port}/health")

    def _apiserver_ready(self) -> bool:
        ctx = ssl.create_default_context(cafile=str(self.ca_path))
        return _http_ok(f"{self.server_url}/readyz", token=self.admin_token, context=ctx)

    def _scheduler_healthy(self) -> bool:
        return _http_ok(f"http://127.0.0.1:{self.scheduler_healthz_port}/healthz")

    def _make_pki(self) -> None:
        """CA, apiserver serving cert (SAN 127.0.0.1/localhost) and service-account key pair."""
        pki = self.pki_dir
        if (pki / "sa.pub").exists():
            return
        pki.mkdir(parents=True, exist_ok=True)

        def openssl(*args: str) -> None:
            proc = subprocess.run(
                ["openssl", *args], cwd=pki, capture_output=True, text=True, check=False
            )
            if proc.returncode != 0:
                raise ControlPlaneError(f"openssl {' '.join(args)} failed:\n{proc.stderr}")

        openssl(
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            "ca.key",
            "-out",
            "ca.crt",
            "-days",
            "3650",
            "-subj",
            "/CN=vramsched-e2e-ca",
        )
        openssl(
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            "apiserver.key",
            "-out",
            "apiserver.csr",
            "-subj",
            "/CN=kube-apiserver",
        )
        (pki / "apiserver.ext").write_text(
            "subjectAltName=IP:127.0.0.1,IP:10.0.0.1,DNS:localhost,DNS:kubernetes,"
            "DNS:kubernetes.default,DNS:kubernetes.default.svc\n"
            "extendedKeyUsage=serverAuth\nkeyUsage=digitalSignature,keyEncipherment\n"
        )
        openssl(
            "x509",
            "-req",
            "-in",
            "apiserver.csr",
            "-CA",
            "ca.crt",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            "apiserver.crt",
            "-days",
            "3650",
            "-extfile",
            "apiserver.ext",
        )
        openssl("genrsa", "-out", "sa.key", "2048")
        openssl("rsa", "-in", "sa.key", "-pubout", "-out", "sa.pub")

    def _write_token_file(self) -> None:
        path = self.workdir / "tokens.csv"
        path.write_text(
            f'{self.admin_token},admin,admin-uid,"system:masters"\n'
            f"{self.scheduler_token},system:kube-scheduler,kube-scheduler-uid\n"
        )
        path.chmod(0o600)

    def _write_kubeconfig(self, path: Path, user: str, token: str) -> None:
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
            "users": [{"name": user, "user": {"token": token}}],
            "contexts": [{"name": user, "context": {"cluster": "e2e", "user": user}}],
            "current-context": user,
        }
        path.write_text(yaml.safe_dump(doc, sort_keys=False))
        path.chmod(0o600)


# --- helpers -----------------------------------------------------------------------------------


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
        raise ControlPlaneError(f"kube-scheduler 1.20 cannot read apiVersion {api!r}")
    out["apiVersion"] = SCHEDULER_API_V1BETA1
    out.setdefault("kind", "KubeSchedulerConfiguration")
    out.pop("delayCacheUntilActive", None)
    percentages = set()
    for profile in out.get("profiles") or []:
        if "percentageOfNodesToScore" in profile:
            percentages.add(profile.pop("percentageOfNodesToScore"))
        if "multiPoint" in (profile.get("plugins") or {}):
            raise ControlPlaneError("plugins.multiPoint does not exist in kube-scheduler 1.20")
        for plugin_cfg in profile.get("pluginConfig") or []:
            args = plugin_cfg.get("args")
            if isinstance(args, dict) and args.get("apiVersion") == SCHEDULER_API_V1:
                args["apiVersion"] = SCHEDULER_API_V1BETA1
    if len(percentages) > 1:
        raise ControlPlaneError(
            f"profiles disagree on percentageOfNodesToScore {sorted(percentages)}; "
            "1.20 has only the global setting"
        )
    if percentages and "percentageOfNodesToScore" not in out:
        out["percentageOfNodesToScore"] = percentages.pop()
    return out


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


def _http_ok(url: str, token: str | None = None, context: ssl.SSLContext | None = None) -> bool:
    req = urllib.request.Request(url)
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=2, context=context) as resp:
            return bool(resp.status == 200)
    except (urllib.error.URLError, OSError, ValueError):
        return False
