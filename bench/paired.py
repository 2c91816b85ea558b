"""trioring and Open MPI timed in the same processes, a few milliseconds apart.

    .venv/bin/python bench/paired.py -n 2 [--sizes 4,64K,4M] [--collective all] [--windows 9]
        [--json out.json] [--markdown]

``bench/compare.py`` alternates whole launches: trioring's run, then Open MPI's, seconds
apart. On a machine whose speed for moving memory between cores changes every few seconds
(``bench/modes.py``: 3-4x at 64-256 KiB on this project's virtual machines), two sides of
one cell can land in different stretches, and their ratio is off by that much either way.
Here both libraries live in the same ranks: ``mpirun`` starts them (``--bind-to none``, the
``ob1`` PML over the ``vader`` shared-memory BTL, as compare.py's ``mpi-shm``), each rank
opens a trioring communicator too (Unix sockets with the one-host paths, found from
mpirun's variables), and every cell runs ``--windows`` windows, each one trioring's block
of calls and Open MPI's block back to back (the order swapping every window). A window
takes milliseconds, so both sides of it see the same machine, and the ratio of a window's
two medians is a like-for-like comparison.

Each block is a few untimed calls, then timed calls as ``trioring bench`` and
bench/_mpi_worker.py make them (refill, time the call, check the result, an untimed barrier
of the same library), counted as the slowest rank's time. Reported per cell: each side's
median over the windows of its block medians, and the median (and range) over windows of
the per-window ratio trioring / Open MPI. Every result of every side is checked; a wrong
one fails the run.

Every cell has a third side, timed in the same windows: up to 256 KiB (and the barrier) the
floor of trioring's shared-segment design (bench/_floor_worker.py), the same copies and
reductions through a shared mapping with no event loop, no checks and no call identity (its
untimed barrier is Open MPI's); above, the floor of a single-copy design
(bench/_copy_floor.py): the reads by ``process_vm_readv`` and the reductions that trioring's
cross-memory algorithms make, with nothing but the counters that keep them correct. Its
ratio to Open MPI's time bounds what any Python library built that way could reach at that
size here; the gap from it to trioring's time is what trioring's call costs above its
copies (or, where trioring takes the segment's pipe, what its two copies cost against one).
A fourth side, in the same windows, is that floor as a Trio-native
call must at least be: the same steps in the ranks' Trio event loop (trioring's own, with
its communicator open and idle), with the one schedule point every public async function
owes, taken where trioring's segment takes it (the first look of a wait that must wait,
else after the call). Its ratio bounds any Trio library built on that design: a cell where
it is already past the target cannot meet it, whatever the rest of the call costs.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from _machine import describe, machine
from _mpirun import loopback_args

from trioring._bench import format_size, parse_sizes

HERE = Path(__file__).parent
COLLECTIVES = (
    "barrier", "allreduce", "broadcast", "reduce", "allgather", "reduce_scatter", "gather",
    "scatter", "alltoall",
)  # fmt: skip


def _timed(size: int) -> tuple[int, int]:
    """(untimed, timed) calls per block: short blocks, so that a window stays within one of
    the machine's stretches; at 64 MiB one call alone takes 10-100 ms."""
    if size <= 256 * 1024:
        return 5, 40
    if size <= 4 * 1024**2:
        return 2, 15
    return 1, 3


