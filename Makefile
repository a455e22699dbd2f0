VENV ?= .venv
PY := $(VENV)/bin/python
# The interpreter .venv is created from (the oldest end of the range is Python 3.11).
PYTHON ?= python3
export JAX_PLATFORMS ?= cpu

.PHONY: install third-party test test-extended test-latest lint demo bench docs docs-notebooks clean

# The newest end of the supported range: the newest CPython here (3.12+) with the newest
# jax/jaxlib/flax/optax/orbax releases and the libtpu that jax pins.
VENV_LATEST ?= .venv-latest
LATEST_PY ?= $(shell .ci/newest-python)
NEWEST := jax jaxlib flax optax orbax-checkpoint

# The oldest end of the supported range, which make test runs (the `dev` extra pins the same).
OLDEST := jax==0.10.2 jaxlib==0.10.2

# make test's: everything the suite needs (the `dev` extra: libtpu, JAX's CUDA wheels for GPU
# compiles without a GPU, the docs and packaging tools...). It holds the demo's needs too.
$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	touch $@ $(VENV)/.installed-demo

# make demo's: the package (jax for CPU, flax, optax, orbax, rich) and the `demo` extra (Grain
# for the input pipeline, matplotlib for the loss curve); nothing for TPUs, GPUs or tests.
$(VENV)/.installed-demo: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[demo]' $(OLDEST)
	touch $@

install: $(VENV)/.installed

# Flax's own examples/gemma from the sdist of the installed flax (sha256-pinned in
# benchmarks/third_party.py), into $(VENV)/share/flax-examples/ (a no-op once there): never
# at test time.
third-party: install
	@$(PY) -m benchmarks.third_party

# The suite but for the tests marked `extended` (tests/conftest.py says which and why).
test: install third-party
	@$(PY) -c "import sys, jax; print('make test:', sys.executable, 'Python', sys.version.split()[0], 'jax', jax.__version__)"
	$(PY) -m pytest -q -n 2 --dist loadgroup --durations=15 -m "not extended"

# The `extended` tests (more topologies, sizes and repetitions of what make test checks, and
# the multi-minute process paths); CI runs them after make test.
test-extended: install third-party
	$(PY) -m pytest -q -n 2 --dist loadgroup --durations=15 -m extended

$(VENV_LATEST)/.installed: pyproject.toml
	@test -n "$(LATEST_PY)" || { echo "make test-latest needs CPython >= 3.12"; exit 1; }
	test -x $(VENV_LATEST)/bin/python || $(LATEST_PY) -m venv $(VENV_LATEST)
	$(VENV_LATEST)/bin/python -m pip install -q --upgrade pip
	$(VENV_LATEST)/bin/python -m pip install -q --upgrade -e '.[test]' $(NEWEST)
	touch $@

# make test's suite again on the newest end of the range (a second venv), with the extended
# equality tests of the newer axes (marked `latest` in tests/conftest.py).
test-latest: $(VENV_LATEST)/.installed
	@$(VENV_LATEST)/bin/python -c "import sys, jax, jaxlib, flax, optax, orbax.checkpoint as o; \
	  print('test-latest: Python', sys.version.split()[0], 'jax', jax.__version__, \
	        'flax', flax.__version__, 'optax', optax.__version__)"
	$(VENV_LATEST)/bin/python .ci/check_newest.py $(NEWEST)
	$(VENV_LATEST)/bin/python -m benchmarks.third_party --if-pinned
	$(VENV_LATEST)/bin/python -m pytest -q -n 2 --dist loadgroup --durations=15 -m "not extended or latest"

lint: install
	$(VENV)/bin/ruff check dtensor strategies tests examples benchmarks
	$(VENV)/bin/ruff format --check dtensor strategies
	$(VENV)/bin/pyright
	$(VENV)/bin/lint-imports

demo: $(VENV)/.installed-demo
	$(PY) examples/train.py $(ARGS)

bench: install third-party
	$(PY) -m benchmarks.run_all

# The documentation site, warnings as errors: docs/_build/html/index.html. No network.
docs: install
	$(PY) -m sphinx -W --keep-going -q -b html docs docs/_build/html
	@echo "docs/_build/html/index.html"

# Re-execute the notebooks into docs/notebooks/ (with outputs) after notebooks/ change.
docs-notebooks: install
	$(PY) docs/execute_notebooks.py

clean:
	rm -rf $(VENV) $(VENV_LATEST) build dist *.egg-info docs/_build
