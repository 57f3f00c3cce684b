# The two commands of the README. Both create .venv when it is missing (idempotent: the
# stamp file is only rebuilt when pyproject.toml changes), install the project in editable
# mode with its dev extra, then run.
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.hetsynth-installed

.PHONY: demo test

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m hetsynth demo

test: $(STAMP)
	$(PY) -m pytest -q
