# deltaserve developer commands. `make demo` and `make test` work on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP_FLAGS ?= -q --disable-pip-version-check

.PHONY: install test demo bench clean

$(VENV)/.installed: setup.cfg pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install $(PIP_FLAGS) -e '.[test]' 2>&1 | grep -v "^WARNING: Location" || true
	$(PY) -c "import torch, msgspec, zmq, transformers"  # fail here, not in the tests
	touch $@

install: $(VENV)/.installed

test: install
	$(PY) -m pytest -q

demo: install
	$(PY) benchmarks/simulate_scheduler.py

bench: install
	$(PY) benchmarks/bench_protocol.py
	$(PY) benchmarks/bench_scheduler.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
