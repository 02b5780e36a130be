# One virtual environment for everything; `make demo` and `make test` create or reuse it.
PYTHON ?= python3
VENV   ?= .venv
# The torch requirement. CPU nodes: the default. GPU nodes: e.g.
#   make TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128" install
TORCH_SPEC ?= torch==2.13.0
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: install install-units demo lint test clean

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(TORCH_SPEC)
	# recipes: Lightning, Accelerate, torchdata for examples/; they accept the torch installed above (pip
	# upgrades a dependency only when it must), so no other torch build is pulled in
	$(BIN)/python -m pip install -q -e '.[test,recipes]'
	touch $(STAMP)

install: $(STAMP)

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
