"""A real node for e2e tests: containerd 1.6 + runc + kubelet 1.36.3, beside a 1.36.3 control plane.

Why: vramsched's device plugin talks to the kubelet's device manager and PodResources API; only a
real kubelet admitting real pods proves that each container gets the GPUs vramsched booked. A
kubelet may not be newer than its API server, so this module also runs the control plane at
1.36.3 (`ControlPlane136`: controlplane.py's ControlPlane at version 1.36.3).

Facts behind each setting (this kind of machine): cgroup v1 with the cgroupfs driver and
`failCgroupV1: false`; containerd must `restrict_oom_score_adj` (the VM refuses negative scores);
no registry, so the images are built here from Debian's busybox-static and imported with `ctr`;
a bridge CNI network in a folder of our own. Everything the kubelet and containerd keep lives in
one work folder, except what the kubelet insists on: the device-plugin folder
/var/lib/kubelet/device-plugins (a constant in the kubelet), a few sysctls it sets
(vm.overcommit_memory, kernel.panic, kernel.panic_on_oops; the bridge sets net.ipv4.ip_forward),
cgroup folders and the bridge; containerd adds network namespaces (/run/netns/cni-*) with a veth
pair each, runc state (/run/containerd/runc) and shim sockets (/run/containerd/s). `KubeletNode`
records the host before it starts (`HostState`); `stop` removes what the run added and
`check_host` raises when the host does not match the record.

Binaries: scripts/control-plane/unpack.sh (cache ~/.cache/vramsched/k8s-1.36.3/bin), packages:
scripts/node/deps.sh. This module does not import pytest.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import signal
import subprocess
import tarfile
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import kubernetes.client
import yaml
from controlplane import (
    REPO_ROOT,
    Component,
    ControlPlane,
    ControlPlaneError,
    build_binaries,
    free_ports,
    tail,
)
from releases import ReleaseError, run_script

K8S_136 = "1.36.3"
BUSYBOX_IMAGE = "docker.io/library/busybox:vramsched-e2e"
PAUSE_IMAGE = "docker.io/library/pause:vramsched-e2e"
DEVICE_PLUGIN_DIR = Path("/var/lib/kubelet/device-plugins")
SYSCTLS = ("vm/overcommit_memory", "kernel/panic", "kernel/panic_on_oops", "net/ipv4/ip_forward")
BRIDGE = "vramsched0"
CNI_SUBNET = "10.223.0.0/24"
NETNS_DIR = Path("/run/netns")  # containerd's CRI keeps each sandbox's netns here (cni-<uuid>)
CONTAINERD_RUN = Path("/run/containerd")  # runc's state and the shims' sockets, whatever the config
CHECKPOINT = DEVICE_PLUGIN_DIR / "kubelet_internal_checkpoint"


def node_binaries(timeout: float = 900) -> Path:
    """Install the node packages and unpack the 1.36.3 binaries (no-ops when done); the bin dir."""
    try:
        run_script(REPO_ROOT / "scripts" / "node" / "deps.sh", timeout)
    except ReleaseError as exc:
        raise ControlPlaneError(str(exc)) from exc
    return build_binaries(K8S_136, timeout=timeout)


class ControlPlane136(ControlPlane):
    """The harness's 1.36.3 control plane (``ControlPlane(version="1.36.3")``: etcd 3.5, the
    flags 1.36 wants, the scheduler config read as ``kubescheduler.config.k8s.io/v1``), with
    the node's packages installed first."""

    def __init__(self, workdir: Path | str, **kwargs: Any) -> None:
        node_binaries()
        super().__init__(workdir, version=K8S_136, **kwargs)


# ----- images: no registry, so built from busybox-static ------------------------------------------


