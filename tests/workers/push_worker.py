"""One rank of tests/test_push.py: large broadcasts whose root writes a share of its array
into the readers' arrays, and allreduces whose ranks write their finished segments into
each other's (``_onehost._push``).

``python push_worker.py MODE OUT_DIR`` under the forked launcher, on one host (Unix
sockets). Every rank but in ``natural`` mode first sets its segment's agreed CPU count to 64
(the same on every rank, so every rank's decision table agrees; as if the host had them),
so that the ranks push at any world size on any machine, and forces broadcast, allreduce
and reduce by cross-memory attach, which the table picks at every size here on Intel CPUs
only. Every ``process_vm_writev`` of
the rank goes through a counter; ``push_into`` and ``pushed`` are counted.

Modes:

- ``stress``: broadcasts and reduces (every root in turn) and allreduces (sum, max, mean)
  of odd sizes from just above ``PUSH_MIN_BYTES`` to a few MiB, in four dtypes each; a
  reduce's other ranks check that their input is unchanged. About half of the
  ranks (roles rotate) check their result against numpy; the others overwrite their array
  with a sentinel the moment the call returns, and check, after the next collective (when
  every peer has certainly returned from the call), that the sentinel is still whole: a
  peer that wrote into an array after its owner's call returned spoils it, and a rank that
  returned before the writes into its array landed spoils a checked result.
- ``cancel-in-broadcast``, ``-allreduce``, ``-reduce``: a broadcast from rank 0 (an
  allreduce, a reduce to rank 1) that rank 1 enters under a cancel scope, cancelled by
  rank 1's own first read once rank 0 is in its first write into rank 1 (a marker file;
  past its look at rank 1's word), which rank 0 holds until rank 1 has marked itself gone,
  then 0.2 s more: rank 1's call must end only after that write, so the sentinel that
  rank 1 writes the moment its call ends must still be whole once rank 0 says (another
  marker file) that its write is over. Rank 0 must write no more into rank 1, and every
  rank must hear that rank 1 cancelled.
- ``write-fails-in-broadcast``, ``-allreduce``, ``-reduce``: rank 0's first write fails as
  ``process_vm_writev`` fails when the peer is gone (ESRCH): rank 0 must raise
  ``PeerFailedError`` naming rank 1, and every rank raise.
- ``natural``: the CPU count and the decision table left as the ranks agreed them; a
  broadcast from rank 0 and an allreduce of each size in bytes that ``NATURAL_SIZES``
  lists (comma-separated), checked on every rank; reports which algorithms took them and whether the ranks wrote.

``PUSH_OFF_RANK=r`` makes rank r refuse pushing (``TRIORING_PUSH=0``). Writes
``rank{r}.json`` and exits 0 (errors of the collectives are recorded, not raised).
"""

from __future__ import annotations

import errno
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import _worker_util
import numpy as np
import trio

import trioring
from trioring._onehost import _cma, _cma_collectives, _cma_reductions, _pipe, _push, _shm

CALLS: dict[str, int] = {}
_worker_util.count_calls(CALLS, _push, "push_into")
_worker_util.count_calls(CALLS, _push, "pushed")
_worker_util.count_calls(CALLS, _cma_collectives, "cma_broadcast")
_worker_util.count_calls(CALLS, _cma_reductions, "_reduce_pushed")
_worker_util.count_calls(CALLS, _cma_reductions, "_reduce_segments")
_worker_util.count_calls(CALLS, _pipe, "pipe_broadcast")
_worker_util.count_calls(CALLS, _pipe, "pipe_allreduce")

WRITES = {"count": 0}
#: Writes by the pid written into.
WRITES_INTO: dict[int, int] = {}
_write_into = _cma.write_into
_read_into = _cma.read_into
#: Set by a mode: called before each write / each read with the count so far.
_before_write: Any = None
_before_read: Any = None


def _counted_write_into(pid: int, remote: int, local: int, nbytes: int) -> None:
    if pid == os.getpid():  # opening's check that writes work at all
        _write_into(pid, remote, local, nbytes)
        return
    WRITES["count"] += 1
    WRITES_INTO[pid] = WRITES_INTO.get(pid, 0) + 1
    if _before_write is not None:
        _before_write(WRITES["count"])
    _write_into(pid, remote, local, nbytes)


def _counted_read_into(pid: int, remote: int, local: int, nbytes: int) -> None:
    if _before_read is not None:
        _before_read()
    _read_into(pid, remote, local, nbytes)


