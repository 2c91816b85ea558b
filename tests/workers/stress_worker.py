"""One rank of tests/test_fastpaths.py: collectives whose arrays are overwritten the moment
each call returns.

``python stress_worker.py ITERATIONS OUT_DIR`` under ``trioring run``. Iteration i uses an odd
element count and a dtype chosen from i, an allreduce (exact integer sums, or float min/max),
a broadcast from root ``i % n``, a reduce_scatter and a reduce (the allreduce's op and
inputs), and an allgather, gather, scatter and alltoall of blocks of
an odd ``count / n``, rooted at ``i % n``. In each iteration about half of the ranks (roles rotate) check
their result against numpy, and the other half overwrite their array with garbage as soon as
the call returns: a rank that returned while a peer could still read its array would corrupt
that peer's result, which the peer's check catches. ``STRESS_NO_CMA_RANK=r`` makes rank r
refuse cross-memory attach, and ``STRESS_NO_SHM_RANK=r`` the shared segment, so every rank
must fall back. Writes ``rank{r}.json`` (errors, the communicator's features, and how many
calls each one-host algorithm of the reductions ran, so that the test knows the table sent
calls both ways) and exits 1 if any result was wrong.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import _worker_util
import numpy as np
import trio

import trioring
from trioring._onehost import _cma_reductions, _pipe, _shm_collectives

#: Calls of each one-host algorithm of the reductions, as the decision table chose them.
CALLS: dict[str, int] = {}


def count_calls(module: Any, name: str) -> None:
    _worker_util.count_calls(CALLS, module, name)


for _name in ("cma_allreduce", "cma_reduce_scatter", "cma_reduce"):
    count_calls(_cma_reductions, _name)
for _name in ("pipe_allreduce", "pipe_reduce_scatter", "pipe_reduce"):
    count_calls(_pipe, _name)
count_calls(_shm_collectives, "_broadcast_pieces")
_worker_util.slot_pieces_on_any_cpu()

DTYPES = ("int64", "int32", "float64", "float32", "uint8")


def make(i: int, rank: int, count: int, dtype: np.dtype) -> np.ndarray:
    rng = np.random.default_rng([i, rank])
    if dtype.kind == "f":
        return rng.standard_normal(count).astype(dtype)
    # Small values: an exact sum in every dtype (uint8 wraps identically everywhere anyway).
    return rng.integers(0, 50, count).astype(dtype)


async def copies(
    comm: trioring.Communicator,
    i: int,
    dtype: np.dtype,
    count: int,
    checker: bool,
    errors: list[str],
) -> None:
    """The collectives that only copy: a rank that is not checking overwrites its input the
    moment the call returns, which would corrupt a peer still reading it."""
    n, rank, root = comm.world_size, comm.rank, i % comm.world_size
    inputs = [make(i, q, count, dtype) for q in range(n)]
    what = f"#{i} {dtype}[{count}] root {root}"
    x = inputs[rank].copy()
    got = await comm.allgather(x)
    if not checker:
        x.fill(7)
    elif not np.array_equal(got, np.stack(inputs)):
        errors.append(f"allgather {what}")
    x = inputs[rank].copy()
    got = await comm.gather(x, root=root)
    if not checker:
        x.fill(7)
    elif rank == root and not np.array_equal(got, np.stack(inputs)):
        errors.append(f"gather {what}")
    blocks = np.stack(inputs) if rank == root else None
    got = await comm.scatter(blocks, root=root)
    if blocks is not None and not checker:
        blocks.fill(7)
    elif checker and not np.array_equal(got, inputs[rank]):
        errors.append(f"scatter {what}")
    sent = [make(i + 1000 * q, rank, count, dtype) for q in range(n)]
    x = np.stack(sent)
    got = await comm.alltoall(x)
    if not checker:
        x.fill(7)
    elif not np.array_equal(
        got, np.stack([make(i + 1000 * rank, q, count, dtype) for q in range(n)])
    ):
        errors.append(f"alltoall {what}")


async def reductions(
    comm: trioring.Communicator,
    i: int,
    dtype: np.dtype,
    count: int,
    op: str,
    inputs: list[np.ndarray],
    checker: bool,
    errors: list[str],
) -> None:
    """reduce_scatter and reduce, whose inputs a non-checking rank overwrites on return."""
    n, rank, root = comm.world_size, comm.rank, i % comm.world_size
    ufunc = {"sum": np.add, "min": np.minimum, "max": np.maximum}[op]
    with np.errstate(all="ignore"):
        expected = ufunc.reduce(np.stack(inputs), axis=0, dtype=dtype)
    block = count // n
    x = inputs[rank][: n * block].copy()
    got = await comm.reduce_scatter(x, op=op)
    if not checker:
        x.fill(7)
    elif not np.array_equal(got, expected[rank * block : (rank + 1) * block]):
        errors.append(f"reduce_scatter #{i} {dtype}[{n * block}] {op}")
    x = inputs[rank].copy()
    await comm.reduce(x, root=root, op=op)
    if not checker:
        x.fill(7)
    elif rank == root and not np.array_equal(x, expected):
        errors.append(f"reduce #{i} {dtype}[{count}] {op} root {root}")


async def main(iterations: int, out_dir: Path) -> int:
    rank = int(os.environ["RANK"])
    if os.environ.get("STRESS_NO_CMA_RANK") == str(rank):
        os.environ["TRIORING_CMA"] = "0"
    if os.environ.get("STRESS_NO_SHM_RANK") == str(rank):
        os.environ["TRIORING_SHM"] = "0"
    errors: list[str] = []
    with trio.fail_after(120):
        async with trioring.open_communicator() as comm:
            n = comm.world_size
            for i in range(iterations):
                dtype = np.dtype(DTYPES[i % len(DTYPES)])
                # Odd counts from a few elements to ~8 MB: every path (shared segment,
                # recursive doubling, ring or cross-memory attach, uneven segments) is
                # exercised.
                # 65_537 to 262_143 bytes: the shared segment's mid sizes (up to 256 KiB).
                sizes = [3, 1_001, 4_095, 65_537, 200_001, 262_143, 1_000_001, 2_500_001, 8_000_001]
                count = sizes[i % len(sizes)] // dtype.itemsize | 1
                op = "sum" if dtype.kind in "iu" else ("min", "max")[i % 2]
                inputs = [make(i, q, count, dtype) for q in range(n)]
                checker = (rank + i // n) % 2 == 0
                array = inputs[rank].copy()
                await comm.allreduce(array, op=op)
                if not checker:
                    array.fill(7)
                else:
                    with np.errstate(all="ignore"):
                        ufunc = {"sum": np.add, "min": np.minimum, "max": np.maximum}[op]
                        expected = ufunc.reduce(np.stack(inputs), axis=0, dtype=dtype)
                    if not np.array_equal(array, expected):
                        errors.append(f"allreduce #{i} {dtype}[{count}] {op}")
                root = i % n
                array = inputs[rank].copy()
                await comm.broadcast(array, root=root)
                if not checker:
                    array.fill(7)
                elif not np.array_equal(array, inputs[root]):
                    errors.append(f"broadcast #{i} {dtype}[{count}] root {root}")
                await reductions(comm, i, dtype, count, op, inputs, checker, errors)
                await copies(comm, i, dtype, count // n | 1, checker, errors)
            features = sorted(comm.features)
            crowded = None if comm._world.shm is None else comm._world.shm.crowded
    report = {
        "rank": rank,
        "errors": errors,
        "features": features,
        "calls": CALLS,
        "crowded": crowded,
    }
    (out_dir / f"rank{rank}.json").write_text(json.dumps(report))
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(trio.run(main, int(sys.argv[1]), Path(sys.argv[2])))
