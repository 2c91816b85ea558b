# Everything runs from a local virtual environment (.venv) that this Makefile creates and
# keeps up to date by itself: a fresh machine needs only Python 3.11+, git and make.
#
#   make demo    4 ranks over Unix sockets: correctness checks and a timing table
#   make test    the test suite
#   make lint    ruff (lint + format check) and mypy --strict
#   make docs    build the documentation site (strict) into site/; `make serve` to browse it
#   make bench   trioring vs torch.distributed Gloo on this machine (worlds 2 and 4, a few minutes);
#                writes bench/results/*.json and the plots and table of docs/performance.md
#   make clean   remove .venv, caches and build outputs
#
# Use another interpreter with e.g. `make test PYTHON=python3.12` (after `make clean` if
# .venv already exists: the venv keeps the interpreter it was created with).

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

# Stamp files record what is installed in .venv. Each depends on pyproject.toml, so an edit
# there (new dependency, new extra) reinstalls on the next run, and nothing else does.
VENV_STAMP := $(VENV)/.stamp-venv
INSTALL_STAMP = $(VENV)/.stamp-install-$(1)

.DEFAULT_GOAL := help
.DELETE_ON_ERROR:
.PHONY: help demo test lint docs serve bench clean

help:
	@sed -n 's/^#   //p' $(firstword $(MAKEFILE_LIST))

# Python 2 parses this too, so even a very old interpreter gets the message, not a SyntaxError.
define CHECK_PYTHON
import sys
if sys.version_info < (3, 11):
    sys.exit("trioring needs Python 3.11 or newer, but %s is Python %s.\n"
             "Install one and run e.g. `make PYTHON=python3.11 ...`."
             % (sys.executable, sys.version.split()[0]))
endef
export CHECK_PYTHON

$(VENV_STAMP):
	@command -v $(PYTHON) >/dev/null 2>&1 || \
		{ echo "error: '$(PYTHON)' not found; install Python 3.11+ or run make PYTHON=/path/to/python3" >&2; exit 1; }
	@$(PYTHON) -c "$$CHECK_PYTHON"
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	@touch $@

$(call INSTALL_STAMP,base): pyproject.toml $(VENV_STAMP)
	$(BIN)/python -m pip install --quiet -e .
	@touch $@

# The docs extra too: tests/test_docs.py builds the site.
$(call INSTALL_STAMP,test): pyproject.toml $(VENV_STAMP)
	$(BIN)/python -m pip install --quiet -e '.[test,docs]'
	$(BIN)/python -m pip install --quiet --group interop
	@touch $@

# The launcher interop tests need Open MPI's mpirun and iproute2's ip (network namespaces);
# the network fault tests also need iptables (partitions). As root (CI, containers) they are
# installed from Debian's packages; otherwise install openmpi-bin, iproute2 and iptables
# yourself, or those tests fail saying what is missing.
SYSTEM_STAMP := $(VENV)/.stamp-system
$(SYSTEM_STAMP): $(VENV_STAMP)
	@if command -v mpirun >/dev/null 2>&1 && command -v ip >/dev/null 2>&1 && command -v iptables >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openmpi-bin iproute2 iptables >/dev/null; \
	else echo "note: mpirun, ip or iptables missing and not root: tests/test_interop.py and tests/test_netfaults.py will fail" >&2; fi
	@touch $@

$(call INSTALL_STAMP,dev): pyproject.toml $(VENV_STAMP)
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	@touch $@

demo: $(call INSTALL_STAMP,base)
	$(BIN)/trioring run -n 4 examples/demo.py

test: $(call INSTALL_STAMP,test) $(SYSTEM_STAMP)
	$(BIN)/python -m pytest

lint: $(call INSTALL_STAMP,dev)
	$(BIN)/ruff check src tests examples bench docs
	$(BIN)/ruff format --check src tests examples bench docs
	$(BIN)/mypy

docs: $(call INSTALL_STAMP,dev)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

serve: $(call INSTALL_STAMP,dev)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs serve

$(call INSTALL_STAMP,bench): pyproject.toml $(VENV_STAMP)
	$(BIN)/python -m pip install --quiet -e .
	$(BIN)/python -m pip install --quiet --group bench
	@touch $@

BENCH_SIZES ?= 4:64M
# Gloo's timings wobble by 10-20 % from run to run: medians of 5 alternating rounds.
BENCH_ROUNDS ?= 5
bench: $(call INSTALL_STAMP,bench)
	@mkdir -p bench/results
	$(BIN)/python bench/compare.py -n 2 --sizes $(BENCH_SIZES) --rounds $(BENCH_ROUNDS) --json bench/results/compare_w2.json
	$(BIN)/python bench/compare.py -n 4 --sizes $(BENCH_SIZES) --rounds $(BENCH_ROUNDS) --json bench/results/compare_w4.json
	$(BIN)/python bench/compare.py -n 2 --transport tcp --sizes 4M,64M --collective allreduce --rounds $(BENCH_ROUNDS) --json bench/results/compare_tcp_w2.json
	$(BIN)/python bench/budget.py --json bench/results/budget.json
	$(BIN)/python bench/plot.py bench/results/compare_w2.json bench/results/compare_w4.json bench/results/compare_tcp_w2.json

clean:
	rm -rf $(VENV) build dist site .pytest_cache .mypy_cache .ruff_cache .hypothesis
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
	find . -name '*.egg-info' -type d -prune -exec rm -rf {} +
