PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: demo test bench install clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $(VENV)/.installed

install: $(VENV)/.installed

demo: $(VENV)/.installed
	$(PY) -m shardopt.demo

test: $(VENV)/.installed
	$(PY) -m pytest -n 2 tests

bench: $(VENV)/.installed
	$(PY) -m benchmarks.run

clean:
	rm -rf $(VENV) .pytest_cache
