# Everything runs from a local virtual environment (.venv) that this Makefile creates and
# keeps up to date by itself: a fresh machine needs only Python 3.11+, git and make.
#
#   make demo    4 ranks over Unix sockets: correctness checks and a timing table
#   make test    the test suite
#   make test-oldest  part of the suite against the oldest trio, numpy and attrs that
#                pyproject.toml allows (a separate .venv-oldest); CI runs it
#   make lint    ruff (lint + format check) and mypy --strict
#   make docs    build the documentation site (strict) into site/; `make serve` to browse it
#   make bench   trioring vs torch.distributed Gloo and mpi4py over Open MPI (shared memory and
#                TCP) on this machine, worlds 2 and 4, alternating runs, and Open MPI in the
#                same ranks as trioring (bench/paired.py; 10-15 minutes on 2
#                cores); the Python floor, the budgets; prints the tables and writes
#                bench/results/*.json and the plots and tables of docs/performance.md. Installs
#                Open MPI from Debian's packages as root (BENCH_PEERS=gloo to leave MPI out)
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
.PHONY: help demo test test-oldest lint docs serve bench clean

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

# The suite starts thousands of Python processes. Where PYTHONDONTWRITEBYTECODE is set (as
# in many CI images and containers) each one would compile trioring's sources afresh: 0.11 s
# of the 0.54 s that `import trioring` took here. Compiled once up front, they are only read.
# The 30 slowest tests close every run's report: the suite took 8 minutes on the Intel Xeon
# machine and 23 on a slower AMD EPYC one, against a budget of about 15.
test: $(call INSTALL_STAMP,test) $(SYSTEM_STAMP)
	$(BIN)/python -m compileall -q src tests examples >/dev/null
	$(BIN)/python -m pytest --durations=30

# The lower bounds in pyproject.toml are a promise: these tests run against exactly those
# versions (.ci/oldest_pins.py reads them). The code used trio 0.31's
# CancelScope.cancel(reason=) for weeks while pyproject.toml said trio>=0.30. The in-process
# tests and the multi-process ones that need no launcher: 3 minutes on 2 cores.
OLDEST := .venv-oldest
OLDEST_TESTS := tests/test_units.py tests/test_local_world.py tests/test_gather.py \
	tests/test_deadlines.py tests/test_kind_mismatch.py tests/test_split.py \
	tests/test_p2p_comm.py tests/test_objects.py tests/test_multiprocess_errors.py
test-oldest: $(VENV_STAMP)
	rm -rf $(OLDEST)
	$(BIN)/python -m venv $(OLDEST)
	$(OLDEST)/bin/python -m pip install --quiet $$($(BIN)/python .ci/oldest_pins.py) \
		pytest pytest-trio pytest-timeout hypothesis
	$(OLDEST)/bin/python -m pip install --quiet --no-deps -e .
	$(OLDEST)/bin/python -c "import trio, numpy, attrs; print('oldest:', 'trio', trio.__version__, 'numpy', numpy.__version__, 'attrs', attrs.__version__)"
	$(OLDEST)/bin/python -m pytest -p no:cacheprovider $(OLDEST_TESTS)

lint: $(call INSTALL_STAMP,dev)
	$(BIN)/ruff check src tests examples bench docs
	$(BIN)/ruff format --check src tests examples bench docs
	$(BIN)/mypy

docs: $(call INSTALL_STAMP,dev)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

serve: $(call INSTALL_STAMP,dev)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs serve

# The MPI peers of `make bench` (bench/_mpi_worker.py under mpirun) need Open MPI: mpirun, and
# mpicc with Open MPI's headers in case mpi4py has to be built from source. As root (CI,
# containers) they are installed from Debian's packages, openmpi-bin and libopenmpi-dev;
# otherwise install them yourself, or leave those peers out (make bench BENCH_PEERS=gloo).
BENCH_SYSTEM_STAMP := $(VENV)/.stamp-system-bench
$(BENCH_SYSTEM_STAMP): $(VENV_STAMP)
	@if command -v mpirun >/dev/null 2>&1 && command -v mpicc >/dev/null 2>&1 && \
		[ -n "$$(for dir in $$(mpicc --showme:incdirs 2>/dev/null); do ls "$$dir/mpi.h" 2>/dev/null; done)" ]; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openmpi-bin libopenmpi-dev >/dev/null; \
	else echo "note: mpirun or mpicc (Open MPI's headers) missing and not root: install openmpi-bin and libopenmpi-dev, or run make bench BENCH_PEERS=gloo" >&2; fi
	@touch $@

