"""Security: loopback by default, TLS, request size and concurrency limits, and no pod spec or
annotation in the logs above debug. The threat model is in docs/security.md."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import orjson
import psutil
import pytest
from builders import cluster, gpu_node, pod, service

from extender.cli import build_parser
from extender.ledger import Reservation
from extender.server import DEFAULT_MAX_CONCURRENCY, create_app
from extender.service import ExtenderService

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "config" / "demo-cluster.yaml"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def self_signed(tmp: Path) -> tuple[Path, Path]:
    cert, key = tmp / "tls.crt", tmp / "tls.key"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-keyout",
            str(key),
            "-out",
            str(cert),
            "-days",
            "1",
            "-subj",
            "/CN=vramsched",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    return cert, key


class Serve:
    """`vramsched serve` in a subprocess, as an operator runs it."""

    def __init__(
        self, *extra: str, scheme: str = "http", context: ssl.SSLContext | None = None
    ) -> None:
        self.port = free_port()
        self.scheme, self.context = scheme, context
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "extender",
                "serve",
                "--cluster",
                str(DEMO),
                "--port",
                str(self.port),
                *extra,
            ],
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )

    @property
    def url(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.port}"

    def wait(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(
                    f"serve exited {self.proc.returncode}: {self.proc.stderr.read().decode()[-2000:]}"
                )
            try:
                with urllib.request.urlopen(
                    f"{self.url}/healthz", timeout=5, context=self.context
                ) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, OSError):
                time.sleep(0.1)
        raise AssertionError("serve did not answer /healthz")

    def post(
        self, path: str, body: bytes, context: ssl.SSLContext | None = None
    ) -> tuple[int, dict[str, Any]]:
        req = urllib.request.Request(
            f"{self.url}{path}", data=body, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=30, context=context or self.context) as r:
                return r.status, orjson.loads(r.read())
        except urllib.error.HTTPError as exc:
            return exc.code, orjson.loads(exc.read())

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=30)


@pytest.fixture
def serve() -> Iterator[list[Serve]]:
    started: list[Serve] = []
    yield started
    for s in started:
        s.stop()


@pytest.mark.integration
def test_listens_on_loopback_by_default(serve: list[Serve]) -> None:
    args = build_parser().parse_args(["serve", "--cluster", str(DEMO)])
    assert args.host == "127.0.0.1" and args.max_concurrency == DEFAULT_MAX_CONCURRENCY
    s = Serve()
    serve.append(s)
    s.wait()
    listening = [
        c.laddr
        for c in psutil.Process(s.proc.pid).net_connections(kind="inet")
        if c.status == psutil.CONN_LISTEN
    ]
    assert listening and all(addr.ip == "127.0.0.1" for addr in listening), listening


@pytest.mark.integration
def test_tls_serves_https_only_and_the_limits_apply(serve: list[Serve], tmp_path: Path) -> None:
    cert, key = self_signed(tmp_path)
    trusted = ssl.create_default_context(cafile=str(cert))
    s = Serve(
        "--tls-cert",
        str(cert),
        "--tls-key",
        str(key),
        "--max-body-bytes",
        "65536",
        "--max-concurrency",
        "8",
        scheme="https",
        context=trusted,
    )
    serve.append(s)
    s.wait()
    body = orjson.dumps({"Pod": pod("tls-0", "16Gi"), "NodeNames": ["a100-ts-0", "h100-excl-0"]})
    status, out = s.post("/filter", body)
    assert status == 200 and out["Error"] == "" and out["NodeNames"]
    # a client that does not trust the certificate refuses the server: the TLS is real
    with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
        s.post("/filter", body, context=ssl.create_default_context())
    # plain HTTP on the TLS port gets no HTTP answer
    with pytest.raises((urllib.error.URLError, ConnectionError, OSError)):
        urllib.request.urlopen(f"http://127.0.0.1:{s.port}/healthz", timeout=10).read()
    # --max-body-bytes: a larger body is refused with an Error, and the server keeps serving
    status, out = s.post(
        "/filter", orjson.dumps({"Pod": pod("big", "16Gi"), "NodeNames": ["x" * 200] * 400})
    )
    assert status == 413 and out["Error"]
    status, out = s.post("/filter", body)
    assert status == 200


@pytest.mark.integration
@pytest.mark.parametrize("flags", [["--tls-cert", "x.crt"], ["--max-concurrency", "0"]])
def test_bad_security_flags_are_refused_at_start(flags: list[str]) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "extender", "serve", "--cluster", str(DEMO), *flags],
        cwd=ROOT,
        capture_output=True,
        timeout=60,
    )
    assert proc.returncode != 0
    assert b"--tls-key" in proc.stderr or b"--max-concurrency" in proc.stderr


class BlockingBinder:
    """Binds that wait until released: requests stay in flight as long as the test wants."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.waiting = 0

    async def bind(
        self, the_pod: Mapping[str, Any], node: str, reservation: Reservation | None
    ) -> None:
        self.waiting += 1
        await self.release.wait()


