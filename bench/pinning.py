"""Does pinning ranks to cores help small collectives when ranks outnumber cores?

    .venv/bin/python bench/pinning.py [--n 4] [--calls 3000] [--rounds 3]

Runs ``--n`` ranks under ``trioring run`` over Unix sockets (shared segment on), each doing
``--calls`` back-to-back barriers, then as many 4-byte allreduces, unpinned and pinned
(rank r on the r % cores-th core of its affinity, as ``mpirun --bind-to core`` would),
alternating the two in every round. Prints, per round and variant, the slowest rank's median
over 5 blocks of the time per call. (At world 4 on 2 cores pinning was 4-5x slower, and at
world 2 pinned was as fast as unpinned once ranks read their peers' CPUs; see the
performance page.)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np
import trio

import trioring

BLOCKS = 5


async def _rank(calls: int, pin: bool) -> None:
    if pin:
        cpus = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cpus[int(os.environ["RANK"]) % len(cpus)]})
    async with trioring.open_communicator() as comm:
        x = np.ones(1, np.float32)
        medians = {}
        for what in ("barrier", "allreduce"):

            async def call(what: str = what) -> None:
                if what == "barrier":
                    await comm.barrier()
                else:
                    await comm.allreduce(x)

            for _ in range(calls // 10):
                await call()
            per_block = []
            for _ in range(BLOCKS):
                started = time.perf_counter()
                for _ in range(calls // BLOCKS):
                    await call()
                per_block.append((time.perf_counter() - started) / (calls // BLOCKS) * 1e6)
            medians[what] = statistics.median(per_block)
        os.write(1, (json.dumps({"rank": comm.rank, **medians}) + "\n").encode())


def _world(n: int, calls: int, pin: bool) -> dict[str, float]:
    command = [sys.executable, "-m", "trioring", "run", "-n", str(n), "--no-tag-output"]
    command += [__file__, "--rank", "--calls", str(calls)] + (["--pin"] if pin else [])
    result = subprocess.run(command, capture_output=True, text=True, check=True, timeout=600)
    reports = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert len(reports) == n, result.stdout + result.stderr
    return {what: max(r[what] for r in reports) for what in ("barrier", "allreduce")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--calls", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--pin", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank:
        trio.run(_rank, args.calls, args.pin)
        return
    print(f"world {args.n}, {len(os.sched_getaffinity(0))} cores, {args.calls} calls each")
    for round_ in range(1, args.rounds + 1):
        for pin in (False, True):
            times = _world(args.n, args.calls, pin)
            cells = ", ".join(f"{what} {us:.1f} us" for what, us in times.items())
            print(f"round {round_} {'pinned' if pin else 'unpinned'}: {cells}")


if __name__ == "__main__":
    main()
