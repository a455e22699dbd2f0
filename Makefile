VENV ?= .venv
PY := $(VENV)/bin/python
export JAX_PLATFORMS ?= cpu

.PHONY: install test test-fast lint demo bench docs docs-notebooks clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

install: $(VENV)/.installed

test: install
	$(PY) -m pytest -q -n 2 --dist loadgroup --durations=15

lint: install
	$(VENV)/bin/ruff check dtensor strategies tests examples benchmarks
	$(VENV)/bin/ruff format --check dtensor strategies
	$(VENV)/bin/pyright
	$(VENV)/bin/lint-imports

demo: install
	$(PY) examples/train.py $(ARGS)

bench: install
	$(PY) -m benchmarks.run_all

# The documentation site, warnings as errors: docs/_build/html/index.html. No network.
docs: install
	$(PY) -m sphinx -W --keep-going -q -b html docs docs/_build/html
	@echo "docs/_build/html/index.html"

# Re-execute the notebooks into docs/notebooks/ (with outputs) after notebooks/ change.
docs-notebooks: install
	$(PY) docs/execute_notebooks.py

clean:
	rm -rf $(VENV) build dist *.egg-info docs/_build