async def test_concurrency_limit_refuses_with_503_and_probes_still_answer(aiohttp_client) -> None:
    state = cluster(gpu_node("n0", count=8), *(pod(f"p{i}", "8Gi") for i in range(4)))
    binder = BlockingBinder()
    client = await aiohttp_client(create_app(ExtenderService(state, binder), max_concurrency=3))

    def bind(i: int):
        return client.post(
            "/bind",
            data=orjson.dumps({"PodName": f"p{i}", "PodNamespace": "default", "Node": "n0"}),
        )

    in_flight = [asyncio.ensure_future(bind(i)) for i in range(3)]
    while binder.waiting < 3:
        await asyncio.sleep(0.01)
    refused = await bind(3)
    assert refused.status == 503 and refused.headers["Retry-After"] == "1"
    assert "busy" in (await refused.json())["Error"]
    for probe in ("/healthz", "/readyz", "/metrics"):
        assert (await client.get(probe)).status == 200
    assert len(list(state.ledger.reservations())) == 3  # the refused bind reserved nothing
    binder.release.set()
    for r in await asyncio.gather(*in_flight):
        assert r.status == 200 and (await r.json())["Error"] == ""
    again = await bind(3)  # the slots are free again
    assert again.status == 200 and (await again.json())["Error"] == ""


async def test_pod_specs_and_annotations_never_reach_the_log_above_debug(
    aiohttp_client, caplog
) -> None:
    """Every path that handles a pod, fed values marked SECRET: only debug records may carry them."""
    caplog.set_level(logging.DEBUG)
    bad_demand = pod("bound-bad", "SECRET-A-16Gi", node="n0", phase="Running")
    bad_assignment = pod(
        "bound-odd",
        "16Gi",
        node="n0",
        phase="Running",
        annotations={
            "vramsched.io/assignment": '{"node":"n0","devices":["0"],"bytesPerDevice":["SECRET-B"]}'
        },
    )
    noted = pod("noted", "16Gi", annotations={"team/note": "SECRET-C"})
    noted["spec"]["containers"][0]["env"] = [{"name": "TOKEN", "value": "SECRET-D"}]
    state = cluster(gpu_node("n0", count=2), bad_demand, bad_assignment, noted)
    client = await aiohttp_client(create_app(service(state)))
    bodies = [
        ("filter", {"Pod": pod("bad-q", "SECRET-E-16Gx"), "NodeNames": ["n0"]}),
        ("filter", {"Pod": noted, "NodeNames": ["n0"]}),
        ("prioritize", {"Pod": noted, "NodeNames": ["n0"]}),
        ("bind", {"PodName": "noted", "PodNamespace": "default", "Node": "n0"}),
        ("preempt", {"Pod": pod("bad-p", "SECRET-F-1e400"), "NodeNameToMetaVictims": {}}),
        ("filter", {"Pod": "SECRET-G", "NodeNames": ["n0"]}),
    ]
    for verb, body in bodies:
        r = await client.post(f"/{verb}", data=orjson.dumps(body))
        assert r.status < 500
    r = await client.post("/filter", data=b'{"Pod": SECRET-H')
    assert r.status == 400

    def text(record: logging.LogRecord) -> str:
        return " ".join(
            [record.getMessage(), repr(getattr(record, "fields", "")), record.exc_text or ""]
        )

    loud = [text(r) for r in caplog.records if r.levelno >= logging.INFO and "SECRET" in text(r)]
    assert loud == []
    # the details are there for whoever turns debug on (and the capture works: this test can fail)
    quiet = [text(r) for r in caplog.records if r.levelno < logging.INFO and "SECRET" in text(r)]
    assert any("SECRET-A" in t for t in quiet) and any("SECRET-B" in t for t in quiet)
    assert any(
        "bound-bad" in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records
    )


async def test_bind_refuses_pods_of_another_scheduler(aiohttp_client) -> None:
    """Whoever reaches the extender cannot use its pods/binding right on pods it does not schedule."""
    other = pod("other", "16Gi", scheduler="default-scheduler")
    unnamed = pod("unnamed", "16Gi")
    del unnamed["spec"]["schedulerName"]
    state = cluster(gpu_node("n0"), other, unnamed, pod("ours", "16Gi"))
    client = await aiohttp_client(create_app(service(state)))
    for name, expected in (
        ("other", "default-scheduler"),
        ("unnamed", "default-scheduler"),
        ("ours", ""),
    ):
        r = await client.post(
            "/bind", data=orjson.dumps({"PodName": name, "PodNamespace": "default", "Node": "n0"})
        )
        error = (await r.json())["Error"]
        assert (expected in error and error) if expected else error == ""
    assert [r.key for r in state.ledger.reservations()] == ["default/ours"]
    assert not state.pods["default/other"]["spec"].get("nodeName")
