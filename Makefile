# vramsched developer entry points. `make run` and `make test` work on a fresh machine:
# they create .venv, install the package with its pinned ranges, and start what tests need.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
HOST ?= 127.0.0.1
PORT ?= 8888

.PHONY: run test e2e venv deps clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	@touch $@

# System tools the test suite uses: kubectl (renders deploy/ with kustomize).
deps:
	@command -v kubectl >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq kubernetes-client >/dev/null)

run: venv
	$(VENV)/bin/vramsched serve --cluster config/demo-cluster.yaml --host $(HOST) --port $(PORT)

test: venv deps
	$(PY) -m pytest -q -p no:cacheprovider

e2e: venv deps
	$(PY) -m pytest -q -p no:cacheprovider tests/e2e

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
