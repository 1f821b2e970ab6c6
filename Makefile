# The same commands locally and in CI. Each target creates (or reuses) .venv in the checkout.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
DEMO_DIR ?= kvlens-demo

.PHONY: venv demo test test-all bench lint schema-docs clean

venv: $(STAMP)

# Reinstalled whenever pyproject.toml changes.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

demo: venv
	$(VENV)/bin/kvlens demo --workdir $(DEMO_DIR)

test: venv
	$(PY) -m pytest

bench: venv
	$(PY) tests/bench/run.py

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

schema-docs: venv
	$(VENV)/bin/kvlens schema --markdown > docs/schema.md

clean:
	rm -rf $(DEMO_DIR) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
