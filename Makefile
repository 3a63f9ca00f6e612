PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: demo test test-fast test-fast-timing fuzz bench install clean notebooks docs lint wheel

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

$(VENV)/.installed: pyproject.toml | $(PY)
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $(VENV)/.installed

# The demo needs only the demo extra (scikit-learn, matplotlib, tqdm), not the
# dev tools.
$(VENV)/.demo-installed: pyproject.toml | $(PY)
	$(PY) -m pip install --quiet -e ".[demo]"
	touch $(VENV)/.demo-installed

# The docs extra (Sphinx, myst-nb, the theme) on top of the dev install.
$(VENV)/.docs-installed: $(VENV)/.installed
	$(PY) -m pip install --quiet -e ".[dev,docs]"
	touch $(VENV)/.docs-installed

install: $(VENV)/.installed

demo: $(VENV)/.demo-installed
	$(PY) -m examples.demo

# The whole suite (what CI runs, .ci/run), the 15 slowest tests listed last.
test: $(VENV)/.installed
	$(PY) -m pytest -n 2 --dist loadgroup --durations=15 tests

# Every transform against its numpy/optax/TensorFlow reference, in one mapping
# or case each, and the argument checks, in under 3 minutes on the 2-core
# development machine when it is otherwise quiet: the suite less what is
# marked slow (tests/conftest.py: SLOW_FILES, SLOW_TESTS, KEEP;
# @pytest.mark.slow): subprocesses (multi-process, elastic, restarts, process
# faults), notebooks, benchmark runs, docs and packaging builds, and the
# longer variants and further cases of what it keeps. `make test-fast-timing`
# (python tests/fast_tier.py) runs this recipe and records its count and
# seconds in tests/fast_tier.json and README.md; tests/test_fast_tier.py fails
# when the tier has changed size since, or took over 3 minutes.
test-fast: $(VENV)/.installed
	$(PY) -m pytest -n 2 --dist loadgroup --durations=15 -m "not slow" tests

# Times `make test-fast` (its recipe above) and writes tests/fast_tier.json
# and README.md's fast-tier block: run it on a quiet machine.
test-fast-timing: $(VENV)/.installed
	$(PY) tests/fast_tier.py

# Write each notebooks/NN_*.ipynb from its jupytext source and execute it.
notebooks: $(VENV)/.installed
	$(PY) notebooks/_execute.py

# The docs site in docs/_build/html. -W: any warning fails; -n: nitpicky, every
# cross-reference must resolve (offline, see docs/conf.py).
docs: $(VENV)/.docs-installed
	rm -rf docs/_build
	$(PY) -m sphinx -b html -W -n --keep-going docs docs/_build/html

# Both checks always run (and report); the target fails if either found a
# violation. Fix with `ruff check --fix .` and `ruff format .`.
lint: $(VENV)/.installed
	status=0; \
	$(PY) -m ruff check . || status=1; \
	$(PY) -m ruff format --check . || status=1; \
	exit $$status

# sdist + wheel in dist/, checked with twine.
wheel: $(VENV)/.installed
	rm -rf dist
	$(PY) -m build --outdir dist .
	$(PY) -m twine check --strict dist/*

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
	rm -rf $(VENV) .pytest_cache docs/_build docs/notebooks dist build
