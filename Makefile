# One virtual environment for everything; `make demo` and `make test` create or reuse it.
PYTHON ?= python3
VENV   ?= .venv
# The torch requirement. CPU nodes: the default. GPU nodes: e.g.
#   make TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128" install
TORCH_SPEC ?= torch==2.13.0
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

# `busctl bench --peers`: the loaders it compares with. These two go in without their declared
# dependencies (see the `bench` extra in pyproject.toml for why, and for what they need instead).
BENCH_NODEPS ?= litdata==0.2.76 mosaicml-streaming==0.13.0

.PHONY: install install-bench install-units demo lint test clean

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(TORCH_SPEC)
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

install-bench: $(STAMP)
	$(BIN)/python -m pip install -q $(TORCH_SPEC) -e '.[bench]'
	$(BIN)/python -m pip install -q --no-deps $(BENCH_NODEPS)

demo: $(STAMP)
	$(BIN)/busctl demo

# systemd units (systemd/README.md) that run this checkout's venv; as root. UNITS_FLAGS=--root DIR etc.
install-units: $(STAMP)
	$(BIN)/busctl install-units --prefix $(abspath $(VENV)) $(UNITS_FLAGS)

# Lint, format and types (seconds, cached), then the tests.
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

test: lint
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis .mypy_cache .ruff_cache
