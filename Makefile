# The two commands of the README (make demo, make test) and the habits beside them (make
# test-fast, make lint, make docs). Each creates .venv when it is missing (idempotent: the stamp
# file is only rebuilt when pyproject.toml changes), installs the project in editable mode with
# its dev extra, then runs.
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.hetsynth-installed

.PHONY: demo test test-fast lint docs

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m hetsynth demo

# the whole suite, multi-process tests included, after the lint: first every test that may share
# the machine, on WORKERS pytest-xdist workers, a module's tests on one worker (its module-scoped
# fixtures, such as the documents' run, are computed once); much of a launch's time is spent
# waiting on ranks held to their emulated devices' CPU quotas, so more workers than cores pay.
# Then the tests marked serial (timings, machine-wide checks), one at a time.
WORKERS ?= 3
test: lint
	$(PY) -m pytest -q -n $(WORKERS) --dist loadscope -m "not serial"
	$(PY) -m pytest -q -m serial

# pure logic and single-process tests: those not marked slow (tests/conftest.py marks every test
# that uses the spawned rank pools; modules that launch ranks mark themselves)
test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow"

lint: $(STAMP)
	$(VENV)/bin/ruff check .

# regenerate docs/cli.md (from the argparse parsers), bench/README.md and README.md's headline
# table (from bench/results/*.json); make test fails while either is stale
docs: $(STAMP)
	$(PY) docs/make_cli_reference.py
	$(PY) bench/make_readme.py

