"""One rank of tests/test_reduce.py's real-process tests.

``trioring run -n N --transport T reduce_worker.py MODE OUT_DIR [ARGS]``. Modes:

- ``check``: reduce_scatter, reduce_scatterv and reduce (by every algorithm that takes the
  size: the shared segment's where the world has one) at several
  sizes and ops, checked against numpy (inputs integer-valued, so exact in any order); the
  report (``rank{RANK}.json``) lists any errors.
- ``kill COLLECTIVE VICTIM ALGORITHM``: every rank runs COLLECTIVE (``reduce_scatter`` or
  ``reduce``, root 0) by ALGORITHM (forced) on 16 MiB of float32 (1 MiB chunks); rank
  VICTIM SIGKILLs itself at its third reduction of a chunk, in the middle of the call.
  Survivors report what they raised and how long after the victim's death, measured from
  the call's start. They ignore SIGTERM, so that the launcher's teardown after the
  victim's death does not race their report.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import trio

import trioring
from trioring._collectives import _decision, _reduce
from trioring._collectives._allreduce import UFUNCS as SUM_UFUNCS, ReduceOp

UFUNCS = {"sum": np.add, "min": np.minimum, "max": np.maximum, "prod": np.multiply}


def make(seed: int, rank: int, count: int, dtype: str) -> np.ndarray[Any, Any]:
    return np.random.default_rng([seed, rank]).integers(-3, 4, count).astype(dtype)


def runnable(comm: trioring.Communicator, algorithm: str, nbytes: int) -> bool:
    """Whether the forced ``algorithm`` takes an input of ``nbytes`` here."""
    if algorithm == "shm":
        # Forced, the slots take up to their reductions' share (the table stops sooner
        # where some rank is crowded: _reduce.shm_limit).
        return "shm" in comm.features and nbytes <= comm._world.slot_wide_reduce_bytes
    if algorithm == "cma":
        return "cma" in comm.features
    if algorithm == "pipe":
        return "shm" in comm.features
    if algorithm == "recursive_halving":
        return nbytes <= _reduce.small_bytes(comm._world)
    return True


async def check(comm: trioring.Communicator, errors: list[str]) -> None:
    n, r = comm.world_size, comm.rank
    for seed, (block, dtype, op) in enumerate(
        [
            (0, "float32", "sum"),
            (1, "int32", "max"),
            (333, "float64", "min"),
            (70_001, "int64", "sum"),
            # Fills the shared segment's slot at world 4 (256 KiB).
            (16_384, "float32", "sum"),
            # Fills the reductions' share of the slot (512 KiB at worlds 2-3) to within
            # the reduce's odd element.
            (comm._world.slot_wide_reduce_bytes // (4 * n) - 1, "float32", "sum"),
        ]
    ):
        for algorithm in _decision.ALGORITHMS["reduce_scatter"]:
            nbytes = n * block * np.dtype(dtype).itemsize
            if not runnable(comm, algorithm, nbytes):
                continue
            comm._force_algorithm("reduce_scatter", algorithm)
            comm._force_algorithm("reduce_scatterv", algorithm)
            inputs = [make(seed, q, n * block, dtype) for q in range(n)]
            expected = UFUNCS[op].reduce(np.stack(inputs), axis=0)
            mine = await comm.reduce_scatter(inputs[r].reshape(n, block), op=op)
            if not np.array_equal(mine, expected[r * block : (r + 1) * block]):
                errors.append(f"{algorithm} reduce_scatter {dtype}[{n}x{block}] {op}: wrong result")
            counts = [(block + 3 * q) % (block + 2) for q in range(n)]
            total = sum(counts)
            if not runnable(comm, algorithm, total * np.dtype(dtype).itemsize):
                continue
            inputs = [make(seed, q, total, dtype) for q in range(n)]
            expected = UFUNCS[op].reduce(np.stack(inputs), axis=0)
            mine = await comm.reduce_scatterv(inputs[r], counts=counts, op=op)
            start = sum(counts[:r])
            if not np.array_equal(mine, expected[start : start + counts[r]]):
                errors.append(f"{algorithm} reduce_scatterv {dtype}{counts} {op}: wrong result")
        comm._force_algorithm("reduce_scatter", None)
        comm._force_algorithm("reduce_scatterv", None)
        for algorithm in _decision.ALGORITHMS["reduce"]:
            if not runnable(comm, algorithm, (n * block + 1) * np.dtype(dtype).itemsize):
                continue
            comm._force_algorithm("reduce", algorithm)
            for root in (0, n - 1):
                inputs = [make(seed, q, n * block + 1, dtype) for q in range(n)]
                y = inputs[r].copy()
                await comm.reduce(y, root=root, op=op)
                want = UFUNCS[op].reduce(np.stack(inputs), axis=0) if r == root else inputs[r]
                if not np.array_equal(y, want):
                    errors.append(
                        f"{algorithm} reduce {dtype}[{y.size}] {op} root {root}: wrong on rank {r}"
                    )
        comm._force_algorithm("reduce", None)


def kill_at_third_reduction() -> None:
    """Make the sum, whichever algorithm reduces with it, SIGKILL this process the third
    time it runs: the ufunc that the collectives hand the algorithms is replaced."""
    calls = [0]

    def counting(a: Any, b: Any, out: Any) -> Any:
        calls[0] += 1
        if calls[0] == 3:
            os.kill(os.getpid(), signal.SIGKILL)
        return np.add(a, b, out=out)

    SUM_UFUNCS[ReduceOp.SUM] = counting  # type: ignore[assignment]


async def main(mode: str, out_dir: Path, args: list[str]) -> int:
    errors: list[str] = []
    report: dict[str, Any] = {"errors": errors}
    if mode == "kill":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    with trio.fail_after(60):
        async with trioring.open_communicator() as comm:
            rank = comm.rank
            if mode == "check":
                await check(comm, errors)
            else:
                collective, victim, algorithm = args[0], int(args[1]), args[2]
                comm._force_algorithm(collective, algorithm)
                if rank == victim:
                    kill_at_third_reduction()
                x = np.ones(4 * 1024 * 1024, np.float32)
                await comm.barrier()
                started = time.monotonic()
                try:
                    if collective == "reduce_scatter":
                        await comm.reduce_scatter(x)
                    else:
                        await comm.reduce(x, root=0)
                except trioring.CollectiveError as exc:
                    report["error"] = type(exc).__name__
                    report["message"] = str(exc)
                else:
                    report["error"] = None
                report["elapsed"] = time.monotonic() - started
    (out_dir / f"rank{rank}.json").write_text(json.dumps(report))
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(trio.run(main, sys.argv[1], Path(sys.argv[2]), sys.argv[3:]))
