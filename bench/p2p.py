"""Point-to-point ping-pong between ranks 0 and 1 (the other ranks, if any, wait):

    trioring run -n 2 --transport unix bench/p2p.py [ROUNDS]

For each size, rank 0 sends and rank 1 sends back, 20 times per round (5 above 1 MiB); rank 0 prints
the median over ROUNDS (default 15) of half a round trip, the bandwidth that makes, and the
p10-p90 spread, then ``P2P-RESULTS <json>`` (each size's median, in seconds) for
bench/p2p_compare.py, which runs the same ping-pong through Gloo and Open MPI beside it.
Sizes straddle the eager limits (1 MiB; 256 KiB on one host with "cma") and the chunk
(1 MiB). Every echo is checked.
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import numpy as np
import trio
from _harness import P2P_SIZES, p2p_buffers, p2p_inner

import trioring


async def main(rounds: int) -> int:
    async with trioring.open_communicator() as comm:
        r = comm.rank
        rows = []
        for size in P2P_SIZES:
            x, back = p2p_buffers(size)
            inner = p2p_inner(size)
            samples = []
            for _ in range(rounds):
                await comm.barrier()
                start = time.perf_counter()
                for _ in range(inner):
                    if r == 0:
                        await comm.send(x, dest=1)
                        await comm.recv(source=1, out=back)
                    elif r == 1:
                        await comm.recv(source=0, out=back)
                        await comm.send(back, dest=0)
                samples.append((time.perf_counter() - start) / inner / 2)
            if r == 0 and not np.array_equal(back, x):
                print(f"wrong echo at {size} bytes")
                return 1
            if r == 0:
                deciles = statistics.quantiles(samples, n=10)
                median = statistics.median(samples)
                rows.append((size, median, deciles[0], deciles[-1]))
        if r == 0:
            print(f"ping-pong, transport {comm.transport}, {rounds} rounds")
            print(f"{'bytes':>10} {'one way (us)':>14} {'GB/s':>8} {'p10-p90 (us)':>18}")
            for size, median, p10, p90 in rows:
                print(
                    f"{size:>10} {median * 1e6:>14.1f} {size / median / 1e9:>8.3f} "
                    f"{p10 * 1e6:>8.1f}-{p90 * 1e6:<8.1f}"
                )
            print("P2P-RESULTS " + json.dumps({size: median for size, median, _, _ in rows}))
    return 0


if __name__ == "__main__":
    sys.exit(trio.run(main, int(sys.argv[1]) if len(sys.argv) > 1 else 15))
