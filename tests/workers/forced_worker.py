"""One rank of tests/test_algorithms_forced.py's real-process tests: every algorithm of every
collective, forced, over the ``unix`` transport where the one-host paths can run.

``trioring run -n N --transport unix forced_worker.py MODE OUT_DIR``. Modes:

- ``all``: for each collective, each algorithm this world can run (``shm`` and ``cma`` only
  with their feature) is forced in turn with ``Communicator._force_algorithm`` (in the same
  order on every rank) and run at several sizes, checked against numpy and bitwise across
  ranks (by a broadcast of a digest-free copy: rank 0's result, by the ``tree``).
- ``env``: nothing is forced by the worker; ``TRIORING_ALGORITHM`` (set by the test) must be.

Calls into the one-host algorithms are counted by wrapping them; the report
(``rank{RANK}.json``) holds the counts, the features and any errors.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import _worker_util
import numpy as np
import trio

import trioring
from trioring._collectives import _decision
from trioring._onehost import (
    _cma_collectives,
    _cma_reductions,
    _pipe,
    _shm_collectives,
    _shm_reductions,
)
from trioring._onehost._shm import PIPE_CHUNK_BYTES, PIPE_CHUNKS, SLOT_PAYLOAD_BYTES

CALLS: dict[str, int] = {}


def count_calls(module: Any, name: str) -> None:
    _worker_util.count_calls(CALLS, module, name)


count_calls(_shm_reductions, "shm_allreduce")
for _name in ("shm_broadcast", "shm_barrier"):
    count_calls(_shm_collectives, _name)
count_calls(_cma_reductions, "cma_allreduce")
count_calls(_cma_collectives, "cma_broadcast")
count_calls(_pipe, "pipe_broadcast")
count_calls(_pipe, "pipe_allreduce")
count_calls(_shm_collectives, "_broadcast_pieces")
_worker_util.slot_pieces_on_any_cpu()
#: The chunk sizes that calls through the pipe were cut into (a broadcast's depend on its
#: size: see _shm.broadcast_piece_bytes).
CHUNKS: set[int] = set()
_start = _pipe._start


async def _recorded_start(*args: Any, **kwargs: Any) -> Any:
    stream = await _start(*args, **kwargs)
    CHUNKS.add(stream.chunk_bytes)
    return stream


_pipe._start = _recorded_start
#: Float32 elements that wrap the pipe's ring and end in a partial chunk.
RING_WRAPPING = (PIPE_CHUNKS + 1) * PIPE_CHUNK_BYTES // 4 + 12_345


def make(seed: int, rank: int, count: int, dtype: np.dtype[Any]) -> np.ndarray[Any, Any]:
    # Integer values: sums are exact whatever the order of operations.
    return np.random.default_rng([seed, rank]).integers(-8, 9, count).astype(dtype)


async def check_allreduce(
    comm: trioring.Communicator, errors: list[str], seed: int, count: int, dtype: str, op: str
) -> None:
    n, rank = comm.world_size, comm.rank
    dt = np.dtype(dtype)
    inputs = [make(seed, q, count, dt) for q in range(n)]
    array = inputs[rank].copy()
    await comm.allreduce(array, op=op)
    ufunc = {"sum": np.add, "mean": np.add, "min": np.minimum, "max": np.maximum}[op]
    expected = ufunc.reduce(np.stack(inputs), axis=0, dtype=dt)
    if op == "mean":
        np.divide(expected, n, out=expected)
    if not np.array_equal(array, expected):
        errors.append(f"allreduce {dtype}[{count}] {op}: wrong result")
    mine = array.copy()
    await comm.broadcast(array, root=0)
    if array.tobytes() != mine.tobytes():
        errors.append(f"allreduce {dtype}[{count}] {op}: not bitwise rank 0's")


async def check_broadcast(
    comm: trioring.Communicator, errors: list[str], seed: int, count: int, root: int
) -> None:
    dt = np.dtype("float32")
    expected = make(seed, root, count, dt)
    array = make(seed, comm.rank, count, dt)
    await comm.broadcast(array, root=root)
    if array.tobytes() != expected.tobytes():
        errors.append(f"broadcast float32[{count}] root {root}: wrong result")


async def main(mode: str, out_dir: Path) -> int:
    errors: list[str] = []
    with trio.fail_after(120):
        async with trioring.open_communicator() as comm:
            n = comm.world_size
            features = comm.features
            if mode == "all":
                # The last but one fills the shared segment's slot with float32 (up to 256 KiB
                # at worlds 2-4): the mid-size path through the segment.
                sizes = (
                    0,
                    1,
                    n - 1,
                    2 * n + 1,
                    1023,
                    comm._world.slot_reduce_bytes // 4 - 1,
                    300_001,
                )
                for name in _decision.ALGORITHMS["allreduce"]:
                    feature = "shm" if name == "pipe" else name
                    if feature in ("shm", "cma") and feature not in features:
                        continue
                    comm._force_algorithm("allreduce", name)
                    allreduce_sizes = (*sizes, RING_WRAPPING) if name == "pipe" else sizes
                    for i, count in enumerate(allreduce_sizes):
                        if name == "shm" and count * 8 > comm._world.slot_reduce_bytes:
                            continue
                        if name == "recursive_doubling" and count * 8 > 1024 * 1024:
                            continue
                        await check_allreduce(comm, errors, i, count, "float32", "sum")
                        await check_allreduce(comm, errors, i, count, "float64", "mean")
                        await check_allreduce(comm, errors, i, count, "int32", "max")
                comm._force_algorithm("allreduce", None)
                for name in _decision.ALGORITHMS["broadcast"]:
                    feature = "shm" if name == "pipe" else name
                    if feature in ("shm", "cma") and feature not in features:
                        continue
                    comm._force_algorithm("broadcast", name)
                    # Through the slots, four pieces the last of one element, and the
                    # whole slot; through the pipe, five chunks of 128 KiB (and 256 KiB
                    # for 300_001 and the whole slot).
                    broadcast_sizes = (*sizes, 49_153, 150_001, SLOT_PAYLOAD_BYTES // 4)
                    if name != "shm":
                        broadcast_sizes = (*broadcast_sizes, RING_WRAPPING)
                    for i, count in enumerate(broadcast_sizes):
                        if name == "shm" and count * 4 > SLOT_PAYLOAD_BYTES:
                            continue
                        await check_broadcast(comm, errors, i, count, i % n)
                    if feature == "shm":
                        # Whole copies where some rank is crowded, pieces elsewhere (see
                        # _shm.SharedSlots.crowded): every rank flips what it agreed, so
                        # that both run at every world size on any machine.
                        slots = comm._world.shm
                        assert slots is not None
                        slots.crowded = not slots.crowded
                        for i, count in enumerate(broadcast_sizes[-5:]):
                            if name == "shm" and count * 4 > SLOT_PAYLOAD_BYTES:
                                continue
                            await check_broadcast(comm, errors, i, count, (i + 1) % n)
                        slots.crowded = not slots.crowded
                for name in _decision.ALGORITHMS["barrier"]:
                    if name in ("shm", "cma") and name not in features:
                        continue
                    comm._force_algorithm("barrier", name)
                    for _ in range(3):
                        await comm.barrier()
                comm._force_algorithm("barrier", None)
                # Forcing what cannot run this call raises before any I/O, on every rank
                # alike, and leaves the communicator usable.
                if "shm" in features:
                    comm._force_algorithm("allreduce", "shm")
                    seq = comm.seq
                    try:
                        too_large = comm._world.slot_reduce_bytes // 8 + 1
                        await comm.allreduce(np.zeros(too_large, np.float64))
                    except trioring.InvalidArgumentError:
                        pass
                    else:
                        errors.append("forced shm took an array too large for the segment")
                    if comm.seq != seq or comm.broken:
                        errors.append("the refused forced call did I/O")
                    comm._force_algorithm("allreduce", None)
                    await check_allreduce(comm, errors, 99, 5, "float32", "sum")
            else:
                await check_allreduce(comm, errors, 1, 3, "float32", "sum")
                await check_broadcast(comm, errors, 2, 3, n - 1)
                await comm.barrier()
    report = {
        "rank": comm.rank,
        "errors": errors,
        "features": sorted(features),
        "calls": CALLS,
        "chunks": sorted(CHUNKS),
        "crowded": None if comm._world.shm is None else comm._world.shm.crowded,
    }
    (out_dir / f"rank{comm.rank}.json").write_text(json.dumps(report))
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(trio.run(main, sys.argv[1], Path(sys.argv[2])))
