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
# The peer writers the tests write datasets with, also without their declared dependencies (the test
# extra in pyproject.toml lists what they import instead).
TEST_NODEPS ?= mosaicml-streaming==0.13.0 litdata==0.2.76

.PHONY: install install-bench install-units demo serve-examples lint test tools clean

# --no-compile: pip would byte-compile every module of every package (torch's alone took 45 of the 60 s of
# its install); Python compiles what is imported, once, when it first imports it (below: bytecode is written).
PIP_INSTALL := $(BIN)/python -m pip install -q --no-compile
# Where the environment says not to write bytecode, every process would compile torch again on each import.
unexport PYTHONDONTWRITEBYTECODE

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIP_INSTALL) --upgrade pip
	$(PIP_INSTALL) $(TORCH_SPEC)
	# recipes: Lightning, Accelerate, torchdata for examples/; they accept the torch installed above (pip
	# upgrades a dependency only when it must), so no other torch build is pulled in
	$(PIP_INSTALL) -e '.[test,recipes]'
	$(PIP_INSTALL) --no-deps $(TEST_NODEPS)
	touch $(STAMP)

install: $(STAMP)

install-bench: $(STAMP)
	$(PIP_INSTALL) $(TORCH_SPEC) -e '.[bench]'
	$(PIP_INSTALL) --no-deps $(BENCH_NODEPS)

demo: $(STAMP)
	$(BIN)/busctl demo

# A router and a provider of the datasets examples/ reads, on localhost, until Ctrl-C (examples/README.md)
serve-examples: $(STAMP)
	$(BIN)/python examples/serve.py

# systemd units (systemd/README.md) that run this checkout's venv; as root. UNITS_FLAGS=--root DIR etc.
install-units: $(STAMP)
	$(BIN)/busctl install-units --prefix $(abspath $(VENV)) $(UNITS_FLAGS)

# Lint, format and types (seconds, cached), then the tests.
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

# The tests start real processes that mostly wait on sockets, so they run in parallel (pytest-xdist,
# one test file per worker at a time, the longest files first: tests/support/schedule.py); the few that
# watch machine-wide state run alone afterwards.
# Both parts write a JUnit report; the run ends with its ten slowest tests and its totals
# (tests/support/slowest.py), so a test that grows is seen when it does.
# The lint's type check (mypy, the better part of a minute on a fresh clone) runs beside the parallel
# part, whose tests mostly wait on sockets; its report follows the tests', and either failing fails the run.
TEST_WORKERS ?= 3
TEST_REPORTS ?= .pytest_cache/reports
test: $(STAMP) tools
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	@mkdir -p $(TEST_REPORTS)
	@$(BIN)/mypy > $(TEST_REPORTS)/mypy.txt 2>&1 & types=$$!; \
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder -m "not serial" --junitxml=$(TEST_REPORTS)/parallel.xml; \
	tests=$$?; wait $$types; typed=$$?; echo "mypy:"; cat $(TEST_REPORTS)/mypy.txt; [ $$tests = 0 ] && [ $$typed = 0 ]
	$(BIN)/python -m pytest -q -m serial --junitxml=$(TEST_REPORTS)/serial.xml
	@$(BIN)/python -m tests.support.slowest $(TEST_REPORTS)/parallel.xml $(TEST_REPORTS)/serial.xml

# Programs some tests drive: Azurite from npm (az:// against the emulator; the venv keeps it, nothing is installed
# when the pinned version is there), tmux (busctl top on a terminal), iproute2's ip (hosts in network namespaces),
# Slurm and munge (a one-node Slurm cluster of the tests' own, tests/support/slurm.py; nothing is left running),
# shellcheck (the slurm/ recipes), chromium (busctl web in a real browser, driven by Playwright). Installed from
# Debian's packages when missing and we are root; else those tests say what is missing.
AZURITE_VERSION ?= 3.35.0
tools:
	@# Azurite (the Azure Storage emulator the az:// tests start; tests/support/emulators.py), pinned, kept in the venv
	@if command -v npm >/dev/null && [ "$$($(VENV)/azurite/node_modules/.bin/azurite-blob --version 2>/dev/null)" != "$(AZURITE_VERSION)" ]; then \
		echo "installing azurite@$(AZURITE_VERSION)"; npm install -s --no-audit --no-fund --prefix $(VENV)/azurite azurite@$(AZURITE_VERSION) >/dev/null \
		|| echo "azurite not installed: the az:// tests will be skipped"; fi
	@missing=""; for t in tmux:tmux ip:iproute2 sbatch:slurm-wlm munged:munge shellcheck:shellcheck chromium:chromium; do command -v $${t%%:*} >/dev/null || missing="$$missing $${t#*:}"; done; \
	if [ -n "$$missing" ] && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		echo "installing$$missing"; apt-get update -qq && apt-get install -y -qq $$missing >/dev/null; fi

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis .mypy_cache .ruff_cache
