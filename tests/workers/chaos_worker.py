"""One rank of a chaos trial (``tests/chaos.py``): ``chaos_worker.py OUT_DIR SEED``.

Every rank draws the same plan from ``SEED`` and the world size: a few collectives (each
with its size, root and seeded inputs), and one fault on one rank, the victim, at one of
them: its call cancelled after a drawn delay (then it closes its communicator), the
process killed (``SIGKILL``) a drawn delay after it enters the call or right before it,
the communicator left (closed before the call), or an exception raised inside ``async
with`` before the call. The calls run on the world communicator, on a ``dup()`` of it, or
on a ``split()`` with every rank in one group in reverse order (so that the rank an error
names is a sub-communicator's, not the world's). Every rank checks every result it gets against numpy, and
records in ``w{RANK}.json``: how many calls it completed, and the error that ended its
run (any exception: the driver judges whether it was the right one). A call that takes
longer than ``HANG_S`` is cancelled and recorded as a hang.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import _worker_util
import numpy as np
import trio

import trioring

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


def plan(seed: int, n: int) -> dict[str, Any]:
    """The trial of ``seed`` at world ``n``: the same on every rank."""
    rng = np.random.default_rng(seed)
    calls = []
    for _ in range(int(rng.integers(2, 6))):
        calls.append(
            {
                "collective": str(rng.choice(COLLECTIVES)),
                "size": int(rng.choice(SIZES)),
                "root": int(rng.integers(n)),
            }
        )
    return {
        "calls": calls,
        "victim": int(rng.integers(n)),
        "at": int(rng.integers(len(calls))),
        "fault": str(rng.choice(FAULTS)),
        "delay": float(rng.choice(DELAYS)),
        # Drawn last, so that the draws above are those of the seeds before it existed.
        "comm": str(rng.choice(COMMS)),
    }


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


def kill_after(delay: float) -> None:
    """SIGKILL this process ``delay`` seconds from now, from a thread (the call runs on)."""

    def kill() -> None:
        if delay:
            time.sleep(delay)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=kill, daemon=True).start()


async def trial(reporter: _worker_util.Reporter, comm: trioring.Communicator, seed: int) -> None:
    """Run the plan of ``seed`` on this rank. A call that fails is recorded, then its error
    propagates out of ``async with``, as in a program that does not catch it: the
    communicator closes on it, and tells the peers why."""
    trial = plan(seed, comm.world_size)
    report = reporter.report
    report.update(plan=trial, rank=comm.rank, features=sorted(comm.features), completed=0)
    # The victim is a world rank (a process), whichever rank it has in ``comm``.
    victim = int(os.environ["RANK"]) == trial["victim"]
    for i, call in enumerate(trial["calls"]):
        run = make_call(comm, i, call)
        fault = trial["fault"] if victim and i == trial["at"] else None
        if fault == "kill_before":
            os.kill(os.getpid(), signal.SIGKILL)
        if fault == "leave":
            report["left"] = True
            return
        if fault == "raise":
            report["raised"] = True
            raise RuntimeError("chaos: the victim raises inside async with")
        started = time.monotonic()
        try:
            with trio.fail_after(HANG_S):
                if fault == "kill":
                    kill_after(trial["delay"])
                    await run()
                elif fault == "cancel":
                    with trio.move_on_after(trial["delay"]) as scope:
                        await run()
                    if scope.cancelled_caught:
                        report["cancelled"] = True
                        return
                else:
                    await run()
        except Exception as exc:
            reporter.record(f"call{i}", started, exc)
            report["error"] = report["steps"][f"call{i}"]["error"]
            report["failed_at"] = i
            raise
        report["completed"] = i + 1
        reporter.save()
    # Before the barrier: a victim killed in it may have published its part, and then the
    # others complete it (see the failure model).
    report["final"] = True
    reporter.save()
    started = time.monotonic()
    try:
        with trio.fail_after(HANG_S):
            await comm.barrier()
    except Exception as exc:
        reporter.record("final", started, exc)
        report["error"] = report["steps"]["final"]["error"]
        report["failed_at"] = len(trial["calls"])
        raise
    report["completed"] = len(trial["calls"]) + 1
    reporter.save()


async def main(reporter: _worker_util.Reporter, seed: int) -> None:
    """Open the world, run the trial, and record how the communicator closed (the driver
    bounds the whole run, the open included)."""
    started = time.monotonic()
    try:
        async with trioring.open_communicator() as world:
            on = plan(seed, world.world_size)["comm"]
            if on == "world":
                reporter.record("open", started, None)
                await trial(reporter, world, seed)
            elif on == "dup":
                async with world.dup() as comm:
                    reporter.record("open", started, None)
                    await trial(reporter, comm, seed)
            else:
                async with world.split(color=0, key=-world.rank) as comm:
                    assert comm is not None
                    reporter.record("open", started, None)
                    await trial(reporter, comm, seed)
    except Exception as exc:
        reporter.report.setdefault("error", _worker_util.describe(exc))
        if "plan" not in reporter.report:
            # Before the first call: a victim whose fault is at call 0 may act while this
            # rank still makes the sub-communicator with it.
            reporter.report["failed_at"] = "open"


if __name__ == "__main__":
    out_dir, seed = sys.argv[1:]
    reporter = _worker_util.Reporter(Path(out_dir), int(os.environ["RANK"]))
    _worker_util.run_reporting(reporter, main, int(seed))