# mpi4py's wheel from PyPI carries an Open MPI build and an MPICH one and loads the system's
# libmpi when imported: with Debian 12's Open MPI 4.1.4 it runs as it is (mpi4py 4.1.2:
# libmpi.so.40 from /usr/lib). The check below starts two ranks that must report Open MPI;
# where the wheel does not run, mpi4py is built from source with mpicc (libopenmpi-dev).
MPI_CHECK = timeout 120 mpirun --allow-run-as-root --oversubscribe -n 2 --mca btl self,vader \
	$$($(BIN)/python bench/_mpirun.py) $(BIN)/python -c "from mpi4py import MPI; print(MPI.Get_library_version())" 2>&1
$(call INSTALL_STAMP,bench): pyproject.toml $(VENV_STAMP) $(BENCH_SYSTEM_STAMP)
	$(BIN)/python -m pip install --quiet -e .
	$(BIN)/python -m pip install --quiet --group bench
	@if ! command -v mpirun >/dev/null 2>&1; then \
		echo "note: no mpirun: the MPI peers of make bench cannot run (BENCH_PEERS=gloo leaves them out)" >&2; \
	else case "$$($(MPI_CHECK))" in *"Open MPI"*) ;; *) \
		echo "note: mpi4py's wheel does not run against this Open MPI: building mpi4py from source with mpicc" >&2; \
		$(BIN)/python -m pip install --quiet --force-reinstall --no-deps --no-binary mpi4py 'mpi4py>=4.1' || exit 1; \
		out="$$($(MPI_CHECK))"; case "$$out" in *"Open MPI"*) ;; *) \
			printf 'error: mpi4py does not run against Open MPI, even built from source:\n%s\n' "$$out" >&2; exit 1;; esac;; esac; fi
	@touch $@

BENCH_SIZES ?= 4:64M
# The collectives beyond allreduce, broadcast and barrier, at the sizes of their targets: all
# sizes for all of them would double the run.
BENCH_MORE := reduce allgather reduce_scatter gather scatter alltoall
BENCH_MORE_SIZES ?= 4,64K,4M
# Gloo's timings wobble by 10-20 % from run to run: medians of 5 alternating rounds.
BENCH_ROUNDS ?= 5
# Each round runs trioring, then each peer: Gloo, mpi4py over Open MPI's shared-memory
# transport (vader), over its TCP one on loopback.
BENCH_PEERS ?= gloo,mpi-shm,mpi-tcp
# trioring over TCP against the TCP peers among those.
comma := ,
BENCH_TCP_PEERS ?= $(subst $() ,$(comma),$(filter gloo mpi-tcp,$(subst $(comma), ,$(BENCH_PEERS))))
COMPARE = $(BIN)/python bench/compare.py --rounds $(BENCH_ROUNDS)
# trioring and Open MPI in the same ranks, a few milliseconds apart (bench/paired.py): the
# target cells, each side measured in the same stretch of the machine's speed.
BENCH_PAIRED_SIZES ?= 4,4K,64K,256K,4M,64M
PAIRED = $(BIN)/python bench/paired.py --sizes $(BENCH_PAIRED_SIZES)
bench: $(call INSTALL_STAMP,bench)
	@mkdir -p bench/results
	$(COMPARE) -n 2 --peers=$(BENCH_PEERS) --sizes $(BENCH_SIZES) --json bench/results/compare_w2.json
	$(COMPARE) -n 4 --peers=$(BENCH_PEERS) --sizes $(BENCH_SIZES) --json bench/results/compare_w4.json
	$(COMPARE) -n 2 --peers=$(BENCH_PEERS) --sizes $(BENCH_MORE_SIZES) $(BENCH_MORE:%=--collective %) --json bench/results/compare_more_w2.json
	$(COMPARE) -n 4 --peers=$(BENCH_PEERS) --sizes $(BENCH_MORE_SIZES) $(BENCH_MORE:%=--collective %) --json bench/results/compare_more_w4.json
	$(COMPARE) -n 2 --peers=$(BENCH_TCP_PEERS) --transport tcp --sizes 4M,64M --collective allreduce --json bench/results/compare_tcp_w2.json
	$(if $(findstring mpi-shm,$(BENCH_PEERS)),$(PAIRED) -n 2 --json bench/results/paired_w2.json)
	$(if $(findstring mpi-shm,$(BENCH_PEERS)),$(PAIRED) -n 4 --json bench/results/paired_w4.json)
	$(BIN)/python bench/budget.py --json bench/results/budget.json
	$(BIN)/python bench/floor.py --json bench/results/floor.json
	$(BIN)/python bench/plot.py bench/results/compare_w2.json bench/results/compare_w4.json \
		bench/results/compare_more_w2.json bench/results/compare_more_w4.json bench/results/compare_tcp_w2.json

clean:
	rm -rf $(VENV) $(OLDEST) build dist site .pytest_cache .mypy_cache .ruff_cache .hypothesis
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
	find . -name '*.egg-info' -type d -prune -exec rm -rf {} +
