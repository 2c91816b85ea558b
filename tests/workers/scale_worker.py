"""One rank of a large world (tests/test_scale.py), started by ``trioring run``: open a
communicator, check an allreduce, a broadcast and a barrier against numpy, and print one JSON
line with what this rank saw."""

from __future__ import annotations

import json
import os
import time

import numpy as np
import trio

import trioring


async def main() -> None:
    started = time.monotonic()
    async with trioring.open_communicator() as comm:
        opened = time.monotonic() - started
        n, r = comm.world_size, comm.rank
        # Integer-valued float64: any order of addition is exact.
        x = np.arange(1000, dtype=np.float64) + r
        await comm.allreduce(x)
        expected = n * np.arange(1000, dtype=np.float64) + n * (n - 1) / 2
        allreduce_ok = bool(np.array_equal(x, expected))
        y = np.full(8, r, dtype=np.int64)
        await comm.broadcast(y, root=n - 1)
        broadcast_ok = bool((y == n - 1).all())
        await comm.barrier()
        report = {
            "rank": r,
            "world_size": n,
            "features": sorted(comm.features),
            "allreduce_ok": allreduce_ok,
            "broadcast_ok": broadcast_ok,
            "opened_s": round(opened, 2),
        }
    # One write(2) of under PIPE_BUF bytes: lines of 128 ranks sharing one pipe stay whole.
    os.write(1, (json.dumps(report) + "\n").encode())


trio.run(main)
