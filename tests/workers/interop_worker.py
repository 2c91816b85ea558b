"""A rank for the launcher-interop tests: run under torchrun, mpirun or in a network
namespace, check allreduce / broadcast / barrier against numpy, print one JSON line."""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import trio

import trioring


async def main() -> None:
    with trio.fail_after(float(os.environ.get("WORKER_DEADLINE_S", "60"))):
        async with trioring.open_communicator() as comm:
            n, r = comm.world_size, comm.rank
            x = np.arange(1000, dtype=np.float64) * (r + 1)
            await comm.allreduce(x)
            expected = np.arange(1000, dtype=np.float64) * sum(range(1, n + 1))
            y = np.full(17, r, dtype=np.int32)
            await comm.broadcast(y, root=n - 1)
            await comm.barrier()
            print(
                json.dumps(
                    {
                        "rank": r,
                        "world_size": n,
                        "transport": comm.transport,
                        "features": sorted(comm.features),
                        "allreduce_ok": bool(np.array_equal(x, expected)),
                        "broadcast_ok": bool((y == n - 1).all()),
                    }
                ),
                flush=True,
            )


if __name__ == "__main__":
    trio.run(main)
    sys.exit(0)
