"""The Grafana dashboard and the alert rules against a real Prometheus.

Debian's `prometheus` (installed by `make deps`) runs on loopback with a temporary config and
data directory, scraping `vramsched serve --cluster config/demo-cluster.yaml` every second after
pods were scheduled through the server's own filter and bind: some bound, one leaving VRAM
stranded, one pending on VRAM, one that fits nowhere. Then every PromQL expression of
deploy/grafana/vramsched.json must parse and return series, and of deploy/prometheus/rules.yaml
must evaluate (its signal returning series; the pending-on-VRAM alert's whole expression too,
the over-VRAM one never; the extender-down one once the server stops). `promtool check rules`
and `promtool test rules` (when each alert fires) pass. Prometheus and its directory are
removed afterwards.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from demo_server import ROOT, DemoServer, free_port, gpu_pod

# starts vramsched and Prometheus as processes: `make unit` leaves it out, `make test` runs it
pytestmark = pytest.mark.integration

DASHBOARD = ROOT / "deploy" / "grafana" / "vramsched.json"
RULES = ROOT / "deploy" / "prometheus" / "rules.yaml"
RULE_TESTS = ROOT / "deploy" / "prometheus" / "rules.test.yaml"
#: Grafana's variables, as "All" and a range Prometheus accepts
GRAFANA = {"$node": ".*", "$product": ".*", "$__rate_interval": "1m"}


def _tool(name: str) -> str:
    path = shutil.which(name)
    assert path, f"{name} is missing: `make deps` installs Debian's prometheus package"
    return path


def dashboard_queries() -> list[tuple[str, str]]:
    doc = json.loads(DASHBOARD.read_text())
    out = []
    for panel in doc["panels"]:
        for target in panel.get("targets", []):
            out.append((f"{panel['title']} [{target['refId']}]", target["expr"]))
    return out


def dashboard_variables() -> list[tuple[str, str, str]]:
    """(name, metric selector, label) of each `label_values(selector, label)` variable."""
    out = []
    for var in json.loads(DASHBOARD.read_text())["templating"]["list"]:
        if var["type"] != "query":
            continue
        m = re.fullmatch(r"label_values\((.+), (\w+)\)", var["query"]["query"])
        assert m, var["query"]
        out.append((var["name"], m.group(1), m.group(2)))
    return out


def alerts() -> dict[str, str]:
    doc = yaml.safe_load(RULES.read_text())
    return {r["alert"]: r["expr"] for g in doc["groups"] for r in g["rules"]}


def signal(expr: str) -> str:
    """An alert's expression without its final threshold (`<signal> > 0.1` -> `<signal>`)."""
    m = re.fullmatch(r"(.+?)\s*(?:>|<|>=|<=|==|!=)\s*[0-9.e+-]+", expr.strip(), re.S)
    return m.group(1) if m else expr


def selectors(expr: str) -> list[str]:
    """The series selectors of an expression (`metric{labels}`)."""
    return [m.group(0) for m in re.finditer(r"\b[a-zA-Z_:][a-zA-Z0-9_:]*\{[^}]*\}", expr)]


def substitute(expr: str) -> str:
    for var, value in GRAFANA.items():
        expr = expr.replace(var, value)
    assert "$" not in expr.replace("$1", ""), f"unknown Grafana variable in {expr}"
    return expr


def _scrapes(prom: Prometheus) -> float:
    """How many scrapes of the job the last minute holds (0 before the first one): a number,
    since PromQL answers values as strings and "10" < "5" as strings."""
    result = prom.query('count_over_time(up{job="vramsched"}[1m])')
    return float(result[0]["value"][1]) if len(result) == 1 else 0.0


