"""One rank of tests/test_read_threads.py: large broadcasts whose readers read in threads.

``python threads_worker.py MODE OUT_DIR`` under the forked launcher, on one host (Unix
sockets). Every rank first sets its segment's agreed CPU count to 64 (the same on every
rank, so every rank's decision table agrees; as if the host had them), so that the readers
of a broadcast of ``READ_THREADS_MIN_BYTES`` or more read in ``READ_THREADS`` threads at any
world size, on any machine. Every ``process_vm_readv`` of the rank goes through a counter of
the reads in flight (any thread), and ``_read_shares`` is counted.

Modes (all but ``natural`` with the count forced):

- ``stress``: broadcasts of odd sizes just above the threshold (several dtypes, every root in
  turn); about half of the ranks (roles rotate) check their result against numpy, the others
  overwrite their array the moment the call returns: a root that returned while a reader
  still read its array, or a reader whose helper still wrote after the call, corrupts a
  checked result. Reports the errors and the counts.
- ``cancel``: a broadcast from rank 0 that rank 1 enters under a cancel scope cancelled by
  its own first read, in the main thread, once the helper is at its first read (which is
  held until the call is over, or half a second): rank 1's call must end only once
  its helper has, with no read in flight and the helper stopped after that one read (the
  communicator broken, its next call saying so), and every other rank must raise naming
  rank 1.
- ``natural``: the CPU count left as the ranks agreed it; one broadcast of the threshold's
  size from rank 0, checked on every rank; reports whether it went by cross-memory attach
  (``cma_broadcast``) or the pipe (``pipe_broadcast``), and in threads.
- ``helper-fails``: as ``cancel``, but rank 1's first read in a helper thread fails as
  ``process_vm_readv`` fails when the peer is gone (ESRCH): rank 1 must raise a
  ``CollectiveError`` naming rank 0, with no read in flight, and every rank must raise.

``THREADS_OFF_RANK=r`` makes rank r refuse threads (``TRIORING_THREADS=0``). Writes
``rank{r}.json`` and exits 0 (errors of the collectives are recorded, not raised).
"""

from __future__ import annotations

import errno
import json
import os
import sys
import threading
from pathlib import Path
from typing import Any

import _worker_util
import numpy as np
import trio

import trioring
from trioring._onehost import _cma, _cma_collectives, _pipe

CALLS: dict[str, int] = {}
_worker_util.count_calls(CALLS, _cma_collectives, "_read_shares")
_worker_util.count_calls(CALLS, _cma_collectives, "cma_broadcast")
_worker_util.count_calls(CALLS, _pipe, "pipe_broadcast")

_lock = threading.Lock()
#: Reads in flight, the most at once, and reads made in helper threads.
READS = {"now": 0, "most": 0, "helpers": 0}
_read_into = _cma.read_into
#: Set by a mode: called before each read with (whether in the main thread, the count of
#: reads so far in that kind of thread).
_before_read: Any = None
_seen = {True: 0, False: 0}


def _counted_read_into(pid: int, remote: int, local: int, nbytes: int) -> None:
    main = threading.current_thread() is threading.main_thread()
    with _lock:
        READS["now"] += 1
        READS["most"] = max(READS["most"], READS["now"])
        READS["helpers"] += not main
        _seen[main] += 1
        seen = _seen[main]
    try:
        if _before_read is not None:
            _before_read(main, seen)
        _read_into(pid, remote, local, nbytes)
    finally:
        with _lock:
            READS["now"] -= 1


_cma.read_into = _counted_read_into

#: Element counts (odd) per dtype, just above the threshold.
DTYPES = ("float32", "int64", "uint8", "complex64")


