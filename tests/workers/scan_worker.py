"""One rank of tests/test_scan.py's and tests/test_bitwise_ops.py's real-process tests.

``trioring run -n N --transport T scan_worker.py MODE OUT_DIR [ARGS]``. Modes:

- ``check``: scan and exscan at several sizes (one across the 1 MiB chunks), dtypes and
  ops, checked against numpy's accumulate over the ranks (inputs from tests/exact_inputs.py,
  exact in any order); then random floats by every algorithm this world can run, forced in
  turn, bitwise the same by each; the report (``rank{RANK}.json``) lists any errors, and
  counts the calls into the shared segment's scan.
- ``kill COLLECTIVE VICTIM``: every rank runs COLLECTIVE (``scan`` or ``exscan``) on 16 MiB
  of float32 (16 chunks); rank VICTIM SIGKILLs itself at its third reduction, in the
  middle of the call. Survivors report what they raised (type, peer, message) and how long
  after the call's start. They ignore SIGTERM, so that the launcher's teardown after the
  victim's death does not race their report.
- ``bitwise``: allreduce forced to each of its algorithms that this world can run (the
  one-host ``shm`` and ``cma`` only with their feature), then reduce and reduce_scatter,
  with band, bor and bxor on integers and bool (and bool's min and max), checked against
  numpy and, for allreduce, bitwise against rank 0's result. The calls into the one-host
  algorithms are counted, to show that they ran.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import _worker_util
import numpy as np
import trio

import trioring
from trioring import _algorithms
from trioring._collectives import _decision
from trioring._onehost import _cma_reductions, _shm_reductions

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from exact_inputs import UFUNCS, make, ops_for

CALLS: dict[str, int] = {}


def prefix(inputs: list[np.ndarray[Any, Any]], op: str, rank: int, exclusive: bool) -> Any:
    """What rank ``rank`` must hold after the scan (None: exscan's rank 0)."""
    if exclusive and rank == 0:
        return None
    upto = rank if exclusive else rank + 1
    stacked = np.stack(inputs[:upto])
    with np.errstate(all="ignore"):
        return UFUNCS[op].reduce(stacked, axis=0, dtype=stacked.dtype)


async def check(comm: trioring.Communicator, errors: list[str]) -> None:
    n, r = comm.world_size, comm.rank
    cases = [
        (0, "float32", "sum"),
        (1, "int32", "max"),
        (5, "bool", "bor"),
        (333, "float64", "prod"),
        (77, "uint16", "bxor"),
        (300_001, "int64", "sum"),  # 2.4 MB: three chunks
    ]
    for seed, (count, dtype_name, op) in enumerate(cases):
        dtype = np.dtype(dtype_name)
        inputs = [make(seed, q, count, dtype, op) for q in range(n)]
        for name in ("scan", "exscan"):
            array = inputs[r].copy()
            await getattr(comm, name)(array, op=op)
            expected = prefix(inputs, op, r, name == "exscan")
            if expected is not None and not np.array_equal(array, expected):
                errors.append(f"{name} {dtype}[{count}] {op}: wrong result on rank {r}")
    await same_bits_by_every_algorithm(comm, errors)


async def same_bits_by_every_algorithm(comm: trioring.Communicator, errors: list[str]) -> None:
    """Random floats, whose last bits tell orders of operations apart, scanned by every
    algorithm that this world can run, forced in turn (the shared segment's only with the
    "shm" feature): every rank's result bitwise the same by each, and each also overwritten
    at once by the caller (the next call starts from a fresh copy)."""
    n, r = comm.world_size, comm.rank
    names = [
        name
        for name in _decision.ALGORITHMS["scan"]
        if name != "shm" or ("shm" in comm.features and n > 1)
    ]
    cases = [("float64", "sum", 21), ("float32", "prod", 5), ("complex64", "prod", 1)]
    cases += [("complex128", "sum", 9), ("float16", "sum", 40), ("float32", "sum", 65_536)]
    for seed, (dtype_name, op, count) in enumerate(cases):
        rng = np.random.default_rng([seed, r, 7])
        values = rng.standard_normal(count) * 3
        if np.dtype(dtype_name).kind == "c":
            values = values + 1j * rng.standard_normal(count)
        mine = values.astype(dtype_name)
        for kind in ("scan", "exscan"):
            results = {}
            for name in names:
                comm._force_algorithm(kind, name)
                array = mine.copy()
                await getattr(comm, kind)(array, op=op)
                results[name] = array.tobytes()
                array[...] = 0
            comm._force_algorithm(kind, None)
            if len(set(results.values())) != 1:
                errors.append(
                    f"{kind} {dtype_name}[{count}] {op}: {sorted(results)} differ on rank {r}"
                )


def kill_at_third_reduction() -> None:
    original = _algorithms.recursive_doubling_scan
    calls = [0]

    def counting(a: Any, b: Any, out: Any) -> Any:
        calls[0] += 1
        if calls[0] == 3:
            os.kill(os.getpid(), signal.SIGKILL)
        return np.add(a, b, out=out)

    async def wrapper(*args: Any, **kwargs: Any) -> None:
        world, spec, flat, _ufunc = args
        await original(world, spec, flat, counting, **kwargs)  # type: ignore[arg-type]

    _algorithms.recursive_doubling_scan = wrapper  # type: ignore[assignment]


def count_calls(module: Any, name: str) -> None:
    _worker_util.count_calls(CALLS, module, name)


BITWISE_DTYPES = ("int8", "uint16", "int32", "uint64", "int64", "bool")


async def bitwise(comm: trioring.Communicator, errors: list[str]) -> None:
    n, r = comm.world_size, comm.rank
    features = comm.features
    for name in _decision.ALGORITHMS["allreduce"]:
        if name in ("shm", "cma") and name not in features:
            continue
        comm._force_algorithm("allreduce", name)
        for seed, count in enumerate((0, 1, 3, 1023, 200_001)):
            for dtype_name in BITWISE_DTYPES:
                dtype = np.dtype(dtype_name)
                nbytes = count * dtype.itemsize
                if name == "shm" and nbytes > comm._world.slot_reduce_bytes:
                    continue
                if name == "recursive_doubling" and nbytes > 1024 * 1024:
                    continue
                for op in ops_for(dtype, bitwise=True):
                    if dtype.kind != "b" and op not in ("band", "bor", "bxor"):
                        continue
                    what = f"allreduce[{name}] {op} {dtype}[{count}]"
                    inputs = [make(seed, q, count, dtype, op) for q in range(n)]
                    array = inputs[r].copy()
                    await comm.allreduce(array, op=op)
                    expected = UFUNCS[op].reduce(np.stack(inputs), axis=0, dtype=dtype)
                    if not np.array_equal(array, expected):
                        errors.append(f"{what}: wrong result on rank {r}")
                    mine = array.copy()
                    await comm.broadcast(array, root=0)
                    if array.tobytes() != mine.tobytes():
                        errors.append(f"{what}: not bitwise rank 0's on rank {r}")
    comm._force_algorithm("allreduce", None)
    for seed, dtype_name in enumerate(BITWISE_DTYPES):
        dtype = np.dtype(dtype_name)
        for op in ("band", "bor", "bxor"):
            inputs = [make(seed, q, 5 * n, dtype, op) for q in range(n)]
            expected = UFUNCS[op].reduce(np.stack(inputs), axis=0, dtype=dtype)
            block = await comm.reduce_scatter(inputs[r].copy(), op=op)
            if not np.array_equal(block, expected[5 * r : 5 * (r + 1)]):
                errors.append(f"reduce_scatter {op} {dtype}: wrong result on rank {r}")
            array = inputs[r].copy()
            await comm.reduce(array, root=n - 1, op=op)
            if r == n - 1 and not np.array_equal(array, expected):
                errors.append(f"reduce {op} {dtype}: wrong result")


async def main(mode: str, out_dir: Path, args: list[str]) -> int:
    errors: list[str] = []
    report: dict[str, Any] = {"errors": errors}
    if mode == "kill":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if mode == "check":
        count_calls(_shm_reductions, "shm_scan")
    if mode == "bitwise":
        count_calls(_shm_reductions, "shm_allreduce")
        count_calls(_cma_reductions, "cma_allreduce")
    with trio.fail_after(90):
        async with trioring.open_communicator() as comm:
            rank = comm.rank
            report["features"] = sorted(comm.features)
            if mode == "check":
                await check(comm, errors)
            elif mode == "bitwise":
                await bitwise(comm, errors)
            else:
                collective, victim = args[0], int(args[1])
                if rank == victim:
                    kill_at_third_reduction()
                x = np.ones(4 * 1024 * 1024, np.float32)
                await comm.barrier()
                started = time.monotonic()
                try:
                    await getattr(comm, collective)(x)
                except trioring.CollectiveError as exc:
                    report["error"] = type(exc).__name__
                    report["peer"] = exc.peer
                    report["message"] = str(exc)
                else:
                    report["error"] = None
                report["elapsed"] = time.monotonic() - started
    report["calls"] = CALLS
    (out_dir / f"rank{rank}.json").write_text(json.dumps(report))
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(trio.run(main, sys.argv[1], Path(sys.argv[2]), sys.argv[3:]))