_cma.write_into = _counted_write_into
_cma.read_into = _counted_read_into

DTYPES = ("float32", "int64", "uint8", "complex64")
#: Bytes (before rounding to the dtype) of the stress broadcasts: just above the most the
#: slots take (PUSH_MIN_BYTES, or where they take pieces the whole slot), a few steps of
#: the root's writes, and odd sizes between.
SIZES = (
    max(_push.PUSH_MIN_BYTES, _shm.SLOT_PAYLOAD_BYTES) + 1,
    3 * _push.PUSH_STEP_BYTES + 12_345,
    1_500_007,
)
SENTINEL = 77
#: Bound on the waits for a peer's marker file or segment word.
HOLD_S = 5.0


def make(dtype: np.dtype[Any], count: int, seed: int) -> np.ndarray[Any, Any]:
    values = (np.arange(count, dtype=np.int64) * 7 + seed) % 251
    return values.astype(dtype)


#: The allreduces of the stress mode: dtype and op, by turn.
REDUCTIONS = (("float32", "sum"), ("int64", "max"), ("float64", "mean"), ("complex64", "sum"))


async def stress(comm: trioring.Communicator, rank: int) -> dict[str, Any]:
    errors: list[str] = []
    n = comm.world_size
    spoiled: list[tuple[str, np.ndarray[Any, Any]]] = []

    def check_spoiled() -> None:
        # Arrays overwritten after the last call are checked after the next.
        for what, kept in spoiled:
            if not (kept == SENTINEL).all():
                errors.append(f"{what}: written into after it returned")
        spoiled.clear()

    for i in range(3 * n):
        dtype = np.dtype(DTYPES[i % len(DTYPES)])
        count = SIZES[i % len(SIZES)] // dtype.itemsize | 1
        root = i % n
        expected = make(dtype, count, i)
        array = expected.copy() if rank == root else np.zeros(count, dtype)
        await comm.broadcast(array, root=root)
        check_spoiled()
        if (rank + i) % 2 and rank != root:
            array.fill(SENTINEL)
            spoiled.append((f"broadcast #{i}", array))
        elif not np.array_equal(array, expected):
            errors.append(f"broadcast #{i} {dtype}[{count}] root {root}")
        name, op = REDUCTIONS[i % len(REDUCTIONS)]
        dtype = np.dtype(name)
        count = SIZES[(i + 1) % len(SIZES)] // dtype.itemsize | 1
        inputs = [make(dtype, count, 10 * i + q) for q in range(n)]
        array = inputs[rank].copy()
        await comm.allreduce(array, op=op)
        check_spoiled()
        stacked = np.stack(inputs)
        reference = {"sum": stacked.sum(0), "max": stacked.max(0), "mean": stacked.sum(0) / n}
        if (rank + i) % 2:
            array.fill(SENTINEL)
            spoiled.append((f"allreduce #{i}", array))
        elif not np.array_equal(array, reference[op].astype(dtype)):
            errors.append(f"allreduce #{i} {dtype}[{count}] {op}")
        # A reduce to every root in turn: the others write into the root's array only,
        # and leave their own as it was.
        array = inputs[rank].copy()
        await comm.reduce(array, root=root, op=op)
        check_spoiled()
        if rank != root:
            if not np.array_equal(array, inputs[rank]):
                errors.append(f"reduce #{i}: rank {rank}'s input changed")
        elif i % 2:
            array.fill(SENTINEL)
            spoiled.append((f"reduce #{i}", array))
        elif not np.array_equal(array, reference[op].astype(dtype)):
            errors.append(f"reduce #{i} {dtype}[{count}] {op} root {root}")
    await comm.barrier()
    check_spoiled()
    return {"errors": errors}


async def natural(comm: trioring.Communicator, rank: int) -> dict[str, Any]:
    errors = []
    # The bytes of each pair of calls, from the test (NATURAL_SIZES: comma-separated).
    for nbytes in map(int, os.environ["NATURAL_SIZES"].split(",")):
        count = nbytes // 4
        expected = make(np.dtype(np.float32), count, 0)
        array = expected.copy() if rank == 0 else np.zeros(count, np.float32)
        await comm.broadcast(array, root=0)
        if not np.array_equal(array, expected):
            errors.append(f"broadcast of {nbytes}")
        array = make(np.dtype(np.float32), count, rank)
        await comm.allreduce(array)
        total = sum(make(np.dtype(np.float32), count, q) for q in range(comm.world_size))
        if not np.array_equal(array, total):
            errors.append(f"allreduce of {nbytes}")
    return {"errors": errors}