def count_for(dtype: np.dtype[Any], i: int) -> int:
    return (_cma_collectives.READ_THREADS_MIN_BYTES // dtype.itemsize + 1_001 + 2 * i) | 1


def make(dtype: np.dtype[Any], count: int, seed: int) -> np.ndarray[Any, Any]:
    values = (np.arange(count, dtype=np.int64) * 7 + seed) % 251
    return values.astype(dtype)


async def stress(comm: trioring.Communicator, rank: int) -> dict[str, Any]:
    global _before_read
    errors: list[str] = []
    meeting = threading.Barrier(2)

    def meet(main: bool, seen: int) -> None:
        # The first read in this task and the first in a helper wait for each other (this
        # blocks the event loop briefly): both are in flight at once whatever the scheduler
        # does, so that the report shows two reads together only if the call started its
        # helper before its own read and reads alongside it. (On two busy CPUs the helper
        # could otherwise start after this task's read ended: seen once in CI.)
        if seen == 1:
            try:
                meeting.wait(10)
            except threading.BrokenBarrierError:
                errors.append(
                    f"the first read in the {'main' if main else 'helper'} thread "
                    "met no read in the other within 10 s"
                )

    _seen.update({True: 0, False: 0})  # (opening read the peers' cookies)
    _before_read = meet
    n = comm.world_size
    for i in range(2 * n):
        dtype = np.dtype(DTYPES[i % len(DTYPES)])
        count = count_for(dtype, i)
        root = i % n
        expected = make(dtype, count, i)
        array = expected.copy() if rank == root else np.zeros(count, dtype)
        await comm.broadcast(array, root=root)
        if (rank + i) % 2:
            array.fill(0)
        elif not np.array_equal(array, expected):
            errors.append(f"broadcast #{i} {dtype}[{count}] root {root}")
    _before_read = None
    return {"errors": errors}


async def natural(comm: trioring.Communicator, rank: int) -> dict[str, Any]:
    dtype = np.dtype(np.float32)
    count = count_for(dtype, 0)
    expected = make(dtype, count, 0)
    array = expected.copy() if rank == 0 else np.zeros(count, dtype)
    await comm.broadcast(array, root=0)
    return {"errors": [] if np.array_equal(array, expected) else ["broadcast"]}


async def interrupted(comm: trioring.Communicator, rank: int, mode: str) -> dict[str, Any]:
    global _before_read
    count = count_for(np.dtype(np.float32), 0)
    array = make(np.dtype(np.float32), count, 0) if rank == 0 else np.zeros(count, np.float32)
    report: dict[str, Any] = {}
    scope = trio.CancelScope()
    released, helper_started = threading.Event(), threading.Event()
    if rank == 1:

        def before_read(main: bool, seen: int) -> None:
            if mode == "cancel" and main and seen == 1:
                # Once the helper is at its first read (this blocks the event loop briefly).
                helper_started.wait(5)
                scope.cancel()
            if mode == "cancel" and not main and seen == 1:
                # Hold the helper's first read until the call is over, or half a second: a
                # call that waits for its helpers, as it must, waits this out, and one that
                # did not would find this read in flight when it returned.
                helper_started.set()
                released.wait(0.5)
            if mode == "helper-fails" and not main and seen == 1:
                raise _cma.CmaError(errno.ESRCH, os.strerror(errno.ESRCH))

        _seen.update({True: 0, False: 0})  # (opening read the peers' cookies)
        _before_read = before_read
    try:
        with scope:
            await comm.broadcast(array, root=0)
        report["returned"] = True
    except trioring.CollectiveError as exc:
        report["error"] = _worker_util.describe(exc)
    finally:
        report["in_flight_after"] = READS["now"]
        report["helper_reads"] = READS["helpers"]
        released.set()
        _before_read = None
    report["cancelled"] = scope.cancelled_caught
    try:
        await comm.barrier()
    except trioring.TrioringError as exc:
        report["next"] = _worker_util.describe(exc)
    return report


async def main(mode: str, out_dir: Path) -> int:
    rank = int(os.environ["RANK"])
    # Where the root may write into the readers' arrays, it does, and nobody reads in
    # threads (see _onehost._push): here they must.
    os.environ["TRIORING_PUSH"] = "0"
    if os.environ.get("THREADS_OFF_RANK") == str(rank):
        os.environ["TRIORING_THREADS"] = "0"
    with trio.fail_after(120):
        async with trioring.open_communicator() as comm:
            shm = comm._world.shm
            if shm is not None and mode != "natural":
                shm.cpus = 64
            if mode == "stress":
                report = await stress(comm, rank)
            elif mode == "natural":
                report = await natural(comm, rank)
            else:
                report = await interrupted(comm, rank, mode)
            report["features"] = sorted(comm.features)
    report.update(rank=rank, calls=CALLS, reads=READS)
    (out_dir / f"rank{rank}.json").write_text(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(trio.run(main, sys.argv[1], Path(sys.argv[2])))
