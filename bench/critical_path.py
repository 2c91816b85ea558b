"""The critical path of one call through the shared segment's slots, on every rank at once:
run under the launcher,

    .venv/bin/trioring run -n 2 bench/critical_path.py [--collective broadcast] [--size 64K]
        [--calls 3000]

Each call is timed as ``trioring bench`` and bench/paired.py time it (its arrays reset
first, a barrier after, neither timed; inputs, root and checks from
src/trioring/_bench_cases.py), with the ``shm`` algorithm forced, and timestamps taken where
a call through the slots changes hands (src/trioring/_onehost/_shm_collectives.py):

``run``       the communicator's call machinery starts: the argument checks, the decision
              and the planning are behind
``claim``     (``>`` start, ``<`` end) waiting until this rank's slot is free
``publish``   (``>`` ``<``) the call's header and sequence number go out; the copy into
              the slot, where the rank has one, is what lies between ``claim<`` and
              ``publish>``
``wait``      (``>`` ``<``) waiting until every peer has published, with the call's schedule
              point as its first look where it has to wait
``done``      this rank has finished reading the peers' slots (a copy out or a reduction
              lies between ``wait<`` and here)
``end``       the call has returned, its schedule point taken if the wait did not take it

The clock is ``time.perf_counter``, one for the processes of a host, so the ranks' marks
are comparable: every mark is printed as the median, over the calls after the first fifth,
of its time from the later rank's ``start`` in that call. It wraps the segment's functions
in timers, which add a call and a clock read or two to each; the protocol is the real one.
Rank 0 prints every rank's line.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np
import trio
from phases import Timeline

import trioring
from trioring._bench import format_size, parse_sizes
from trioring._bench_cases import CASES
from trioring._core import CommunicatorCore
from trioring._onehost import _shm_collectives as shm

MARKS = (
    "start", "run", "claim>", "claim<", "publish>", "publish<", "wait>", "wait<", "done", "end",
)  # fmt: skip
#: The collectives whose ``shm`` algorithm goes through the functions timed here.
COLLECTIVES = ("barrier", "broadcast", "allreduce", "reduce", "reduce_scatter")


def _install(timeline: Timeline) -> None:
    """Wrap the segment's steps (and the call machinery's entry) in timers that write into
    ``timeline.marks``: the first entry and the last exit of each, per call."""
    clock, marks = time.perf_counter, timeline.marks
    publish, done, run = shm.shm_publish, shm.shm_done, CommunicatorCore._run

    def timed_publish(*args: Any, **kwargs: Any) -> None:
        marks.setdefault("publish>", clock())
        publish(*args, **kwargs)
        marks["publish<"] = clock()

    def timed_done(*args: Any, **kwargs: Any) -> None:
        marks.setdefault("done", clock())
        done(*args, **kwargs)

    async def timed_run(self: CommunicatorCore, *args: Any, **kwargs: Any) -> None:
        marks.setdefault("run", clock())
        await run(self, *args, **kwargs)

    shm.shm_claim = timeline.timed("claim", shm.shm_claim)
    shm.shm_wait = timeline.timed("wait", shm.shm_wait)
    shm.shm_publish = timed_publish
    shm.shm_done = timed_done
    CommunicatorCore._run = timed_run  # type: ignore[method-assign]


async def main(collective: str, size: int, calls: int) -> None:
    timeline = Timeline()
    _install(timeline)
    marks = timeline.marks
    async with trioring.open_communicator() as comm:
        if "shm" not in comm.features:
            raise SystemExit(f"critical_path.py needs the shared segment: {comm.features!r}")
        comm._force_algorithm(collective, "shm")
        count = max(1, size // 4) if collective != "barrier" else 0
        case = CASES[collective].prepare(comm, count, np.dtype(np.float32), "sum")
        timeline = np.full((calls, len(MARKS)), np.nan)
        wrong = 0
        for call in range(calls):
            case.reset()
            marks.clear()
            marks["start"] = time.perf_counter()
            result = await case.call()
            marks["end"] = time.perf_counter()
            # Before the barrier, which goes through the same functions.
            timeline[call] = [marks.get(name, np.nan) for name in MARKS]
            wrong += not case.check(result)
            await comm.barrier()
        if wrong:
            raise SystemExit(f"rank {comm.rank}: {wrong} wrong results")
        everyone = await comm.allgather(timeline[calls // 5 :])
        if comm.rank != 0:
            return
        # Each call's zero: the later rank's start (the ranks leave the barrier apart).
        zero = np.max(everyone[:, :, 0], axis=0)[:, None]
        label = format_size(case.nbytes) if collective != "barrier" else ""
        for rank, rows in enumerate(everyone):
            relative = (rows - zero) * 1e6
            medians = [
                f"{name} {np.nanmedian(relative[:, j]):.1f}"
                for j, name in enumerate(MARKS)
                if not np.all(np.isnan(relative[:, j]))
            ]
            print(
                f"rank {rank}: {collective} {label} world {comm.world_size}, median us from "
                "the later start: " + "  ".join(medians),
                flush=True,
            )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--collective", choices=COLLECTIVES, default="broadcast")
    parser.add_argument("--size", default="64K", help="bytes, as trioring bench's sizes")
    parser.add_argument("--calls", type=int, default=3000)
    args = parser.parse_args()
    (size,) = parse_sizes(args.size)
    trio.run(main, args.collective, size, args.calls)
