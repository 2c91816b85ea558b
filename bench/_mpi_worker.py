"""One rank of the MPI side of bench/compare.py (started by mpirun): the collectives of
bench/_gloo_worker.py through mpi4py's buffer API on numpy arrays, timed as trioring bench
times them.

    mpirun -n 2 python bench/_mpi_worker.py 4,4096 allreduce,barrier [--back-to-back]

Sizes are trioring bench's (trioring/_bench_cases.py): the larger of one rank's buffers, so
the whole array for allreduce, broadcast and reduce, what a rank receives in all for
allgather and gather (the root's), what a rank sends in all for reduce_scatter, scatter (the
root's) and alltoall, split into world-size blocks. float32, root n-1, in place where
trioring's call is (allreduce, broadcast, the root's reduce). Each timed call is preceded by
trioring bench's untimed refill of the inputs and followed by an untimed barrier (unless
--back-to-back); every call's result is checked, outside the timed region. Rank 0 prints
``MPI-RESULTS <json>``: the median time per call of the slowest rank, for each cell, in the
shape of the Gloo worker's GLOO-RESULTS.
"""

from __future__ import annotations

import json
import sys
import time
from typing import TYPE_CHECKING

import mpi4py

# As the OSU micro-benchmarks initialise MPI (MPI_Init): one thread per rank, as trioring and
# Gloo's callers here. THREAD_MULTIPLE would make Open MPI take locks on every call.
mpi4py.rc.thread_level = "single"

import numpy as np  # noqa: E402
from _harness import exchanged, iterations, rows, warmup_iterations  # noqa: E402
from mpi4py import MPI  # noqa: E402

if TYPE_CHECKING:
    from collections.abc import Callable


def prepare(
    comm: MPI.Intracomm, collective: str, count: int
) -> tuple[int, Callable[[], None], Callable[[], None], Callable[[], bool]]:
    """(bytes moved, untimed refill, timed call, check of the result) of one cell."""
    rank, n = comm.Get_rank(), comm.Get_size()
    k = max(1, count // n)
    root = n - 1
    total = n * (n + 1) / 2  # the sum of every rank's value, rank + 1

    def nothing() -> None:
        pass

    if collective == "allreduce":
        array = np.empty(count, np.float32)
        return (
            array.nbytes,
            lambda: array.fill(rank + 1),
            lambda: comm.Allreduce(MPI.IN_PLACE, array, op=MPI.SUM),
            lambda: bool(np.all(array == total)),
        )
    if collective == "broadcast":
        array = np.empty(count, np.float32)
        return (
            array.nbytes,
            lambda: array.fill(rank + 1),
            lambda: comm.Bcast(array, root=root),
            lambda: bool(np.all(array == n)),
        )
    if collective == "barrier":
        return 0, nothing, comm.Barrier, lambda: True
    if collective == "reduce":
        array = np.empty(count, np.float32)

        def call() -> None:
            if rank == root:
                comm.Reduce(MPI.IN_PLACE, array, op=MPI.SUM, root=root)
            else:
                comm.Reduce(array, None, op=MPI.SUM, root=root)

        # Non-root arrays must come back unchanged, so they are checked too.
        expected = total if rank == root else rank + 1
        return (
            array.nbytes,
            lambda: array.fill(rank + 1),
            call,
            lambda: bool(np.all(array == expected)),
        )
    if collective == "allgather":
        x, out = np.full(k, rank + 1, np.float32), np.empty((n, k), np.float32)
        gathered_rows = rows(n, k)
        return (
            out.nbytes,
            lambda: out.fill(0),
            lambda: comm.Allgather(x, out),
            lambda: bool(np.array_equal(out, gathered_rows)),
        )
    if collective == "reduce_scatter":
        x, out = np.full(n * k, rank + 1, np.float32), np.empty(k, np.float32)
        return (
            x.nbytes,
            lambda: out.fill(0),
            lambda: comm.Reduce_scatter_block(x, out, op=MPI.SUM),
            lambda: bool(np.all(out == total)),
        )
    if collective == "gather":
        x = np.full(k, rank + 1, np.float32)
        gathered = np.empty((n, k), np.float32) if rank == root else None
        gathered_rows = rows(n, k) if rank == root else None
        return (
            n * x.nbytes,
            (lambda: gathered.fill(0)) if gathered is not None else nothing,
            lambda: comm.Gather(x, gathered, root=root),
            lambda: gathered is None or bool(np.array_equal(gathered, gathered_rows)),
        )
    if collective == "scatter":
        blocks = rows(n, k) if rank == root else None
        out = np.empty(k, np.float32)
        return (
            n * out.nbytes,
            lambda: out.fill(0),
            lambda: comm.Scatter(blocks, out, root=root),
            lambda: bool(np.all(out == rank + 1)),
        )
    if collective == "alltoall":
        x, out = exchanged(n, k, rank), np.empty((n, k), np.float32)
        expected = np.stack([exchanged(n, k, q)[rank] for q in range(n)])
        return (
            x.nbytes,
            lambda: out.fill(0),
            lambda: comm.Alltoall(x, out),
            lambda: bool(np.array_equal(out, expected)),
        )
    raise SystemExit(f"_mpi_worker: no MPI counterpart for {collective!r}")


def main() -> None:
    sizes = [int(s) for s in sys.argv[1].split(",")]
    collectives = sys.argv[2].split(",")
    back_to_back = sys.argv[3:] == ["--back-to-back"]
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    results = []
    wrong = []
    for collective in collectives:
        for size in sizes if collective != "barrier" else [0]:
            nbytes, reset, call, check = prepare(comm, collective, max(1, size // 4))
            warmup = warmup_iterations(iterations(size))
            times = np.zeros(warmup + iterations(size), dtype=np.float64)
            bad = 0
            for i in range(len(times)):
                reset()
                start = time.perf_counter()
                call()
                times[i] = time.perf_counter() - start
                # Every result, untimed, as trioring bench checks its own: a pass over the
                # result between calls changes what the caches hold when the next one starts,
                # so both sides make it.
                bad += not check()
                if not back_to_back:
                    comm.Barrier()  # as trioring bench does (see trioring/_bench.py)
            times = np.ascontiguousarray(times[warmup:])
            # The time of an iteration is its slowest rank's; a wrong result on any rank fails.
            comm.Allreduce(MPI.IN_PLACE, times, op=MPI.MAX)
            if comm.allreduce(bad, op=MPI.SUM):
                wrong.append(f"{collective} {nbytes} B")
            results.append(
                {
                    "collective": collective,
                    "size": nbytes,
                    "median_us": float(np.median(times)) * 1e6,
                }
            )
    if rank == 0:
        if wrong:
            print(f"_mpi_worker: wrong results: {', '.join(wrong)}", file=sys.stderr, flush=True)
        else:
            library = MPI.Get_library_version().splitlines()[0].split(",")[0].strip()
            print("MPI-LIBRARY " + library, flush=True)
            print("MPI-RESULTS " + json.dumps(results), flush=True)
    sys.exit(1 if wrong else 0)


if __name__ == "__main__":
    main()
