"""What a collective that returns a new array costs against the same call into an ``out=``
that the program keeps: run under the launcher,

    .venv/bin/trioring run -n 2 bench/reuse.py [--sizes 64K,1M,4M] [--calls 60]

For each size (nccl-tests' meaning: what a rank receives in all), an allgather of float32
is timed both ways, alternating call by call (the order swapping each time), each call
after an untimed barrier; the first sixth of the calls warm up. Rank 0 prints each way's
median (the slowest rank's time per call). Every result is checked. A new array of a few
MiB comes from fresh pages that the kernel must map on first touch; ``out=`` pays that once.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import trio

import trioring
from trioring._bench import format_size, parse_sizes


async def main(sizes: list[int], calls: int) -> None:
    async with trioring.open_communicator() as comm:
        n, r = comm.world_size, comm.rank
        for size in sizes:
            x = np.full(max(1, size // 4 // n), r, np.float32)
            expected = np.repeat(np.arange(n, dtype=np.float32)[:, None], x.size, axis=1)
            out = np.empty((n, x.size), np.float32)
            seconds: dict[str, list[float]] = {"new array": [], "out=": []}
            for call in range(calls):
                for way in ("new array", "out=") if call % 2 else ("out=", "new array"):
                    await comm.barrier()
                    start = time.perf_counter()
                    if way == "out=":
                        result = await comm.allgather(x, out=out)
                    else:
                        result = await comm.allgather(x)
                    seconds[way].append(time.perf_counter() - start)
                    if not np.array_equal(result, expected):
                        raise SystemExit(f"rank {r}: wrong allgather result ({way})")
            slowest = {
                way: np.max(await comm.allgather(np.array(times[calls // 6 :])), axis=0)
                for way, times in seconds.items()
            }
            if r == 0:
                medians = ", ".join(
                    f"{way} {statistics.median(times) * 1e6:.0f} us"
                    for way, times in slowest.items()
                )
                print(f"allgather {format_size(x.nbytes * n)}, world {n}: {medians}", flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="64K,1M,4M", help="bytes, as trioring bench's sizes")
    parser.add_argument("--calls", type=int, default=60, help="calls each way per size")
    args = parser.parse_args()
    trio.run(main, parse_sizes(args.sizes), args.calls)
