"""One rank of a chaos trial (``tests/chaos.py``): ``chaos_worker.py OUT_DIR SEED``.

Every rank draws the same plan from ``SEED`` and the world size: a few collectives (each
with its size, root and seeded inputs), and one fault on one rank, the victim, at one of
them: its call cancelled after a drawn delay (then it closes its communicator), the
process killed (``SIGKILL``) a drawn delay after it enters the call or right before it,
the communicator left (closed before the call), or an exception raised inside ``async
with`` before the call. The calls run on the world communicator, on a ``dup()`` of it, or
on a ``split()`` with every rank in one group in reverse order (so that the rank an error
names is a sub-communicator's, not the world's). In half the trials a second communicator,
a ``dup()`` of the world made before the first, runs calls of its own at the same time, in
another task of the same nursery: a failure in either task cancels the other's call, as in
any Trio program, so the fault's news must cross from one communicator to the other through
the ranks that give up. In a third of the trials a second rank has a fault of its own
(drawn the same way, at its own call of the first communicator), so that two failures
cross. In a third of the trials one call (in half of those, the first fault's) runs on a
``dup()`` of the communicator made for it and closed after it, so that a fault can land
while the ranks make a communicator: in its agreement, while its connections are made, or
while it closes. Every rank checks every result it gets against numpy, and
records in ``w{RANK}.json``, for each communicator: how many calls it completed, and the
error that ended its run, or the call its task was cancelled in (any exception: the driver
judges whether it was the right one). A call that takes longer than ``HANG_S`` is cancelled
and recorded as a hang.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import _worker_util
import numpy as np
import trio

import trioring

if TYPE_CHECKING:
    from collections.abc import Iterator

#: A call that has not ended after this long is a hang (a healthy call here takes < 0.1 s,
#: a failure is noticed within about a second).
HANG_S = 20.0
#: Collectives a trial draws from.
COLLECTIVES = (
    "allreduce",
    "broadcast",
    "barrier",
    "allgather",
    "allgatherv",
    "reduce_scatter",
    "reduce",
    "gather",
    "scatter",
    "alltoall",
    "scan",
    "sendrecv",
    "broadcast_object",
)
#: Elements (float32) per block: through the slots, the pipe, cross-memory attach (and,
#: where each rank has a CPU, pushed writes), and by sockets where those are off.
SIZES = (1, 1000, 16_384, 100_000, 600_000, 2_500_000)
FAULTS = ("cancel", "kill", "kill_before", "leave", "raise")
#: Seconds after the victim enters its call that the cancel or the kill lands.
DELAYS = (0.0, 20e-6, 200e-6, 1e-3, 5e-3)
#: The communicator the calls run on: the world, ``world.dup()``, or
#: ``world.split(color=0, key=-rank)`` (rank r of the world is rank n - 1 - r there).
COMMS = ("world", "dup", "reversed")


#: Calls of the communicator beside (see the module docstring) are numbered from here in
#: their inputs, so that no input equals one of the first communicator's.
BESIDE_FROM = 100


def _calls(rng: np.random.Generator, n: int) -> list[dict[str, Any]]:
    return [
        {
            "collective": str(rng.choice(COLLECTIVES)),
            "size": int(rng.choice(SIZES)),
            "root": int(rng.integers(n)),
        }
        for _ in range(int(rng.integers(2, 6)))
    ]


def plan(seed: int, n: int) -> dict[str, Any]:
    """The trial of ``seed`` at world ``n``: the same on every rank."""
    rng = np.random.default_rng(seed)
    calls = _calls(rng, n)
    trial = {
        "calls": calls,
        "victim": int(rng.integers(n)),
        "at": int(rng.integers(len(calls))),
        "fault": str(rng.choice(FAULTS)),
        "delay": float(rng.choice(DELAYS)),
        # Drawn after the fields above, so that those are the draws of the seeds before it
        # existed.
        "comm": str(rng.choice(COMMS)),
    }
    # Drawn after, likewise: the calls of a communicator beside the first, or none.
    trial["beside"] = _calls(rng, n) if rng.integers(2) else []
    # Drawn last, likewise: a second rank's fault, or none.
    trial["second"] = None
    if rng.integers(3) == 0:
        trial["second"] = {
            "victim": int((trial["victim"] + rng.integers(1, n)) % n),
            "at": int(rng.integers(len(calls))),
            "fault": str(rng.choice(FAULTS)),
            "delay": float(rng.choice(DELAYS)),
        }
    # Drawn after even that: the call that runs on a dup() made for it, or none.
    trial["dup_at"] = None
    if rng.integers(3) == 0:
        trial["dup_at"] = int(trial["at"] if rng.integers(2) else rng.integers(len(calls)))
    return trial


def faults(trial: dict[str, Any]) -> dict[int, dict[str, Any]]:
    """The faults of ``trial`` (a plan) by the world rank of their victim: each with its
    ``at``, ``fault`` and ``delay``."""
    found = {trial["victim"]: {key: trial[key] for key in ("at", "fault", "delay")}}
    if trial["second"]:
        found[trial["second"]["victim"]] = trial["second"]
    return found


def inputs(i: int, r: int, length: int) -> np.ndarray:
    """Rank ``r``'s input to call ``i``: small integers as float32, so every sum is exact."""
    return ((np.arange(length, dtype=np.int64) * (i + 3) + 7 * r + i) % 13).astype(np.float32)