class Prometheus:
    def __init__(self, workdir: Path, target: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(RULES)],
            "scrape_configs": [
                {"job_name": "vramsched", "static_configs": [{"targets": [target]}]}
            ],
        }
        (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.log = (workdir / "prometheus.log").open("wb")
        self.proc = subprocess.Popen(
            [
                _tool("prometheus"),
                f"--config.file={workdir / 'prometheus.yml'}",
                f"--storage.tsdb.path={workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--log.level=warn",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        self.wait(lambda: self._get("/-/ready") is not None, "Prometheus ready", 60)

    def _get(self, path: str) -> bytes | None:
        try:
            with urllib.request.urlopen(self.url + path, timeout=10) as resp:
                return resp.read()
        except OSError:
            return None

    def api(self, path: str, **params: str) -> Any:
        url = f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(url, timeout=30) as resp:
                return json.loads(resp.read())
        except urllib.error.HTTPError as exc:  # a query that does not parse: 400 with the error
            return json.loads(exc.read())

    def query(self, expr: str) -> list[dict[str, Any]]:
        answer = self.api("query", query=expr)
        assert answer["status"] == "success", f"{expr}\n -> {answer.get('error')}"
        return answer["data"]["result"]

    def wait(self, predicate, what: str, timeout: float = 60) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"prometheus exited while waiting for {what}")
            value = predicate()
            if value:
                return value
            time.sleep(0.5)
        raise AssertionError(f"timed out waiting for {what}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


@pytest.fixture(scope="module")
def stack() -> Iterator[tuple[Prometheus, DemoServer]]:
    workdir = Path(tempfile.mkdtemp(prefix="vramsched-prometheus-"))
    server = prom = None
    stop = threading.Event()
    try:
        server = DemoServer(workdir / "vramsched.log")
        # GPUs 1-3 of a100-ts-0 get 50Gi each (GPU 0 holds the demo's 64Gi): no GPU there has
        # 70Gi free any more, so a 70Gi pod asked about that node waits on VRAM
        for i in range(3):
            assert server.schedule(gpu_pod(f"fill-{i}", "50Gi"), ["a100-ts-0"]) == "a100-ts-0"
        assert server.schedule(gpu_pod("waits", "70Gi"), ["a100-ts-0"]) is None
        assert server.schedule(gpu_pod("never", "500Gi")) is None  # no GPU that large
        # a 16Gi pod alone on an exclusive H100: the other 63.65Gi are stranded
        assert server.schedule(gpu_pod("small", "16Gi"), ["h100-excl-0"]) == "h100-excl-0"
        server.post("filter", {"Pod": gpu_pod("bad", "lots"), "NodeNames": server.nodes})

        def traffic() -> None:  # requests in every rate() window
            pod = gpu_pod("probe", "8Gi")
            while not stop.wait(0.2):
                try:
                    server.post("filter", {"Pod": pod, "NodeNames": server.nodes})
                except OSError:
                    return

        threading.Thread(target=traffic, daemon=True).start()
        prom = Prometheus(workdir, f"127.0.0.1:{server.port}")
        prom.wait(
            lambda: _scrapes(prom) >= 5,
            "five scrapes",
        )
        yield prom, server
    finally:
        stop.set()
        if prom is not None:
            prom.stop()
        if server is not None:
            server.stop()
        shutil.rmtree(workdir, ignore_errors=True)


def test_promtool_checks_and_unit_tests_the_rules() -> None:
    check = subprocess.run(
        [_tool("promtool"), "check", "rules", str(RULES)], capture_output=True, text=True
    )
    assert check.returncode == 0, check.stdout + check.stderr
    assert f"SUCCESS: {len(alerts())} rules found" in check.stdout
    unit = subprocess.run(
        [_tool("promtool"), "test", "rules", str(RULE_TESTS)], capture_output=True, text=True
    )
    assert unit.returncode == 0, unit.stdout + unit.stderr


@pytest.mark.parametrize("title, expr", dashboard_queries(), ids=lambda v: v if " [" in v else "")
def test_every_dashboard_query_returns_series(stack, title: str, expr: str) -> None:
    prom, _ = stack
    result = prom.query(substitute(expr))
    assert result, f"{title}: no series for {substitute(expr)}"


def test_dashboard_variables_have_values(stack) -> None:
    prom, _ = stack
    for name, selector, label in dashboard_variables():
        answer = prom.api(f"label/{label}/values", **{"match[]": selector})
        assert answer["status"] == "success" and answer["data"], (name, answer)
    assert (
        "h100-excl-0"
        in prom.api("label/node/values", **{"match[]": "vramsched_gpu_memory_bytes"})["data"]
    )


def test_the_dashboard_shows_what_top_shows(stack) -> None:
    """Spot checks: the figures the dashboard computes are the ledger's."""
    prom, server = stack
    by_title = dict(dashboard_queries())

    def value(title: str) -> float:
        (sample,) = prom.query(substitute(by_title[title]))
        return float(sample["value"][1])

    state = json.loads(urllib.request.urlopen(server.url + "/state").read())
    gpus = [g for n in state["nodes"] for g in n["gpus"]]
    assert value("GPUs in use [A]") == sum(1 for g in gpus if g["usedReplicas"])  # 5
    assert value("GPUs fully free [A]") == sum(1 for g in gpus if not g["usedReplicas"])
    assert value("VRAM allocated [A]") == pytest.approx(
        state["allocatedBytes"] / state["capacityBytes"]
    )
    stranded = sum(
        g["memoryBytes"] - g["usedBytes"] for g in gpus if g["usedReplicas"] >= g["replicas"]
    )
    assert stranded > 0 and value("Stranded VRAM [A]") == stranded
    pending = {
        s["metric"]["reason"]: float(s["value"][1])
        for s in prom.query(substitute(by_title["Pending pods by reason [A]"]))
    }
    assert pending["vram"] == 1 and pending["unschedulable"] == 1


def test_every_alert_evaluates_on_live_series(stack) -> None:
    prom, server = stack
    rules = prom.wait(
        lambda: [
            r
            for g in prom.api("rules")["data"]["groups"]
            for r in g["rules"]
            if r.get("lastEvaluation", "").startswith("2")
            and not r["lastEvaluation"].startswith("0001")
        ],
        "rules evaluated",
    )
    assert {r["name"] for r in rules} == set(alerts())
    assert all(r["health"] == "ok" and not r.get("lastError") for r in rules), rules
    for name, expr in alerts().items():
        for selector in selectors(expr):
            assert prom.query(selector), f"{name}: {selector} has no series"
        if signal(expr) != expr:
            assert prom.query(signal(expr)), f"{name}: its signal {signal(expr)!r} has no series"
    # the whole expression where the live data makes it true, and the one that must never be
    assert prom.query(alerts()["VramschedPodsPendingOnVram"])
    assert prom.query(alerts()["VramschedGpuOverVram"]) == []
    assert prom.query(alerts()["VramschedExtenderDown"]) == []
    server.stop()
    assert prom.wait(lambda: prom.query(alerts()["VramschedExtenderDown"]), "up == 0", 30)
