"""Worker for ``test_hostile.py``: one rank of a job that a hostile world is thrown at.

Run as ``hostile_worker.py SCENARIO OUT_DIR INDEX [ARGS...]`` (see ``_worker_util`` for the
marker files and the JSON report), configured by the environment like any rank, plus:

- ``HOSTILE_SEED``: seeds this job's inputs, so that two jobs on one host compute different
  results and any cross-talk shows up as a wrong answer;
- ``HOSTILE_PROXY``: ``host:port`` of ``hostile_proxy.py``, for ``TRIORING_TRANSPORT=proxied``
  (:class:`ProxiedTcp`, a third-party transport registered here at start-up).

Every rank logs the ``trioring`` logger at INFO to ``OUT_DIR/w{INDEX}.trioring.log``.

Scenarios:

- ``run ROUNDS OPS KINDS LENGTH``: ``ROUNDS`` times, open a communicator (same environment,
  so the same address every time), run ``OPS`` collectives on int64 arrays of ``LENGTH``
  elements (``KINDS``: ``allreduce`` only, or ``mix``: allreduce, broadcast from a rotating
  root, barrier, on ``LENGTH`` and ``10 LENGTH + 1`` elements in turn), check every result
  against numpy, and close it. At the first collective
  that fails, record it, then one more call, and stop.
- ``recover FAULT``: open a communicator and run one collective; then ``FAULT`` strikes:
  ``cancel`` (rank 1 abandons an allreduce by ``trio.move_on_after``; the others join it only
  once rank 1 has given up) or ``close`` (rank 1 closes its communicator; then the others call
  an allreduce). Every rank records what it raised, leaves that communicator, opens a new
  one at the same address and runs ``OPS`` checked collectives.

Both record the number of open file descriptors before the first communicator and after each
one is closed (``fds``), to catch leaks.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, final

import _worker_util
import hostile_proxy
import numpy as np
import trio

import trioring
from trioring.transports import Connection, Listener, TcpTransport, Transport, TransportContext

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from _worker_util import Reporter

#: A collective that neither returns nor raises within this many seconds counts as a hang.
HANG_S = 10.0
#: Bound on open_communicator (a test that expects a rank to wait for peers that never come
#: lowers it with HOSTILE_OPEN_S).
OPEN_S = float(os.environ.get("HOSTILE_OPEN_S", "20"))
#: How long rank 1 lets its allreduce run before abandoning it (``recover cancel``).
CANCEL_AFTER_S = 0.2
#: Checked collectives after recovery.
RECOVERY_OPS = 6


@final
class ProxiedTcp(Transport):
    """TCP whose outgoing data connections go through ``hostile_proxy.py``: ``connect``
    connects to the proxy and tells it the real address (rendezvous stays direct TCP)."""

    name = "proxied"
    description = "TCP through the fault-injecting test proxy"

    def __init__(self, context: TransportContext) -> None:
        super().__init__(context)
        self._tcp = TcpTransport(context)

    async def listen(self, address: str | None = None) -> Listener:
        return await self._tcp.listen(address)

    async def connect(self, address: str) -> Connection:
        connection = await self._tcp.connect(os.environ["HOSTILE_PROXY"])
        try:
            await connection.send_all(hostile_proxy.preamble(address))
        except BaseException:
            await trio.aclose_forcefully(connection)
            raise
        return connection


def make_input(seed: int, round_: int, op: int, rank: int, length: int) -> np.ndarray:
    rng = np.random.default_rng([seed, round_, op, rank])
    return rng.integers(-(2**20), 2**20, length, dtype=np.int64)


def open_fds() -> list[str]:
    fds = []
    for name in os.listdir("/proc/self/fd"):
        try:
            fds.append(f"{name}->{os.readlink(f'/proc/self/fd/{name}')}")
        except OSError:
            continue  # the directory listing's own descriptor, closed by now
    return sorted(fds)


class Job:
    """What every rank of this job knows, so that each can check every result itself."""

    def __init__(self, reporter: Reporter) -> None:
        self.reporter = reporter
        self.seed = int(os.environ.get("HOSTILE_SEED", "0"))
        self.ops: list[dict[str, Any]] = reporter.report.setdefault("ops", [])
        self.fds: list[dict[str, Any]] = reporter.report.setdefault("fds", [])

    def count_fds(self, when: str) -> None:
        self.fds.append({"when": when, "fds": open_fds()})

    async def call(
        self, round_: int, op: int, kind: str, function: Callable[[], Awaitable[object]]
    ) -> BaseException | None:
        started = time.monotonic()
        error: BaseException | None = None
        try:
            with trio.fail_after(HANG_S):
                await function()
        except Exception as exc:
            error = exc
        self.ops.append(
            {
                "round": round_,
                "op": op,
                "kind": kind,
                "started": started,
                "ended": time.monotonic(),
                "error": None if error is None else _worker_util.describe(error),
            }
        )
        return error

    async def checked(
        self, comm: trioring.Communicator, round_: int, op: int, kind: str, length: int
    ) -> BaseException | None:
        """One collective whose result is checked against numpy; a wrong result is recorded
        as ``correct: false`` (and the collective as succeeded)."""
        size, rank = comm.world_size, comm.rank
        inputs = [make_input(self.seed, round_, op, r, length) for r in range(size)]
        array = inputs[rank].copy()
        if kind == "allreduce":
            expected = np.sum(inputs, axis=0, dtype=np.int64)
            error = await self.call(round_, op, kind, lambda: comm.allreduce(array))
        elif kind == "broadcast":
            root = op % size
            expected = inputs[root]
            error = await self.call(round_, op, kind, lambda: comm.broadcast(array, root=root))
        else:
            expected = array
            error = await self.call(round_, op, kind, comm.barrier)
        self.ops[-1]["seq"] = comm.seq
        self.ops[-1]["correct"] = error is None and bool(np.array_equal(array, expected))
        return error

    async def collectives(
        self, comm: trioring.Communicator, round_: int, count: int, kinds: str, length: int
    ) -> bool:
        """``count`` checked collectives; after the first failure, one more call (which must
        raise CommunicatorBrokenError), and False."""
        cycle = ("allreduce",) if kinds == "allreduce" else ("allreduce", "broadcast", "barrier")
        for op in range(count):
            # "mix" also alternates sizes (LENGTH, 10 LENGTH + 1), so that both the small- and
            # the large-array paths of each collective run.
            size = length if kinds == "allreduce" or op % 2 == 0 else 10 * length + 1
            if await self.checked(comm, round_, op, cycle[op % len(cycle)], size) is not None:
                await self.call(round_, count, "after", comm.barrier)
                return False
        return True


async def open_round(
    job: Job, round_: int, stack: contextlib.AsyncExitStack
) -> trioring.Communicator | None:
    """Open this round's communicator on ``stack``; None (and the error recorded) if that
    fails. After the stack is closed, count the open file descriptors."""
    stack.callback(job.count_fds, f"after round {round_}")
    started = time.monotonic()
    try:
        with trio.fail_after(OPEN_S):
            comm = await stack.enter_async_context(trioring.open_communicator())
    except Exception as exc:
        job.reporter.record(f"open{round_}", started, exc)
        return None
    job.reporter.record(f"open{round_}", started, None)
    if round_ == 0:
        job.reporter.mark("connected")
    return comm


async def scenario_run(reporter: Reporter, args: list[str]) -> None:
    rounds, ops, kinds, length = int(args[0]), int(args[1]), args[2], int(args[3])
    job = Job(reporter)
    job.count_fds("start")
    for round_ in range(rounds):
        async with contextlib.AsyncExitStack() as stack:
            comm = await open_round(job, round_, stack)
            if comm is None:
                return
            if not await job.collectives(comm, round_, ops, kinds, length):
                return


async def scenario_recover(reporter: Reporter, args: list[str]) -> None:
    (fault,) = args
    job = Job(reporter)
    job.count_fds("start")
    async with contextlib.AsyncExitStack() as stack:
        comm = await open_round(job, 0, stack)
        if comm is None or await job.checked(comm, 0, 0, "allreduce", 1000) is not None:
            return
        array = np.ones(1000, np.int64)
        if comm.rank == 1:
            if fault == "cancel":
                with trio.move_on_after(CANCEL_AFTER_S) as scope:
                    await comm.allreduce(array)
                reporter.report["cancelled_caught"] = scope.cancelled_caught
                reporter.report["broken"] = comm.broken
            else:
                await comm.aclose()
            reporter.mark("faulted")
        else:
            with trio.fail_after(HANG_S):
                await reporter.wait_for("w1.faulted")
            await job.call(0, 1, "allreduce", functools.partial(comm.allreduce, array))
            await job.call(0, 2, "after", comm.barrier)
    async with contextlib.AsyncExitStack() as stack:
        comm = await open_round(job, 1, stack)
        if comm is None:
            return
        await job.collectives(comm, 1, RECOVERY_OPS, "mix", 1000)


def main() -> None:
    name, out_dir, index, *args = sys.argv[1:]
    logging.basicConfig(
        filename=str(Path(out_dir) / f"w{index}.trioring.log"),
        level=logging.INFO,
        format="%(created).6f %(levelname)s %(name)s %(message)s",
    )
    trioring.register_transport(ProxiedTcp)
    scenarios = {"run": scenario_run, "recover": scenario_recover}
    _worker_util.run_reporting(
        _worker_util.Reporter(Path(out_dir), int(index)), scenarios[name], args
    )


if __name__ == "__main__":
    main()