def make_call(comm: trioring.Communicator, i: int, call: dict[str, Any]) -> Any:
    """An async function running call ``i`` of the plan on this rank and raising
    AssertionError if its result is wrong."""
    n, r = comm.world_size, comm.rank
    name, m, root = call["collective"], call["size"], call["root"]
    every = [inputs(i, q, m) for q in range(n)]
    total = np.sum(every, axis=0)

    async def run() -> None:
        if name == "allreduce":
            a = every[r].copy()
            await comm.allreduce(a)
            np.testing.assert_array_equal(a, total)
        elif name == "broadcast":
            a = every[r].copy()
            await comm.broadcast(a, root=root)
            np.testing.assert_array_equal(a, every[root])
        elif name == "barrier":
            await comm.barrier()
        elif name == "allgather":
            got = await comm.allgather(every[r])
            np.testing.assert_array_equal(got, np.stack(every))
        elif name == "allgatherv":
            mine = inputs(i, r, m + r)
            got = await comm.allgatherv(mine)
            for q in range(n):
                np.testing.assert_array_equal(got[q], inputs(i, q, m + q))
        elif name == "reduce_scatter":
            blocks = [inputs(i, q, n * m) for q in range(n)]
            got = await comm.reduce_scatter(blocks[r])
            np.testing.assert_array_equal(got, np.sum(blocks, axis=0)[r * m : (r + 1) * m])
        elif name == "reduce":
            a = every[r].copy()
            await comm.reduce(a, root=root)
            if r == root:
                np.testing.assert_array_equal(a, total)
        elif name == "gather":
            got = await comm.gather(every[r], root=root)
            if r == root:
                np.testing.assert_array_equal(got, np.stack(every))
        elif name == "scatter":
            blocks = np.stack([inputs(i, q, m) for q in range(n)]) if r == root else None
            got = await comm.scatter(blocks, root=root)
            np.testing.assert_array_equal(got, inputs(i, r, m))
        elif name == "alltoall":
            x = np.stack([inputs(i, n * r + q, m) for q in range(n)])
            got = await comm.alltoall(x)
            np.testing.assert_array_equal(
                got, np.stack([inputs(i, n * q + r, m) for q in range(n)])
            )
        elif name == "scan":
            a = every[r].copy()
            await comm.scan(a)
            np.testing.assert_array_equal(a, np.sum(every[: r + 1], axis=0))
        elif name == "sendrecv":
            got = await comm.sendrecv(every[r], dest=(r + 1) % n, source=(r - 1) % n)
            np.testing.assert_array_equal(got, every[(r - 1) % n])
        elif name == "broadcast_object":
            got = await comm.broadcast_object({"call": i, "from": r, "m": m}, root=root)
            assert got == {"call": i, "from": root, "m": m}, got
        else:  # pragma: no cover - the plan draws from COLLECTIVES
            raise AssertionError(name)

    return run


def in_dup(comm: trioring.Communicator, i: int, call: dict[str, Any]) -> Any:
    """:func:`make_call`'s call ``i``, run on a ``dup()`` of ``comm`` made for it (the same
    ranks) and closed after it: the fault of that call may land in the dup."""

    async def run() -> None:
        async with comm.dup() as twin:
            await make_call(twin, i, call)()

    return run


def kill_after(delay: float) -> None:
    """SIGKILL this process ``delay`` seconds from now, from a thread (the call runs on)."""

    def kill() -> None:
        if delay:
            time.sleep(delay)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=kill, daemon=True).start()


@contextlib.contextmanager
def _bounded(
    reporter: _worker_util.Reporter, report: dict[str, Any], step: str, at: int
) -> Iterator[None]:
    """Bound call ``at`` (``step`` in the steps) of ``report``'s communicator by ``HANG_S``,
    and record how it ended if it did not complete: its error, or that it was cancelled
    (the task beside failed; as a group of nothing but ``Cancelled``, too)."""
    started = time.monotonic()
    try:
        with trio.fail_after(HANG_S):
            yield
    except Exception as exc:
        reporter.record(step, started, exc)
        report["error"] = reporter.report["steps"][step]["error"]
        report["failed_at"] = at
        raise
    except BaseException as exc:
        if _worker_util.is_cancellation(exc):
            report["cancelled_at"] = at
            reporter.save()
        raise