def _busybox_layer() -> bytes:
    busybox = shutil.which("busybox") or "/bin/busybox"
    applets = subprocess.run(
        [busybox, "--list"], capture_output=True, text=True, check=True
    ).stdout.split()
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for d in ("bin", "tmp", "etc", "proc", "sys", "dev", "var", "var/run"):
            info = tarfile.TarInfo(d)
            info.type, info.mode = tarfile.DIRTYPE, 0o1777 if d == "tmp" else 0o755
            tar.addfile(info)
        tar.add(busybox, arcname="bin/busybox")
        for applet in applets:
            if applet == "busybox":
                continue
            info = tarfile.TarInfo(f"bin/{applet}")
            info.type, info.linkname = tarfile.SYMTYPE, "busybox"
            tar.addfile(info)
    return buf.getvalue()


def image_archive(path: Path) -> Path:
    """A docker-archive with two tags on one busybox layer: a shell image and a pause image
    (a shell that sleeps until told to stop) for containerd's `sandbox_image`."""
    layer = _busybox_layer()
    layer_id = hashlib.sha256(layer).hexdigest()
    configs = {
        BUSYBOX_IMAGE: {"Cmd": ["sh"], "Env": ["PATH=/bin"]},
        PAUSE_IMAGE: {
            "Entrypoint": [
                "/bin/sh",
                "-c",
                "trap 'exit 0' TERM INT; while :; do sleep 3600 & wait $!; done",
            ],
            "Env": ["PATH=/bin"],
        },
    }
    manifest = []
    with tarfile.open(path, "w") as tar:

        def add(name: str, data: bytes) -> None:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))

        add(f"{layer_id}/layer.tar", layer)
        for tag, cfg in configs.items():
            body = json.dumps(
                {
                    "architecture": "amd64",
                    "os": "linux",
                    "config": cfg,
                    "rootfs": {"type": "layers", "diff_ids": [f"sha256:{layer_id}"]},
                }
            ).encode()
            name = hashlib.sha256(body).hexdigest() + ".json"
            add(name, body)
            manifest.append(
                {"Config": name, "RepoTags": [tag], "Layers": [f"{layer_id}/layer.tar"]}
            )
        add("manifest.json", json.dumps(manifest).encode())
    return path


# ----- what the node changes on the host ---------------------------------------------------------------


def _links(*kind: str) -> frozenset[str]:
    out = subprocess.run(
        ["ip", "-o", "link", "show", *(("type", *kind) if kind else ())],
        capture_output=True,
        text=True,
        check=False,
    ).stdout
    return frozenset(line.split(":")[1].strip().split("@")[0] for line in out.splitlines() if line)


def _tree(root: Path) -> frozenset[str]:
    if not root.exists():
        return frozenset()
    return frozenset([str(root), *(str(p) for p in root.rglob("*"))])


def _mounts(prefixes: tuple[str, ...]) -> frozenset[str]:
    return frozenset(
        target
        for line in Path("/proc/self/mountinfo").read_text().splitlines()
        if (target := line.split()[4]).startswith(prefixes)
    )


def _cgroups() -> frozenset[str]:
    root = Path("/sys/fs/cgroup")
    return frozenset(
        str(controller / top)
        for controller in (root.iterdir() if root.exists() else ())
        for top in ("kubepods", "kubepods.slice", "k8s.io")
        if (controller / top).is_dir()
    )


def _pod_processes() -> frozenset[str]:
    """Processes in a pod's cgroup: containers that outlived their node."""
    out = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cgroup = (proc / "cgroup").read_text()
            comm = (proc / "comm").read_text().strip()
        except OSError:
            continue
        if "/kubepods" in cgroup:
            out.add(f"{proc.name} ({comm})")
    return frozenset(out)


