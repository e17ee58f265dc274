"""Long-running binaries for the e2e suite: own process group, own log, nothing outlives the session.

Each component runs in its own process group (``start_new_session``) and under ``setpriv
--pdeathsig KILL``, so it dies with the test process even when that is SIGKILLed (where atexit
never runs); :meth:`Component.stop` sends SIGTERM then SIGKILL to the whole group, and an atexit
hook kills whatever is left. Also: free loopback ports and a plain HTTP(S) probe.

This module deliberately does not import pytest.
"""

from __future__ import annotations

import atexit
import datetime as _dt
import os
import shutil
import signal
import socket
import ssl
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path


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


def _kill_group(
    proc: subprocess.Popen[bytes], grace: float = 10.0, first: int = signal.SIGTERM
) -> None:
    """Send `first` (SIGTERM) to the process group, then SIGKILL it if it lingers."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, first)
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
        self.restarts = 0
        self._supervised = False
        self._lock = threading.Lock()

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
        with self._lock:
            self._supervised = False
            proc, self.proc = self.proc, None
        if proc is not None:
            _kill_group(proc)

    def kill(self) -> None:
        """SIGKILL the process group at once: no shutdown path runs (a crash, an OOM kill)."""
        with self._lock:
            self._supervised = False
            proc, self.proc = self.proc, None
        if proc is not None:
            _kill_group(proc, grace=5.0, first=signal.SIGKILL)

    def supervise(self, delay: float = 1.0) -> None:
        """Start it again ``delay`` s after each exit of its own, as kubelet does for a container
        with ``restartPolicy: Always`` (without kubelet's growing back-off), until :meth:`stop`.

        The restarts happen on a thread that lives as long as the supervision, so the
        ``--pdeathsig`` of the restarted process (tied to the thread that started it) holds.
        """
        with self._lock:
            if self._supervised or self.proc is None:
                return
            self._supervised = True
        threading.Thread(target=self._supervisor, args=(delay,), daemon=True).start()

    def _supervisor(self, delay: float) -> None:
        while True:
            proc = self.proc
            if proc is None:
                return
            proc.wait()
            time.sleep(delay)
            with self._lock:
                if not self._supervised or self.proc is not proc:
                    return
                self.restarts += 1
                self.start()

    def describe(self, lines: int = 40) -> str:
        state = "not started"
        if self.proc is not None:
            rc = self.proc.poll()
            state = "running" if rc is None else f"exited with {rc}"
        return f"--- {self.name} ({state}), last lines of {self.log_path}:\n{tail(self.log_path, lines)}"


def http_ok(url: str, token: str | None = None, context: ssl.SSLContext | None = None) -> bool:
    req = urllib.request.Request(url)
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=2, context=context) as resp:
            return bool(resp.status == 200)
    except (urllib.error.URLError, OSError, ValueError):
        return False
