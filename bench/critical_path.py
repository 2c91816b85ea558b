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
``point``     (``>`` ``<``) the call's one schedule point (a Trio checkpoint): the first look
              of a wait that had to wait, or the one the call takes before it returns (a
              wait long enough to take more spans from the first one's start to the last
              one's end)

The clock is ``time.perf_counter``, one for the processes of a host, so the ranks' marks
are comparable: every mark is printed as the median, over the calls after the first fifth,
of its time from the later rank's ``start`` in that call. It wraps the segment's functions
(and Trio's two checkpoints) in timers, which add a call and a clock read or two to each;
the protocol is the real one. Rank 0 prints every rank's line; then, per rank, how long
after the call's last publication (on any rank) its wait ended, median and 10th-90th
percentiles over the calls (medians of marks taken apart hide this where the rank that
starts last changes from call to call, as with more ranks than cores); and what the
schedule point took on each rank (median and 90th percentile), next to a checkpoint of the
same rank in a loop of nothing else, timed the same way: the difference is what a
checkpoint costs amid a call's other code.
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
from trioring._onehost import _shm_collectives as shm, _shm_reductions

MARKS = (
    "start", "run", "claim>", "claim<", "publish>", "publish<", "wait>", "wait<", "done", "end",
    "point>", "point<",
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

    # The segment's wait and the call machinery look these up in trio.lowlevel at each call.
    trio.lowlevel.checkpoint = timeline.timed("point", trio.lowlevel.checkpoint)
    trio.lowlevel.cancel_shielded_checkpoint = timeline.timed(
        "point", trio.lowlevel.cancel_shielded_checkpoint
    )
    timed = {
        "shm_claim": timeline.timed("claim", shm.shm_claim),
        "shm_wait": timeline.timed("wait", shm.shm_wait),
        "shm_publish": timed_publish,
        "shm_done": timed_done,
    }
    # The reductions' module imported the steps by name: it needs the timed ones too.
    for module in (shm, _shm_reductions):
        for name, function in timed.items():
            setattr(module, name, function)
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
        # The same checkpoint through the same timer, in a loop of nothing else.
        alone = np.empty(calls)
        for call in range(calls):
            marks.clear()
            await trio.lowlevel.checkpoint()
            alone[call] = marks["point<"] - marks["point>"]
        points = timeline[:, MARKS.index("point<")] - timeline[:, MARKS.index("point>")]
        point = np.nanpercentile(points[calls // 5 :], [50, 90]) * 1e6
        loop = np.percentile(alone[calls // 5 :], [50, 90]) * 1e6
        summary = np.array([*point, *loop])
        everyone = await comm.allgather(timeline[calls // 5 :])
        summaries = await comm.allgather(summary)
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
        ends = everyone[:, :, MARKS.index("wait<")] - np.max(
            everyone[:, :, MARKS.index("publish<")], axis=0
        )
        starts = everyone[:, :, MARKS.index("start")]
        spread = np.median(np.max(starts, axis=0) - np.min(starts, axis=0)) * 1e6
        print(f"the ranks started {spread:.1f} us apart (median over the calls)", flush=True)
        for rank, after in enumerate(ends * 1e6):
            p10, median, p90 = np.nanpercentile(after, [10, 50, 90])
            print(
                f"rank {rank}: its wait ended {median:.1f} us ({p10:.1f}-{p90:.1f}) after the "
                "call's last publication",
                flush=True,
            )
        for rank, (median, p90, loop_median, loop_p90) in enumerate(summaries):
            print(
                f"rank {rank}: the schedule point took {median:.1f} us (p90 {p90:.1f}) in the "
                f"call, {loop_median:.1f} (p90 {loop_p90:.1f}) in a loop of checkpoints",
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