@dataclass(frozen=True)
class HostState:
    """What a kubelet node run may change on the host, as one record to compare."""

    netns: frozenset[str]
    veths: frozenset[str]
    links: frozenset[str]
    containerd_run: frozenset[str]
    mounts: frozenset[str]
    cgroups: frozenset[str]
    pod_processes: frozenset[str]
    device_plugin_dir: frozenset[str]
    sysctls: tuple[tuple[str, str], ...]

    @classmethod
    def capture(cls, workdir: Path) -> HostState:
        sysctls = []
        for key in SYSCTLS:
            path = Path("/proc/sys") / key
            if path.exists():
                sysctls.append((key, path.read_text().strip()))
        return cls(
            netns=_tree(NETNS_DIR),
            veths=_links("veth"),
            links=_links(),
            containerd_run=_tree(CONTAINERD_RUN),
            mounts=_mounts(
                (str(NETNS_DIR), str(CONTAINERD_RUN), str(DEVICE_PLUGIN_DIR.parent), str(workdir))
            ),
            cgroups=_cgroups(),
            pod_processes=_pod_processes(),
            device_plugin_dir=_tree(DEVICE_PLUGIN_DIR.parent),
            sysctls=tuple(sysctls),
        )

    def differences(self, now: HostState) -> list[str]:
        """One line per field that differs: what `now` has that this record has not, and back."""
        out = []
        for name in self.__dataclass_fields__:
            before, after = getattr(self, name), getattr(now, name)
            if before == after:
                continue
            if isinstance(before, frozenset):
                added, gone = sorted(after - before), sorted(before - after)
                out.append(f"{name}: added {added[:12]}, removed {gone[:12]}")
            else:
                out.append(f"{name}: was {before}, now {after}")
        return out


# ----- the node ----------------------------------------------------------------------------------------


