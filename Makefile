# leasekeeper: `make run` brings up the whole backend on embedded defaults and shows it
# working; `make test` installs what the tests need, starts their services, runs them all.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# setuptools prints a boxed "Editable installation" note on every `pip install -e`; a new
# user's first `make run` should show only what leasekeeper has to say.
QUIET_BUILD := PYTHONWARNINGS='ignore:Editable installation'
export PYTHONPATH := $(CURDIR)

.PHONY: run test lint bench system-deps kube-binaries clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(QUIET_BUILD) $(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

run: $(STAMP)
	$(VENV)/bin/leasekeeper up --demo 6

# Debian packages the tests use: Redis and PostgreSQL servers (installed when missing).
system-deps:
	@bash scripts/system-deps.sh

kube-binaries:
	@bash tests/cluster/build.sh

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

test: $(STAMP) system-deps kube-binaries lint
	@bash scripts/run-tests.sh $(PY)

# Benchmarks print JSON. kube_ops needs the Kubernetes binaries (built once, cached).
bench: $(STAMP) system-deps kube-binaries
	$(PY) bench/throughput.py
	$(PY) bench/cold_bodies.py --store sqlite
	$(PY) bench/cold_bodies.py --store postgres
	$(PY) bench/priority.py --cleanup-worker
	$(PY) bench/sweeps.py
	$(PY) bench/memory.py
	$(PY) bench/scaleout.py
	$(PY) bench/kube_ops.py
	$(PY) bench/redelivery.py
	$(PY) bench/observe_queries.py
	$(PY) bench/pools.py

clean:
	rm -rf $(VENV) .var
