VENV ?= .venv
PY := $(VENV)/bin/python
export JAX_PLATFORMS ?= cpu

.PHONY: install test test-fast lint demo bench clean

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

clean:
	rm -rf $(VENV) build *.egg-info