def _rank(sizes: list[int], collectives: list[str], windows: int) -> None:
    """One rank: both libraries and the floor, every cell, ``windows`` windows each."""
    sys.path.insert(0, str(HERE))
    import _mpi_worker  # sets mpi4py's thread level before MPI starts
    import numpy as np
    import trio
    from _floor_worker import (
        open_over,
        plain as plain_floor,
        prepare_any as prepare_floor,
        scheduled as scheduled_floor,
    )
    from mpi4py import MPI

    import trioring
    from trioring._bench_cases import CASES

    world = MPI.COMM_WORLD
    segment = open_over(world)

    async def main() -> None:
        async with trioring.open_communicator() as comm:
            features = sorted(comm.features)
            cells = []
            wrong = []
            for collective in collectives:
                for size in sizes if collective != "barrier" else [0]:
                    count = max(1, size // 4) if collective != "barrier" else 0
                    ours = CASES[collective].prepare(comm, count, np.dtype(np.float32), "sum")
                    nbytes, reset, call, check = _mpi_worker.prepare(
                        world, collective, max(1, size // 4)
                    )
                    floor = prepare_floor(segment, collective, max(1, size // 4))
                    # The sides that are plain functions: (refill, call, check of the result).
                    plain = {"mpi": (reset, call, check)}
                    # The floor under Trio: an async call, (refill, call, check).
                    floor_trio = None
                    if floor is not None:
                        refill, steps, floor_check = floor
                        plain["floor"] = (refill, plain_floor(segment, steps), floor_check)
                        floor_trio = (refill, scheduled_floor(segment, steps), floor_check)
                    untimed, timed = _timed(size)
                    names = ["trioring", *plain] + (["floor_trio"] if floor_trio else [])
                    sides: dict[str, list[float]] = {name: [] for name in names}
                    bad = dict.fromkeys(names, 0)
                    for window in range(windows):
                        # Each side goes first, second and last in turn.
                        turn = window % len(names)
                        for side in names[turn:] + names[:turn]:
                            times = np.zeros(timed)
                            for i in range(untimed + timed):
                                if side == "trioring":
                                    ours.reset()
                                    start = time.perf_counter()
                                    result = await ours.call()
                                    took = time.perf_counter() - start
                                    bad[side] += not ours.check(result)
                                    await comm.barrier()
                                elif side == "floor_trio":
                                    assert floor_trio is not None
                                    refill, floor_call, floor_check = floor_trio
                                    refill()
                                    start = time.perf_counter()
                                    await floor_call()
                                    took = time.perf_counter() - start
                                    bad[side] += not floor_check()
                                    world.Barrier()
                                else:
                                    refill, plain_call, plain_check = plain[side]
                                    refill()
                                    start = time.perf_counter()
                                    plain_call()
                                    took = time.perf_counter() - start
                                    bad[side] += not plain_check()
                                    world.Barrier()  # the floor's too: it has none of its own
                                if i >= untimed:
                                    times[i - untimed] = took
                            world.Allreduce(MPI.IN_PLACE, times, op=MPI.MAX)
                            sides[side].append(float(np.median(times)) * 1e6)
                    for side, errors in bad.items():
                        if world.allreduce(errors, op=MPI.SUM):
                            wrong.append(f"{side} {collective} {nbytes} B")
                    cell: dict[str, Any] = {
                        "collective": collective,
                        "size": ours.nbytes,
                        "world_size": comm.world_size,
                        "windows": {f"{side}_us": times for side, times in sides.items()},
                    }
                    for side, times in sides.items():
                        cell[f"{side}_us"] = statistics.median(times)
                    for side, prefix in (
                        ("trioring", ""),
                        ("floor", "floor_"),
                        ("floor_trio", "floor_trio_"),
                    ):
                        if side in sides:
                            ratios = [t / m for t, m in zip(sides[side], sides["mpi"], strict=True)]
                            cell[f"{prefix}ratio"] = statistics.median(ratios)
                            cell[f"{prefix}ratio_min"] = min(ratios)
                            cell[f"{prefix}ratio_max"] = max(ratios)
                    cells.append(cell)
            if comm.rank == 0:
                if wrong:
                    print("paired: wrong results: " + ", ".join(wrong), file=sys.stderr)
                library = MPI.Get_library_version().splitlines()[0].split(",")[0].strip()
                print(
                    "PAIRED-RESULTS "
                    + json.dumps({"library": library, "features": features, "cells": cells}),
                    flush=True,
                )
            if wrong:
                raise SystemExit(1)

    trio.run(main)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", type=int, default=2, help="ranks (default 2)")
    parser.add_argument(
        "--sizes", default="4,64K,4M", help="sizes, as trioring bench's (a list or LOW:HIGH)"
    )
    parser.add_argument("--collective", action="append", help="repeatable, or 'all' (default: all)")
    parser.add_argument("--windows", type=int, default=9, help="windows per cell (default 9)")
    parser.add_argument("--mpirun", help="Open MPI's mpirun (default: mpirun on PATH)")
    parser.add_argument("--json", help="also write the cells to this file")
    parser.add_argument("--markdown", action="store_true", help="print a Markdown table")
    args = parser.parse_args()
    chosen = args.collective or ["all"]
    collectives = list(COLLECTIVES) if "all" in chosen else chosen
    sizes = parse_sizes(args.sizes)
    mpirun = args.mpirun or shutil.which("mpirun")
    if mpirun is None:
        raise SystemExit("paired: needs Open MPI's mpirun (make bench installs it)")
    command = [
        mpirun, "--allow-run-as-root", "--oversubscribe", "-n", str(args.n), "--bind-to", "none",
        "--mca", "pml", "ob1", "--mca", "btl", "self,vader", *loopback_args(mpirun),
        sys.executable, __file__, "--rank", ",".join(map(str, sizes)), ",".join(collectives),
        str(args.windows),
    ]  # fmt: skip
    done = subprocess.run(
        command,
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        timeout=1800,
        check=False,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("PAIRED-RESULTS ")]
    if done.returncode or not lines:
        raise SystemExit(f"paired: the ranks failed ({done.returncode}):\n{done.stderr[-4000:]}")
    report: dict[str, Any] = json.loads(lines[0].split(" ", 1)[1])
    report["command"] = " ".join(["bench/paired.py", *sys.argv[1:]])
    report["machine"] = machine()
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    print(
        f"world {args.n}, trioring ({', '.join(report['features'])}) and {report['library']} "
        f"(vader) in the same ranks; {args.windows} windows per cell; on "
        f"{describe(report['machine'])}"
    )
    header = (
        "| collective | size | trioring (us) | MPI shm (us) | ratio, median of windows | range "
        "| floor (us) | floor / MPI (range) | floor + Trio (us) | floor + Trio / MPI (range) |"
    )
    print(header if args.markdown else header.replace("|", " "))
    if args.markdown:
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for cell in report["cells"]:
        floors = " | ".join(
            f"{cell[f'{prefix}us']:.1f} | {cell[f'{prefix}ratio']:.2f} "
            f"({cell[f'{prefix}ratio_min']:.2f}-{cell[f'{prefix}ratio_max']:.2f})"
            if f"{prefix}us" in cell
            else " | "
            for prefix in ("floor_", "floor_trio_")
        )
        row = (
            f"| {cell['collective']} | {format_size(cell['size'])} | {cell['trioring_us']:.1f} | "
            f"{cell['mpi_us']:.1f} | {cell['ratio']:.2f} | "
            f"{cell['ratio_min']:.2f}-{cell['ratio_max']:.2f} | {floors} |"
        )
        print(row if args.markdown else row.replace("|", " "))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--rank"]:
        _rank([int(s) for s in sys.argv[2].split(",")], sys.argv[3].split(","), int(sys.argv[4]))
    else:
        main()
