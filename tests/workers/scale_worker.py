"""One rank of a large world (tests/test_scale.py), started by ``trioring run``: open a
communicator, check an allreduce, a broadcast and a barrier against numpy, and print one JSON
line with what this rank saw.

The arguments name the communicators to open one after another (default: ``unix``):
``unix``, as launched; ``plain``, the same with the one-host paths turned off
(``TRIORING_SHM=0``, ``TRIORING_CMA=0``); ``tcp``, over TCP on loopback, rendezvous at a
port that rank 0 listens on and tells the others through the communicator before it. One
launch of 64 interpreters then covers what three did (their start-up was most of each
test's 25 s)."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import time
from typing import TYPE_CHECKING, Any

import numpy as np
import trio

import trioring

if TYPE_CHECKING:
    from collections.abc import AsyncIterator


@contextlib.asynccontextmanager
async def _open(mode: str, previous: trioring.Communicator | None) -> AsyncIterator[Any]:
    if mode == "plain":
        os.environ["TRIORING_SHM"] = "0"
        os.environ["TRIORING_CMA"] = "0"
    else:
        os.environ.pop("TRIORING_SHM", None)
        os.environ.pop("TRIORING_CMA", None)
    if mode != "tcp":
        async with trioring.open_communicator() as comm:
            yield comm
        return
    assert previous is not None, "tcp needs a communicator before it to agree on the port"
    with contextlib.ExitStack() as stack:
        port = np.zeros(1, np.int64)
        if previous.rank == 0:
            listener = stack.enter_context(socket.socket())
            listener.bind(("127.0.0.1", 0))
            listener.listen(previous.world_size)
            port[0] = listener.getsockname()[1]
            os.environ["TRIORING_LISTEN_FD"] = str(listener.fileno())
        await previous.broadcast(port, root=0)
        async with trioring.open_communicator(
            transport="tcp", master_addr="127.0.0.1", master_port=int(port[0])
        ) as comm:
            yield comm


async def _check(comm: trioring.Communicator, mode: str, opened: float) -> dict[str, Any]:
    n, r = comm.world_size, comm.rank
    # Integer-valued float64: any order of addition is exact.
    x = np.arange(1000, dtype=np.float64) + r
    await comm.allreduce(x)
    expected = n * np.arange(1000, dtype=np.float64) + n * (n - 1) / 2
    y = np.full(8, r, dtype=np.int64)
    await comm.broadcast(y, root=n - 1)
    await comm.barrier()
    return {
        "mode": mode,
        "rank": r,
        "world_size": n,
        "transport": comm.transport,
        "features": sorted(comm.features),
        "allreduce_ok": bool(np.array_equal(x, expected)),
        "broadcast_ok": bool((y == n - 1).all()),
        "opened_s": round(opened, 2),
    }


async def main() -> None:
    modes = sys.argv[1:] or ["unix"]
    reports = []
    previous: trioring.Communicator | None = None
    async with contextlib.AsyncExitStack() as stack:
        for mode in modes:
            started = time.monotonic()
            comm = await stack.enter_async_context(_open(mode, previous))
            reports.append(await _check(comm, mode, time.monotonic() - started))
            previous = comm
    # One write(2) of under PIPE_BUF bytes per line: lines of 128 ranks sharing one pipe
    # stay whole.
    for report in reports:
        os.write(1, (json.dumps(report) + "\n").encode())


trio.run(main)
