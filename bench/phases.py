"""Where a copying collective's time goes by cross-memory attach, phase by phase, on every
rank: run under the launcher,

    .venv/bin/trioring run -n 2 --tag-output bench/phases.py [--collective allgather]
        [--size 4M] [--calls 200]

Each call is timed as ``trioring bench`` times it (its arrays reset first, a barrier after,
neither timed; inputs and checks from src/trioring/_bench_cases.py), with the ``cma``
algorithm forced, and timestamps taken at the boundaries of the steps every rank of that
algorithm goes through (src/trioring/_onehost/_copies.py):

``before``   from the call to the start of the exposure: the argument checks, the call's
             identity, the communicator's machinery; no byte of the array is touched
``expose``   publishing the call and this rank's address, copying its own block meanwhile
             (allgather, scatter's root, alltoall) and waiting until every rank has published
``read``     this rank's ``process_vm_readv`` reads from its peers, summed
``finish``   saying "done" and waiting until every rank has (no peer still reads this rank)
``after``    from there to the caller: the call's schedule point and return

A scatter through the shared segment publishes the root's address in its header round, so
it has no ``expose``: its ``before`` holds the header round (and, on the root, the copy of
its own block).

Printed per rank: the median of each phase and of the whole call (this rank's), over the
calls after the first fifth. The clock is ``time.perf_counter``, shared by the processes of
one host, so the ranks' lines can be read side by side. It wraps three functions of
trioring's internals (``_copies.expose``, ``read_peer`` and ``finish``) in timers, which add
a call and two clock reads to each; the protocol itself is the real one.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import TYPE_CHECKING, Any

import numpy as np
import trio

import trioring
from trioring._bench import format_size, parse_sizes
from trioring._bench_cases import CASES
from trioring._onehost import _copies

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

PHASES = ("before", "expose", "read", "finish", "after")
#: The collectives that have a ``cma`` algorithm built on ``_copies._copy``.
COLLECTIVES = ("allgather", "gather", "scatter", "alltoall")


class Timeline:
    """The timestamps of the current call, by name (``read`` may come several times); also
    bench/critical_path.py's timers."""

    def __init__(self) -> None:
        self.marks: dict[str, float] = {}
        self.read = 0.0

    def timed(self, name: str, function: Callable[..., Awaitable[Any]]) -> Callable[..., Any]:
        async def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            self.marks.setdefault(name + ">", start)
            try:
                return await function(*args, **kwargs)
            finally:
                end = time.perf_counter()
                self.marks[name + "<"] = end
                if name == "read":
                    self.read += end - start

        return wrapper


async def main(collective: str, size: int, calls: int) -> None:
    timeline = Timeline()
    _copies.expose = timeline.timed("expose", _copies.expose)  # type: ignore[assignment]
    _copies.read_peer = timeline.timed("read", _copies.read_peer)  # type: ignore[assignment]
    _copies.finish = timeline.timed("finish", _copies.finish)  # type: ignore[assignment]
    async with trioring.open_communicator() as comm:
        if "cma" not in comm.features:
            raise SystemExit(f"phases.py needs cross-memory attach: {comm.features!r}")
        comm._force_algorithm(collective, "cma")
        case = CASES[collective].prepare(comm, max(1, size // 4), np.dtype(np.float32), "sum")
        phases: dict[str, list[float]] = {name: [] for name in (*PHASES, "call")}
        wrong = 0
        for _ in range(calls):
            case.reset()
            timeline.marks.clear()
            timeline.read = 0.0
            start = time.perf_counter()
            result = await case.call()
            end = time.perf_counter()
            wrong += not case.check(result)
            await comm.barrier()
            marks = timeline.marks
            # A rank that exposes nothing (a gather's peers, a scatter's non-roots) still
            # goes through expose, or publishes in the header round that precedes it; a
            # rank that reads nothing has no read.
            exposed = marks.get("expose>", marks["finish>"])
            spans = {
                "before": exposed - start,
                "expose": marks.get("expose<", exposed) - exposed,
                "read": timeline.read,
                "finish": marks["finish<"] - marks["finish>"],
                "after": end - marks["finish<"],
                "call": end - start,
            }
            for name, seconds in spans.items():
                phases[name].append(seconds * 1e6)
        if wrong:
            raise SystemExit(f"rank {comm.rank}: {wrong} wrong results")
        skip = calls // 5
        print(
            f"rank {comm.rank}: {collective} {format_size(case.nbytes)} by cma, "
            f"world {comm.world_size}, median us: "
            + "  ".join(f"{name} {statistics.median(v[skip:]):.0f}" for name, v in phases.items()),
            flush=True,
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--collective", choices=COLLECTIVES, default="allgather")
    parser.add_argument("--size", default="4M", help="bytes, as trioring bench's sizes")
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args()
    (size,) = parse_sizes(args.size)
    trio.run(main, args.collective, size, args.calls)