def _wait_until(done: Any) -> None:
    """Hold this thread (and the event loop) until ``done()``, at most HOLD_S."""
    deadline = time.monotonic() + HOLD_S
    while not done() and time.monotonic() < deadline:
        time.sleep(0.001)


async def interrupted(
    comm: trioring.Communicator, rank: int, mode: str, out_dir: Path
) -> dict[str, Any]:
    global _before_write, _before_read
    mode, _, collective = mode.partition("-in-")
    count = 3 * _push.PUSH_STEP_BYTES // 4
    array = make(np.dtype(np.float32), count, rank)
    if collective == "broadcast" and rank != 0:
        array.fill(0)
    report: dict[str, Any] = {}
    scope = trio.CancelScope()
    slots = comm._world.shm
    assert slots is not None
    seqs = slots.seqs
    seq = comm.seq + 1
    wrote, writing = out_dir / "root-wrote", out_dir / "root-writing"
    if mode == "cancel" and rank == 0:

        def before_write(writes: int) -> None:
            if writes == 1:
                # In its first write into rank 1 (past its look at rank 1's word), until
                # rank 1 has marked itself gone: a rank 1 that did not wait for this write
                # would be gone by the time it lands.
                writing.touch()
                _wait_until(lambda: seqs[1 * _shm.LINE // 8] == _shm.BROKEN)
                time.sleep(0.2)

        _before_write = before_write
    if mode == "cancel" and rank == 1:

        def before_read() -> None:
            if not scope.cancel_called:
                # Once rank 0 is in its first write into this rank's array (its reads of
                # this rank's memory need nothing of this rank meanwhile).
                _wait_until(writing.exists)
                report["root_was_writing"] = bool(seqs[_shm.PUSHING] == 2 * seq)
                scope.cancel()

        _before_read = before_read
    if mode == "write-fails" and rank == 0:

        def before_write(writes: int) -> None:
            raise _cma.CmaError(errno.ESRCH, os.strerror(errno.ESRCH))

        _before_write = before_write
    try:
        with scope:
            if collective == "broadcast":
                await comm.broadcast(array, root=0)
            elif collective == "reduce":
                # Rank 0 (and the others) write into rank 1's array.
                await comm.reduce(array, root=1)
            else:
                await comm.allreduce(array)
        report["returned"] = True
    except trioring.CollectiveError as exc:
        report["error"] = _worker_util.describe(exc)
    finally:
        if rank == 1:
            array.fill(SENTINEL)
        if rank == 0 and mode == "cancel":
            wrote.touch()
        _before_write = _before_read = None
    report["cancelled"] = scope.cancelled_caught
    if rank == 0:
        peer_pids = comm._world.peer_pids
        assert peer_pids is not None
        report["writes_into_1"] = WRITES_INTO.get(peer_pids[1], 0)
    if rank == 1 and mode == "cancel":
        _wait_until(wrote.exists)
        report["sentinel_whole"] = bool((array == SENTINEL).all())
    try:
        await comm.barrier()
    except trioring.TrioringError as exc:
        report["next"] = _worker_util.describe(exc)
    return report


async def main(mode: str, out_dir: Path) -> int:
    rank = int(os.environ["RANK"])
    if os.environ.get("PUSH_OFF_RANK") == str(rank):
        os.environ["TRIORING_PUSH"] = "0"
    with trio.fail_after(120):
        async with trioring.open_communicator() as comm:
            shm = comm._world.shm
            if shm is not None and mode != "natural":
                shm.cpus = 64
                # Pushing is what this worker tests, and only on Intel CPUs does the table
                # take every size here by cross-memory attach (elsewhere the pipe keeps
                # those up to 4 MiB: _collectives._limits.PipeLimits).
                for collective in ("broadcast", "allreduce", "reduce"):
                    comm._force_algorithm(collective, "cma")
            if mode == "stress":
                report = await stress(comm, rank)
            elif mode == "natural":
                report = await natural(comm, rank)
            else:
                report = await interrupted(comm, rank, mode, out_dir)
            report["features"] = sorted(comm.features)
    report.update(rank=rank, calls=CALLS, writes=WRITES["count"])
    (out_dir / f"rank{rank}.json").write_text(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(trio.run(main, sys.argv[1], Path(sys.argv[2])))