async def trial(reporter: _worker_util.Reporter, comm: trioring.Communicator, seed: int) -> None:
    """Run the plan of ``seed`` on this rank. A call that fails is recorded, then its error
    propagates out of ``async with``, as in a program that does not catch it: the
    communicator closes on it, and tells the peers why."""
    trial = plan(seed, comm.world_size)
    report = reporter.report
    report.update(plan=trial, rank=comm.rank, features=sorted(comm.features), completed=0)
    # A victim is a world rank (a process), whichever rank it has in ``comm``.
    mine = faults(trial).get(int(os.environ["RANK"]))
    for i, call in enumerate(trial["calls"]):
        run = in_dup(comm, i, call) if i == trial["dup_at"] else make_call(comm, i, call)
        fault = mine["fault"] if mine and i == mine["at"] else None
        if fault == "kill_before":
            os.kill(os.getpid(), signal.SIGKILL)
        if fault == "leave":
            report["left"] = True
            return
        if fault == "raise":
            report["raised"] = True
            raise RuntimeError("chaos: the victim raises inside async with")
        with _bounded(reporter, report, f"call{i}", i):
            if fault == "kill":
                kill_after(mine["delay"])
                await run()
            elif fault == "cancel":
                with trio.move_on_after(mine["delay"]) as scope:
                    await run()
                if scope.cancelled_caught:
                    report["cancelled"] = True
                    return
            else:
                await run()
        report["completed"] = i + 1
        reporter.save()
    await _final(reporter, report, comm, "final", len(trial["calls"]))


async def _final(
    reporter: _worker_util.Reporter,
    report: dict[str, Any],
    comm: trioring.Communicator,
    step: str,
    calls: int,
) -> None:
    """The barrier after the ``calls`` calls of ``report``'s communicator."""
    # Before the barrier: a victim killed in it may have published its part, and then the
    # others complete it (see the failure model).
    report["final"] = True
    reporter.save()
    with _bounded(reporter, report, step, calls):
        await comm.barrier()
    report["completed"] = calls + 1
    reporter.save()


async def beside(
    reporter: _worker_util.Reporter, comm: trioring.Communicator, calls: list[dict[str, Any]]
) -> None:
    """Run the calls of the communicator beside the first (``comm``), recording in the
    report's ``beside`` entry as :func:`trial` records the first's. Nothing here is
    faulty: it fails only through the first communicator's fault, or when its sibling
    task's failure cancels it."""
    report: dict[str, Any] = {"completed": 0}
    reporter.report["beside"] = report
    for i, call in enumerate(calls):
        run = make_call(comm, BESIDE_FROM + i, call)
        with _bounded(reporter, report, f"beside{i}", i):
            await run()
        report["completed"] = i + 1
        reporter.save()
    await _final(reporter, report, comm, "beside_final", len(calls))


async def main(reporter: _worker_util.Reporter, seed: int) -> None:
    """Open the world (and the communicators of the plan), run the trial, and record how the
    communicators closed (the driver bounds the whole run, the open included)."""
    started = time.monotonic()
    try:
        async with trioring.open_communicator() as world, contextlib.AsyncExitStack() as stack:
            trial_plan = plan(seed, world.world_size)
            # Made first, so that every rank makes the two in the same order.
            other = await stack.enter_async_context(world.dup()) if trial_plan["beside"] else None
            on = trial_plan["comm"]
            if on == "world":
                comm = world
            elif on == "dup":
                comm = await stack.enter_async_context(world.dup())
            else:
                split = await stack.enter_async_context(world.split(color=0, key=-world.rank))
                assert split is not None
                comm = split
            reporter.record("open", started, None)
            if other is None:
                await trial(reporter, comm, seed)
            else:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(beside, reporter, other, trial_plan["beside"])
                    await trial(reporter, comm, seed)
    except Exception as exc:
        report = reporter.report
        if "plan" not in report:
            # Before the first call: a victim whose fault is at call 0 may act while this
            # rank still makes the sub-communicators with it.
            report["error"] = _worker_util.describe(exc)
            report["failed_at"] = "open"
        elif not _recorded(report):
            report["error"] = _worker_util.describe(exc)  # in closing (failed_at: "close")


def _recorded(report: dict[str, Any]) -> bool:
    """Whether a call of either communicator recorded how it failed."""
    return any(
        "error" in entry or "cancelled_at" in entry for entry in (report, report.get("beside", {}))
    ) or bool(report.get("raised"))


if __name__ == "__main__":
    out_dir, seed = sys.argv[1:]
    reporter = _worker_util.Reporter(Path(out_dir), int(os.environ["RANK"]))
    _worker_util.run_reporting(reporter, main, int(seed))
