"""What a collective costs when the ranks do not arrive together: run under the launcher,

    .venv/bin/trioring run -n 2 bench/imbalance.py [--work-ms 1.5] [--calls 200] [--rounds 5]

Before every 4-byte allreduce one rank computes for ``--work-ms`` milliseconds (a busy loop:
the CPU work of a step in a real program) while the others go straight to the call and
wait in it. Two patterns:

- ``one late``: rank 1 is always the late one. The early ranks' waits may end late without
  anyone noticing: they only wait again in the next call.
- ``turns``: the late rank is ``i % world_size`` in call ``i``, so an early rank's wait that
  ends late delays its own work in the next call, and with it everyone.

Reported per pattern, on rank 0: the median over rounds of the time per call beyond the
work (the loop's time per call minus ``--work-ms``), and the range. A wait longer than its
poll (``SHM_SPIN_SECONDS``, 1 ms) parks in the event loop; what this measures is how soon a
parked wait ends once the late rank arrives. Before the segment's eventfds (a parked wait
woke only on its event loop's 1 ms timer), ``turns`` cost 589-719 us per call at world 2
and 452-532 at world 4 with 1.5 ms of work; with them, 137-182 and 223-327. ``one late``
went from 37-76 to 69-123 us at world 2 and from 52-75 to 103-111 at world 4: the late rank
now pays a system call per parked peer (the old and new code alternating, two runs of 3
rounds each, this 2-core VM; see docs/performance.md).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import trio

import trioring


def work(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


async def main(args: argparse.Namespace) -> None:
    seconds = args.work_ms / 1e3
    async with trioring.open_communicator() as comm:
        n, rank = comm.world_size, comm.rank
        value = np.ones(1, np.float32)
        for _ in range(20):
            await comm.allreduce(value)
        wrong = 0
        beyond: dict[str, list[float]] = {"one late": [], "turns": []}
        for _ in range(args.rounds):
            for pattern, late in (("one late", lambda i: 1), ("turns", lambda i: i % n)):
                await comm.barrier()
                start = time.perf_counter()
                for i in range(args.calls):
                    if rank == late(i):
                        work(seconds)
                    value[0] = 1
                    await comm.allreduce(value)
                    wrong += value[0] != n
                per_call = np.array([(time.perf_counter() - start) / args.calls - seconds])
                await comm.allreduce(per_call, op="max")
                beyond[pattern].append(float(per_call[0]) * 1e6)
        errors = np.array([wrong], np.int64)
        await comm.allreduce(errors)
        if errors[0]:
            raise SystemExit(f"rank {rank}: {int(errors[0])} wrong results")
        if rank == 0:
            print(
                f"# world {n}, {comm.transport}, features {sorted(comm.features)}, "
                f"{args.work_ms} ms of work before each 4-byte allreduce on the late rank, "
                f"{args.rounds} rounds of {args.calls} calls"
            )
            for pattern, values in beyond.items():
                print(
                    f"{pattern:>9}: {statistics.median(values):7.0f} us per call beyond the "
                    f"work ({min(values):.0f}-{max(values):.0f})"
                )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--work-ms", type=float, default=1.5)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=5)
    trio.run(main, parser.parse_args())
