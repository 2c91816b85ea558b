"""What sub-communicators cost, and the measurement behind giving each its own connections
(src/trioring/_family.py) instead of multiplexing them on the world's:

    trioring run -n 4 --transport unix bench/split.py [ROUNDS]

Rank 0 prints medians over ROUNDS (default 15) of, for each, the slowest rank's time:

- ``dup()`` and leaving it (connections made, one-host agreement, closed);
- an 8-byte and a 16 MiB allreduce on the world and on a dup (the same code and
  connections of the same kind: they should be equal);
- a 16 MiB memcpy: what a multiplexed design would add per 16 MiB received whenever a frame
  of another communicator must be read past (copied out of the way) while this one waits;
- an 8-byte allgather on a dup alone, and while a 64 MiB allreduce runs on the world from
  another task: with connections of its own it does not wait for the big one;
- file descriptors of this process with the world open, and with one dup open.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import numpy as np
import trio

import trioring


def fds() -> int:
    return len(os.listdir("/proc/self/fd"))


async def timed(comm: trioring.Communicator, fn: object, rounds: int) -> float:
    """Median over rounds of the slowest rank's time of ``await fn()``."""
    samples = []
    for _ in range(rounds):
        await comm.barrier()
        start = time.perf_counter()
        await fn()  # type: ignore[operator]
        elapsed = np.array([time.perf_counter() - start])
        await comm.allreduce(elapsed, op="max")
        samples.append(float(elapsed[0]))
    return statistics.median(samples)


async def main(rounds: int) -> int:
    async with trioring.open_communicator() as comm:
        rows: list[tuple[str, float]] = []
        world_fds = fds()

        async def dup_and_close() -> None:
            async with comm.dup():
                pass

        rows.append(("dup() and close", await timed(comm, dup_and_close, rounds)))
        async with comm.dup() as side:
            dup_fds = fds()
            for nbytes in (8, 16 * 1024 * 1024):
                x = np.ones(nbytes // 4, np.float32)
                for name, c in (("world", comm), ("dup", side)):
                    rows.append(
                        (
                            f"allreduce {nbytes} B on {name}",
                            await timed(comm, lambda c=c, x=x: c.allreduce(x), rounds),
                        )
                    )
            src = np.ones(16 * 1024 * 1024, np.uint8)
            dst = np.empty_like(src)

            async def copy() -> None:
                np.copyto(dst, src)
                await trio.lowlevel.checkpoint()

            rows.append(("memcpy 16 MiB (one rank)", await timed(comm, copy, rounds)))
            small = np.array([comm.rank], np.int64)
            rows.append(
                (
                    "allgather 8 B on dup, alone",
                    await timed(comm, lambda: side.allgather(small), rounds),
                )
            )
            big = np.ones(16 * 1024 * 1024, np.float32)
            rows.append(
                (
                    "allreduce 64 MiB on world, alone",
                    await timed(comm, lambda: comm.allreduce(big), rounds),
                )
            )
            during: list[float] = []
            for _ in range(rounds):
                await comm.barrier()
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(comm.allreduce, big)
                    await trio.lowlevel.checkpoint()
                    start = time.perf_counter()
                    await side.allgather(small)
                    during.append(time.perf_counter() - start)
            worst = np.array([statistics.median(during)])
            await side.allreduce(worst, op="max")
            rows.append(("allgather 8 B on dup, during 64 MiB allreduce on world", float(worst[0])))
        if comm.rank == 0:
            print(
                f"world {comm.world_size}, transport {comm.transport}, features {sorted(comm.features)}"
            )
            for name, seconds in rows:
                print(f"{name:58s} {seconds * 1e6:12.1f} us")
            print(f"file descriptors: {world_fds} with the world open, {dup_fds} with one dup")
    return 0


if __name__ == "__main__":
    sys.exit(trio.run(main, int(sys.argv[1]) if len(sys.argv) > 1 else 15))
