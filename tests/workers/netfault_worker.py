"""Worker for ``test_netfaults.py``: one rank on its own (namespaced) host, into whose network
the test injects a fault. Run as ``netfault_worker.py SCENARIO OUT_DIR INDEX [ARGS...]`` (see
``_worker_util`` for the marker files and the JSON report ``w{INDEX}.json``).

Every step records ``t0`` and ``t1``: ``time.monotonic()`` (one clock for every process on
the machine, whatever its network namespace) when it started and when it returned or raised,
so that the test measures how long after its fault a rank raised. A step that neither
returns nor raises within ``NETFAULT_HANG_S`` seconds (default 60) is cancelled and recorded
as ``TooSlowError``: "this rank hung".

Scenarios:

- ``loop ELEMENTS``: open a communicator from the environment (step ``open``, marker
  ``connected``), then allreduce ``ELEMENTS`` float32s again and again (step ``loop``; marker
  ``looping`` once the first one is done), checking every result, until the test creates
  ``finish``: each rank adds to every allreduce whether it has seen that file, so that all
  stop after the same one. Records ``iterations``.
- ``messages``: open a communicator (marker ``connected``), then pass small arrays round
  the ring with ``sendrecv`` (to rank + 1, from rank - 1) again and again (step
  ``messages``; marker ``looping`` once the first one is done), checking every one, until
  the test creates ``finish``. Records ``iterations``.
- ``open``: open a communicator and close it again (step ``open``), for rendezvous faults.
- ``connect ADDRESS TIMEOUT``: one ``TcpTransport.connect`` to ``ADDRESS`` with a peer timeout
  of ``TIMEOUT`` seconds (step ``connect``), no communicator.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import _worker_util
import numpy as np
import trio

import trioring
from trioring.transports import TcpTransport, TransportContext

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from _worker_util import Reporter

HANG_S = float(os.environ.get("NETFAULT_HANG_S", "60"))


async def timed(
    reporter: Reporter, name: str, function: Callable[[], Awaitable[object]], **extra: Any
) -> BaseException | None:
    """Run ``function`` within HANG_S; record how it ended and when (``t0``, ``t1``)."""
    t0 = time.monotonic()
    exc: BaseException | None = None
    try:
        with trio.fail_after(HANG_S):
            await function()
    except Exception as caught:
        exc = caught
    reporter.record(name, t0, exc, t0=t0, t1=time.monotonic(), **extra)
    return exc


async def opened(
    reporter: Reporter, stack: contextlib.AsyncExitStack
) -> trioring.Communicator | None:
    """A communicator from the environment, closed with ``stack`` (step ``open``, marker
    ``connected``); None if opening failed (the step records why)."""
    comms: list[trioring.Communicator] = []

    async def open_() -> None:
        comms.append(await stack.enter_async_context(trioring.open_communicator()))

    if await timed(reporter, "open", open_) is not None:
        return None
    reporter.mark("connected")
    return comms[0]


async def scenario_loop(reporter: Reporter, args: list[str]) -> None:
    elements = int(args[0])
    finish = reporter.out_dir / "finish"
    iterations = 0
    async with contextlib.AsyncExitStack() as stack:
        comm = await opened(reporter, stack)
        if comm is None:
            return
        n = comm.world_size
        array = np.empty(elements, np.float32)

        async def loop() -> None:
            nonlocal iterations
            while True:
                array[:] = comm.rank + 1
                array[0] = 1.0 if finish.exists() else 0.0
                await comm.allreduce(array)
                iterations += 1
                if array[-1] != n * (n + 1) // 2:
                    raise AssertionError(f"wrong result {array[-1]} in allreduce {iterations}")
                if iterations == 1:
                    reporter.mark("looping")
                if array[0] > 0:
                    return

        await timed(reporter, "loop", loop)
        reporter.report["iterations"] = iterations


async def scenario_messages(reporter: Reporter, args: list[str]) -> None:
    finish = reporter.out_dir / "finish"
    iterations = 0
    async with contextlib.AsyncExitStack() as stack:
        comm = await opened(reporter, stack)
        if comm is None:
            return
        n, r = comm.world_size, comm.rank

        async def loop() -> None:
            nonlocal iterations
            while not finish.exists():
                token = np.full(8, r * 1000 + iterations, np.int64)
                got = await comm.sendrecv(token, dest=(r + 1) % n, source=(r - 1) % n)
                if got[0] != (r - 1) % n * 1000 + iterations:
                    raise AssertionError(f"wrong message {got[0]} in round {iterations}")
                iterations += 1
                if iterations == 1:
                    reporter.mark("looping")

        await timed(reporter, "messages", loop)
        reporter.report["iterations"] = iterations


async def scenario_open(reporter: Reporter, args: list[str]) -> None:
    async def open_and_close() -> None:
        async with trioring.open_communicator():
            reporter.mark("connected")

    await timed(reporter, "open", open_and_close)


async def scenario_connect(reporter: Reporter, args: list[str]) -> None:
    address, timeout = args[0], float(args[1])
    transport = TcpTransport(TransportContext(rank=1, world_size=2, peer_timeout=timeout))

    async def connect() -> None:
        connection = await transport.connect(address)
        await connection.aclose()

    await timed(reporter, "connect", connect)


SCENARIOS = {
    "loop": scenario_loop,
    "messages": scenario_messages,
    "open": scenario_open,
    "connect": scenario_connect,
}


def main() -> None:
    name, out_dir, index, *args = sys.argv[1:]
    _worker_util.run_reporting(
        _worker_util.Reporter(Path(out_dir), int(index)), SCENARIOS[name], args
    )


if __name__ == "__main__":
    main()
