"""Where the kernel put the ranks, call by call, and what each placement cost: run under the
launcher,

    .venv/bin/trioring run -n 4 bench/placement.py [--collective scatter] [--size 4M]
        [--calls 240]

Each call is timed as ``trioring bench`` times it (its arrays reset first, then the call,
then its check and a barrier, neither timed; inputs and checks from
src/trioring/_bench_cases.py). Right after each call, outside the timed region, every rank
reads the CPU it is on (``/proc/self/stat``, field 39). Rank 0 groups the calls (after the
first twelfth) by placement, as the number of ranks on each CPU in decreasing order ("2+2":
two ranks on each of two CPUs; "3+1 (rank 3 alone)": three on one, rank 3 on the other),
and prints, per placement, how many
calls had it and the median and 10th-90th percentiles of the slowest rank's time; then the
median of each block of 40 calls in order, where a placement that lasts shows as a stretch.

With more ranks than CPUs the kernel decides which ranks share a CPU, and that can hold for
a while: at world 4 on 2 cores a whole ``trioring bench`` cell of 48 calls can fall into one
placement, so a cell's median moves between launches with it.

``--mpi`` times Open MPI's call instead, through mpi4py as bench/compare.py's MPI side does
(bench/_mpi_worker.py's cells), under mpirun, with bench/compare.py's settings (shared memory;
mpirun's own channel on loopback, see bench/_mpirun.py; as root add ``--allow-run-as-root``)::

    mpirun -n 4 --oversubscribe --bind-to none --mca pml ob1 --mca btl self,vader \
        --mca oob_tcp_if_include lo \
        .venv/bin/python bench/placement.py --mpi [--collective scatter] [--size 4M]
"""

from __future__ import annotations

import argparse
import collections
import time

import numpy as np
import trio

import trioring
from trioring._bench import parse_sizes
from trioring._bench_cases import CASES

BLOCK = 40


def current_cpu() -> int:
    """The CPU this process last ran on (field 39 of ``/proc/self/stat``, counted after the
    command name, which may hold spaces, ends)."""
    with open("/proc/self/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return int(fields[36])


def placement(cpus: np.ndarray) -> str:
    """``"3+1 (rank 2 alone)"`` for ranks on CPUs ``[0, 0, 1, 0]``: ranks per CPU, most
    first, and the ranks that had a CPU to themselves (where the others did not), since
    which rank that is matters as much (a gather's root, alone, reads its peers faster)."""
    ranks = collections.defaultdict(list)
    for rank, cpu in enumerate(cpus.tolist()):
        ranks[cpu].append(rank)
    counts = sorted((len(group) for group in ranks.values()), reverse=True)
    where = "+".join(str(count) for count in counts)
    alone = [group[0] for group in ranks.values() if len(group) == 1]
    if alone and counts[0] > 1:
        where += " (rank " + ", ".join(str(rank) for rank in sorted(alone)) + " alone)"
    return where


async def main(collective: str, size: int, calls: int) -> None:
    async with trioring.open_communicator() as comm:
        case = CASES[collective].prepare(comm, max(1, size // 4), np.dtype(np.float32), "sum")
        times, cpus = np.zeros(calls), np.zeros(calls, np.int64)
        wrong = 0
        for i in range(calls):
            case.reset()
            start = time.perf_counter()
            result = await case.call()
            times[i] = time.perf_counter() - start
            cpus[i] = current_cpu()
            wrong += not case.check(result)
            await comm.barrier()
        every = await comm.allgather(cpus)
        await comm.allreduce(times, op="max")
        errors = np.array([wrong], np.int64)
        await comm.allreduce(errors)
        if errors[0]:
            raise SystemExit(f"{errors[0]} wrong results")
        if comm.rank == 0:
            report(f"{collective} {size} B, world {comm.world_size}", times, every)


def main_mpi(collective: str, size: int, calls: int) -> None:
    """:func:`main` for Open MPI's call (see the module's docstring)."""
    from _mpi_worker import prepare
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    _, reset, call, check = prepare(comm, collective, max(1, size // 4))
    times, cpus = np.zeros(calls), np.zeros(calls, np.int64)
    wrong = 0
    for i in range(calls):
        reset()
        start = time.perf_counter()
        call()
        times[i] = time.perf_counter() - start
        cpus[i] = current_cpu()
        wrong += not check()
        comm.Barrier()
    every = np.zeros((comm.Get_size(), calls), np.int64)
    comm.Allgather(cpus, every)
    slowest = np.zeros(calls)
    comm.Allreduce(times, slowest, op=MPI.MAX)
    errors = comm.allreduce(wrong)
    if errors:
        raise SystemExit(f"{errors} wrong results")
    if comm.Get_rank() == 0:
        report(f"Open MPI {collective} {size} B, world {comm.Get_size()}", slowest, every)


def report(what: str, times: np.ndarray, every: np.ndarray) -> None:
    """Print the calls' slowest-rank ``times`` grouped by the placement in ``every`` (the
    CPU of each rank, ``(n, calls)``), then by blocks in order."""
    calls = times.shape[0]
    skip = calls // 12
    by = collections.defaultdict(list)
    for i in range(skip, calls):
        by[placement(every[:, i])].append(times[i] * 1e6)
    print(f"{what}, {calls - skip} calls, slowest rank's time (us) by placement:")
    for where, spent in sorted(by.items(), key=lambda item: -len(item[1])):
        low, mid, high = np.percentile(spent, [10, 50, 90])
        print(f"  {where:>18}: {len(spent):4d} calls, median {mid:7.0f} ({low:.0f}-{high:.0f})")
    blocks = [f"{np.median(times[k : k + BLOCK]) * 1e6:.0f}" for k in range(0, calls, BLOCK)]
    print(f"  blocks of {BLOCK} calls, in order: " + " ".join(blocks), flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--collective", choices=sorted(CASES), default="scatter")
    parser.add_argument("--size", default="4M", help="bytes, as trioring bench's sizes")
    parser.add_argument("--calls", type=int, default=240)
    parser.add_argument("--mpi", action="store_true", help="Open MPI's call, under mpirun")
    args = parser.parse_args()
    (size,) = parse_sizes(args.size)
    if args.mpi:
        main_mpi(args.collective, size, args.calls)
    else:
        trio.run(main, args.collective, size, args.calls)