class KubeletNode:
    """containerd + kubelet registered as node `name` with the control plane `cp`, rooted in
    `workdir`. `start()` returns once the node is Ready and schedulable; `stop()` undoes what
    the kubelet changed on the host (module docstring)."""

    def __init__(
        self,
        cp: ControlPlane,
        workdir: Path,
        name: str = "kubelet-node",
        *,
        read_only_port: bool = False,
    ) -> None:
        """`read_only_port`: also serve the kubelet's unauthenticated read-only port on
        127.0.0.1 (`read_only_port` attribute), e.g. for its /metrics in a benchmark."""
        self.cp = cp
        self.workdir = Path(workdir).resolve()
        self.name = name
        self.root = self.workdir / "kubelet-root"
        self.logs = self.workdir / "pod-logs"
        self.containerd_dir = self.workdir / "containerd"
        self.socket = self.containerd_dir / "containerd.sock"
        self.bin_dir = node_binaries()
        self.containerd: Component | None = None
        self.kubelet: Component | None = None
        self._sysctls: dict[str, str] = {}
        self._made: list[Path] = []  # folders of the device-plugin path we created
        self.kubelet_port = 0
        self.read_only_port = free_ports(1)[0] if read_only_port else 0
        self.host_before: HostState | None = None  # the host before start()
        self.host_problems: list[str] = []  # what stop() could not put back

    # --- lifecycle ----------------------------------------------------------------------------
    def start(self, timeout: float = 120) -> KubeletNode:
        self.host_before = HostState.capture(self.workdir)
        self._save_sysctls()
        for folder in (DEVICE_PLUGIN_DIR.parent, DEVICE_PLUGIN_DIR):
            if not folder.exists():
                folder.mkdir()
                self._made.insert(0, folder)
        try:
            self._start_containerd()
            self._import_images()
            self.start_kubelet()
            self.wait_ready(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _start_containerd(self) -> None:
        d = self.containerd_dir
        cni = self.workdir / "cni"
        for sub in (d / "root", d / "state", cni):
            sub.mkdir(parents=True, exist_ok=True)
        (cni / "10-vramsched.conflist").write_text(
            json.dumps(
                {
                    "cniVersion": "0.4.0",
                    "name": "vramsched-e2e",
                    "plugins": [
                        {
                            "type": "bridge",
                            "bridge": BRIDGE,
                            "isGateway": True,
                            "ipMasq": False,
                            "ipam": {
                                "type": "host-local",
                                "ranges": [[{"subnet": CNI_SUBNET}]],
                                "dataDir": str(self.workdir / "cni-ipam"),
                            },
                        },
                        {"type": "loopback"},
                    ],
                }
            )
        )
        config = d / "config.toml"
        config.write_text(
            f"""version = 2
root = "{d / "root"}"
state = "{d / "state"}"
disabled_plugins = ["io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs",
  "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.devmapper"]
[grpc]
  address = "{self.socket}"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{PAUSE_IMAGE}"
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "{cni}"
"""
        )
        self.containerd = Component(
            "containerd", ["containerd", "--config", str(config)], self.workdir / "containerd.log"
        )
        self.containerd.start()
        self.cp.wait_for(
            lambda: self._ctr("version").returncode == 0,
            timeout=30,
            message=f"containerd up\n{self.containerd.describe()}",
            ignore=(OSError,),
        )

    def _ctr(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["ctr", "--address", str(self.socket), "-n", "k8s.io", *args],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )

    def _import_images(self) -> None:
        archive = image_archive(self.workdir / "images.tar")
        proc = self._ctr("images", "import", str(archive))
        if proc.returncode != 0:
            raise ControlPlaneError(f"ctr images import failed: {proc.stderr}")

    def start_kubelet(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self.logs.mkdir(parents=True, exist_ok=True)
        port, healthz = free_ports(2)
        self.kubelet_port = port
        config = self.workdir / "kubelet-config.yaml"
        config.write_text(
            yaml.safe_dump(
                {
                    "apiVersion": "kubelet.config.k8s.io/v1beta1",
                    "kind": "KubeletConfiguration",
                    "cgroupDriver": "cgroupfs",
                    "failCgroupV1": False,
                    "failSwapOn": False,
                    "address": "127.0.0.1",
                    "port": port,
                    "readOnlyPort": self.read_only_port,
                    "healthzBindAddress": "127.0.0.1",
                    "healthzPort": healthz,
                    "authentication": {
                        "anonymous": {"enabled": False},
                        "webhook": {"enabled": False},
                    },
                    "authorization": {"mode": "AlwaysAllow"},
                    "makeIPTablesUtilChains": False,
                    "nodeStatusUpdateFrequency": "1s",
                    "nodeStatusReportFrequency": "1s",
                    "syncFrequency": "5s",
                    "fileCheckFrequency": "5s",
                    "evictionHard": {
                        "memory.available": "1Mi",
                        "nodefs.available": "1%",
                        "imagefs.available": "1%",
                        "nodefs.inodesFree": "1%",
                    },
                    "imageGCHighThresholdPercent": 100,
                    "imageGCLowThresholdPercent": 99,
                    "podLogsDir": str(self.logs),
                    "containerRuntimeEndpoint": f"unix://{self.socket}",
                    "serializeImagePulls": False,
                    "maxPods": 110,
                }
            )
        )
        self.kubelet = Component(
            "kubelet",
            [
                str(self.bin_dir / "kubelet"),
                f"--config={config}",
                f"--kubeconfig={self.cp.kubeconfig_path}",
                f"--root-dir={self.root}",
                f"--cert-dir={self.workdir / 'kubelet-pki'}",
                f"--hostname-override={self.name}",
                "--v=2",
            ],
            self.workdir / "kubelet.log",
        )
        self.kubelet.start()

    def stop_kubelet(self) -> None:
        if self.kubelet is not None:
            self.kubelet.stop()

    def restart_kubelet(self, *, kill: bool = False) -> None:
        """Stop the kubelet (SIGTERM; `kill`: SIGKILL, so no shutdown path runs) and start it
        again on the same root: it keeps its device checkpoint, and clears the device-plugin
        folder's sockets as it starts."""
        if kill and self.kubelet is not None:
            self.kubelet.kill()
        else:
            self.stop_kubelet()
        self.start_kubelet()

    def device_checkpoint(self, resource: str) -> dict[tuple[str, str], list[str]]:
        """The kubelet's own record of what it allocated (its device manager checkpoint, which
        also holds plain init containers, unlike PodResources): (pod UID, container) -> IDs."""
        data = json.loads(CHECKPOINT.read_text())["Data"]
        out: dict[tuple[str, str], list[str]] = defaultdict(list)
        for entry in data.get("PodDeviceEntries") or []:
            if entry.get("ResourceName") != resource:
                continue
            ids = entry.get("DeviceIDs") or {}
            for per_numa in ids.values() if isinstance(ids, dict) else [ids]:
                out[(entry["PodUID"], entry["ContainerName"])] += per_numa
        return dict(out)

    def wait_ready(self, timeout: float = 120) -> None:
        with self.cp.api_client() as client:
            core = kubernetes.client.CoreV1Api(client)

            def ready() -> bool:
                if self.kubelet is None or not self.kubelet.running():
                    raise ControlPlaneError(f"kubelet exited\n{self.describe()}")
                node = core.read_node(self.name)
                ok = any(
                    c.type == "Ready" and c.status == "True" for c in node.status.conditions or []
                )
                if ok:
                    self.cp._untaint_not_ready(core, self.name)
                    node = core.read_node(self.name)
                return ok and not any(
                    t.key == "node.kubernetes.io/not-ready" for t in node.spec.taints or []
                )

            self.cp.wait_for(
                ready, timeout=timeout, message=f"node {self.name} Ready\n{self.describe()}"
            )

    def stop(self) -> None:
        """Kubelet, containers, containerd (each by the process we started), then the host."""
        self.stop_kubelet()  # first: it would start the containers again
        if self.containerd is not None and self.containerd.running():
            for task in self._ctr("tasks", "ls", "-q").stdout.split():
                self._ctr("tasks", "kill", "-s", "SIGKILL", task)
            time.sleep(0.5)
            for task in self._ctr("tasks", "ls", "-q").stdout.split():
                self._ctr("tasks", "delete", "-f", task)
        if self.containerd is not None:
            self.containerd.stop()
        self._kill_shims()
        self._unmount()
        subprocess.run(["ip", "link", "delete", BRIDGE], capture_output=True, check=False)
        self._restore_sysctls()
        self._remove_cgroups()
        # the kubelet's checkpoint and sockets go; folders only if we made them
        for entry in DEVICE_PLUGIN_DIR.glob("*"):
            if entry.is_socket() or entry.name == "kubelet_internal_checkpoint":
                entry.unlink(missing_ok=True)
        for folder in self._made:
            try:
                folder.rmdir()
            except OSError:
                pass
        if self.host_before is not None:
            self.host_problems = self._settle(self.host_before)

    def _settle(self, before: HostState, timeout: float = 20) -> list[str]:
        """Remove what the run added until the host matches `before`, or `timeout` passes: the
        kernel ends SIGKILLed processes, frees their cgroups and drops a netns's veth pair a
        little after the call that asked, so one pass can race them."""
        deadline = time.monotonic() + timeout
        while True:
            for entry in _pod_processes() - before.pod_processes:
                try:  # a container the shims' trees missed (reparented to init)
                    os.kill(int(entry.split()[0]), signal.SIGKILL)
                except ProcessLookupError:
                    pass
            self._remove_added(before)
            self._remove_cgroups()
            problems = before.differences(HostState.capture(self.workdir))
            if not problems or time.monotonic() > deadline:
                return problems
            time.sleep(0.5)

    def check_host(self) -> None:
        """Raise when `stop()` left the host other than `start()` found it (call after stop)."""
        if self.host_problems:
            raise ControlPlaneError(
                "the kubelet node left the host changed:\n  " + "\n  ".join(self.host_problems)
            )

    @staticmethod
    def _remove_added(before: HostState) -> None:
        """What containerd's sandboxes added and nobody tore down (the kubelet was stopped with
        pods running, or killed): their network namespaces (each holds a veth pair), veths left
        behind, runc state and shim sockets."""
        for path in sorted(Path(p) for p in _tree(NETNS_DIR) - before.netns - {str(NETNS_DIR)}):
            subprocess.run(["umount", "-l", str(path)], capture_output=True, check=False)
            path.unlink(missing_ok=True)
        for veth in sorted(_links("veth") - before.veths):
            subprocess.run(["ip", "link", "delete", veth], capture_output=True, check=False)
        for mount in sorted(_mounts((str(CONTAINERD_RUN),)) - before.mounts, key=len, reverse=True):
            subprocess.run(["umount", "-l", mount], capture_output=True, check=False)
        for path in sorted(
            (Path(p) for p in _tree(CONTAINERD_RUN) - before.containerd_run),
            key=lambda p: len(p.parts),
            reverse=True,
        ):
            try:
                if path.is_dir() and not path.is_symlink():
                    path.rmdir()
                else:
                    path.unlink()
            except OSError:
                pass
        if str(NETNS_DIR) not in before.netns:
            try:
                NETNS_DIR.rmdir()  # only when we made it and it is empty
            except OSError:
                pass

    def _kill_shims(self) -> None:
        """containerd's shims run in sessions of their own and outlive it: find ours by the
        `-address` they were given, and end each one's containers before it."""
        children: dict[int, list[int]] = {}
        shims = []
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit():
                continue
            try:
                stat = (proc / "stat").read_text()
                cmdline = (proc / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(proc.name))
            if b"containerd-shim" in cmdline[0] and str(self.socket).encode() in cmdline:
                shims.append(int(proc.name))

        def tree(pid: int) -> list[int]:
            return [d for c in children.get(pid, []) for d in tree(c)] + [pid]

        for shim in shims:
            for pid in tree(shim):  # deepest first, the shim last
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    # --- host state ---------------------------------------------------------------------------
    def _save_sysctls(self) -> None:
        for key in SYSCTLS:
            path = Path("/proc/sys") / key
            if path.exists():
                self._sysctls[key] = path.read_text().strip()

    def _restore_sysctls(self) -> None:
        for key, value in self._sysctls.items():
            path = Path("/proc/sys") / key
            try:
                if path.read_text().strip() != value:
                    path.write_text(value)
            except OSError:
                pass

    def _unmount(self) -> None:
        """Every mount under the work folder (the kubelet bind-mounts its root, pods' volumes,
        containerd's overlay and shm mounts), deepest first."""
        for _ in range(3):
            mounts = [
                line.split()[4]
                for line in Path("/proc/self/mountinfo").read_text().splitlines()
                if line.split()[4].startswith(str(self.workdir))
            ]
            if not mounts:
                return
            for target in sorted(set(mounts), key=len, reverse=True):
                subprocess.run(["umount", "-l", target], capture_output=True, check=False)

    @staticmethod
    def _remove_cgroups() -> None:
        root = Path("/sys/fs/cgroup")
        for controller in root.iterdir() if root.exists() else ():
            for top in ("kubepods", "kubepods.slice", "k8s.io"):
                base = controller / top
                if not base.is_dir():
                    continue
                for d in sorted(base.rglob("*"), key=lambda p: len(p.parts), reverse=True):
                    if d.is_dir():
                        try:
                            d.rmdir()
                        except OSError:
                            pass
                try:
                    base.rmdir()
                except OSError:
                    pass

    # --- pods ------------------------------------------------------------------------------------
    def pod_log(self, namespace: str, name: str, uid: str, container: str) -> str:
        """A container's output as the kubelet wrote it (CRI log format: the text after the
        timestamp, stream and tag), from its podLogsDir (no node address for kubectl logs)."""
        folder = self.logs / f"{namespace}_{name}_{uid}" / container
        lines = []
        for path in sorted(folder.glob("*.log")):
            for line in path.read_text(errors="replace").splitlines():
                parts = line.split(" ", 3)
                lines.append(parts[3] if len(parts) == 4 else line)
        return "\n".join(lines)

    def describe(self, lines: int = 40) -> str:
        out = []
        for comp in (self.containerd, self.kubelet):
            if comp is not None:
                out.append(comp.describe(lines))
        return "\n".join(out) or f"(no logs)\n{tail(self.workdir / 'kubelet.log', lines)}"
