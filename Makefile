# ModelRelay. `make run` serves with embedded defaults; `make test` runs the whole suite.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check -q

.PHONY: run test lint bench browser clean

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

test: $(VENV)/.dev browser
	DATA_DIR=$(CURDIR)/.test-data $(PY) -m pytest $(PYTEST_ARGS)

lint: $(VENV)/.dev
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	DATA_DIR=$(CURDIR)/.test-data $(VENV)/bin/mypy .

bench: $(VENV)/.dev
	$(PY) bench/run.py

clean:
	rm -rf $(VENV) .test-data .pytest_cache .mypy_cache .ruff_cache
