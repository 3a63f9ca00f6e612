PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: demo test bench install clean notebooks

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

# Write each notebooks/NN_*.ipynb from its jupytext source and execute it.
notebooks: $(VENV)/.installed
	$(PY) notebooks/_execute.py

bench: $(VENV)/.installed
	$(PY) -m benchmarks.run

clean:
	rm -rf $(VENV) .pytest_cache
