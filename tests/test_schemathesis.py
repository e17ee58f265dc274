"""Schemathesis against the published OpenAPI description, over real HTTP on loopback.

The extender's own description (`extender/openapi.yaml`, served at `/openapi.yaml`) drives
generation, so the test fails when the server and the document disagree (status codes,
content types, response bodies) and whenever any generated or mutated body gets a 5xx.

Two of schemathesis' default checks are left out on purpose: `negative_data_rejection` and
`positive_data_acceptance`. The extender protocol answers a well-formed envelope whose Pod is
unreadable with 200 and `Error` (kube-scheduler shows that string in the pod's events), so a
mutated Pod is *meant* to get 200, and a schema-valid Pod may still carry an unreadable
quantity. Both directions are asserted precisely in tests/test_fuzz_http.py instead.
"""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import schemathesis
import yaml
from aiohttp import web
from builders import cluster, gpu_node, mig_mixed_node, pod, service
from hypothesis import HealthCheck, settings
from schemathesis.checks import negative_data_rejection, positive_data_acceptance

from extender.cluster import check_cluster
from extender.server import create_app, route_paths

pytestmark = pytest.mark.integration

OPENAPI = Path(__file__).resolve().parents[1] / "extender" / "openapi.yaml"


class ServerThread:
    """The real aiohttp server on 127.0.0.1 in a thread with its own event loop."""

    def __init__(self, app: web.Application) -> None:
        self.app = app
        self.loop = asyncio.new_event_loop()
        self.runner = web.AppRunner(app, access_log=None)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def __enter__(self) -> ServerThread:
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(timeout=30)
        return self

    async def _start(self) -> None:
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()

    def call(self, fn):  # run `fn()` on the server's loop, where the cluster lives
        async def run():
            return fn()

        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(timeout=30)

    def __exit__(self, *exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(timeout=30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=30)
        self.loop.close()


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    c = cluster(
        gpu_node("a100-0", count=4, replicas=4),
        gpu_node("h100-0", count=8, memory_mib=81559, product="NVIDIA-H100-80GB-HBM3"),
        mig_mixed_node("mig-0", {"1g.10gb": (7, 9728)}),
        pod("running-0", "24Gi", node="a100-0", phase="Running"),
        pod("pending-0", "16Gi"),
    )
    with ServerThread(create_app(service(c))) as srv:
        srv.cluster = c
        srv.cases = 0
        yield srv
        print(f"\nschemathesis: {srv.cases} generated requests")


# Loaded at import (pytest 9 cannot resolve schemathesis' lazy fixture schemas); the server's
# port is only known at run time, so every call names its base URL.
schema = schemathesis.openapi.from_path(OPENAPI)
schema.config.update(request_timeout=30)
schema.config.generation.update(max_examples=30)


@schema.parametrize()
@settings(derandomize=True, database=None, deadline=None, suppress_health_check=list(HealthCheck))
def test_api_conforms_to_its_openapi(case, server: ServerThread) -> None:
    server.cases += 1
    case.call_and_validate(
        base_url=f"http://127.0.0.1:{server.port}",
        excluded_checks=[negative_data_rejection, positive_data_acceptance],
    )
    assert server.call(lambda: check_cluster(server.cluster)) == []


def test_openapi_describes_every_route(server: ServerThread) -> None:
    """The document and the router list the same paths, and the served copy is the packaged one."""
    doc = yaml.safe_load(OPENAPI.read_text())
    assert set(doc["paths"]) == route_paths()
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/openapi.yaml", timeout=30) as resp:
        assert resp.headers["Content-Type"].startswith("application/yaml")
        assert yaml.safe_load(resp.read()) == doc
