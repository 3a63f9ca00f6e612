PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: demo test fuzz bench install clean

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

# Property tests under the "thorough" hypothesis profile (>= 500 examples per
# property, a fresh seed each run); writes a per-property table (examples,
# failures, time) to $(FUZZ_REPORT). New property files: tests/test_properties*.py.
FUZZ_TESTS ?= $(wildcard tests/test_properties*.py)
FUZZ_REPORT ?= docs/fuzz_results.md
fuzz: $(VENV)/.installed
	HYPOTHESIS_PROFILE=thorough FUZZ_REPORT=$(FUZZ_REPORT) \
	  $(PY) -m pytest -n 2 -q -p no:cacheprovider $(FUZZ_TESTS)

bench: $(VENV)/.installed
	$(PY) -m benchmarks.run

clean:
	rm -rf $(VENV) .pytest_cache
