"""trioring demo: collectives on float32 arrays, checked against numpy, then timed.

Run it with the launcher (``make demo`` does exactly this)::

    trioring run -n 4 examples/demo.py

Every rank can recompute every other rank's input (it depends only on the rank), so each
rank checks its own results against a numpy reference. The ranks then agree, with one more
allreduce, on how many checks failed anywhere: rank 0 prints the summary and a timing table,
the other ranks print only their own failures, and every rank exits 1 if any check failed.
"""

from __future__ import annotations

import functools
import statistics
import sys
import time
from typing import TYPE_CHECKING

import numpy as np
import trio

import trioring

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

N_CHECK = 1_000_003  # deliberately not a multiple of the world size
SIZES = {"1 KiB": 1 << 10, "1 MiB": 1 << 20, "16 MiB": 16 << 20}
REPEATS = 7
OPS = ("sum", "mean", "min", "max", "prod")


def make_input(rank: int, n: int = N_CHECK) -> np.ndarray:
    """Rank ``rank``'s input. Small integers, so sums are exact in float32 whatever the
    order of additions; values near 1 for the product so it neither overflows nor vanishes."""
    return (np.arange(n, dtype=np.float32) % 251) + rank


def make_prod_input(rank: int, n: int = N_CHECK) -> np.ndarray:
    return (1 + ((np.arange(n) + rank) % 7) / 64).astype(np.float32)


def reference(op: str, inputs: list[np.ndarray]) -> np.ndarray:
    """What ``allreduce(op=op)`` must produce, computed in float64 and rounded once."""
    stacked = np.stack(inputs).astype(np.float64)
    result: np.ndarray
    if op == "sum":
        result = stacked.sum(axis=0)
    elif op == "mean":
        result = stacked.mean(axis=0)
    elif op == "min":
        result = stacked.min(axis=0)
    elif op == "max":
        result = stacked.max(axis=0)
    else:
        result = stacked.prod(axis=0)
    return result.astype(np.float32)


async def check_correctness(comm: trioring.Communicator) -> tuple[list[str], dict[str, str]]:
    """Run every collective once on known inputs.

    Returns descriptions of what went wrong, and the first few elements of each result.
    """
    failures: list[str] = []
    samples: dict[str, str] = {}

    def expect(name: str, got: np.ndarray, want: np.ndarray) -> None:
        samples[name] = np.array2string(got[:4], precision=4) + " ..."
        if got.dtype != want.dtype or got.shape != want.shape:
            failures.append(f"{name}: got {got.dtype}{got.shape}, want {want.dtype}{want.shape}")
        elif not np.allclose(got, want, rtol=1e-6, atol=0):
            bad = int(np.argmax(~np.isclose(got, want, rtol=1e-6, atol=0)))
            failures.append(f"{name}: element {bad} is {got[bad]!r}, want {want[bad]!r}")

    ranks = range(comm.world_size)
    for op in OPS:
        make = make_prod_input if op == "prod" else make_input
        x = make(comm.rank)
        await comm.allreduce(x, op=op)
        expect(f"allreduce(op={op!r})", x, reference(op, [make(r) for r in ranks]))

    for root in sorted({0, comm.world_size - 1}):
        x = make_input(comm.rank)
        await comm.broadcast(x, root=root)
        expect(f"broadcast(root={root})", x, make_input(root))

    await comm.barrier()
    return failures, samples


async def timed(comm: trioring.Communicator, step: Callable[[], Awaitable[None]]) -> float:
    """Median over REPEATS runs of the slowest rank's time for ``step``, in seconds."""
    await step()  # warm-up: first-use costs (buffers, connections) are not the steady state
    times = np.empty(REPEATS, dtype=np.float64)
    for i in range(REPEATS):
        await comm.barrier()  # start together, so we time the collective, not the stragglers
        start = time.perf_counter()
        await step()
        times[i] = time.perf_counter() - start
    # A collective takes as long as its slowest rank: reduce the timings with max.
    await comm.allreduce(times, op="max")
    return statistics.median(times.tolist())


async def benchmark(comm: trioring.Communicator) -> list[tuple[str, str, float]]:
    rows: list[tuple[str, str, float]] = []
    for label, nbytes in SIZES.items():
        x = np.ones(nbytes // 4, dtype=np.float32)
        allreduce = functools.partial(comm.allreduce, x)
        broadcast = functools.partial(comm.broadcast, x, root=0)
        rows.append((label, "allreduce sum", await timed(comm, allreduce)))
        rows.append((label, "broadcast", await timed(comm, broadcast)))
    rows.append(("-", "barrier", await timed(comm, comm.barrier)))
    return rows


def print_table(rows: list[tuple[str, str, float]]) -> None:
    print(f"{'size':>8}  {'collective':<14}  {'median':>10}  {'bandwidth':>12}")
    for label, name, seconds in rows:
        nbytes = SIZES.get(label)
        # Algorithm bandwidth: array bytes over time, whatever the collective moves internally.
        bandwidth = f"{nbytes / seconds / 2**20:8.1f} MiB/s" if nbytes else ""
        print(f"{label:>8}  {name:<14}  {seconds * 1e3:7.3f} ms  {bandwidth:>12}".rstrip())


async def main() -> int:
    async with trioring.open_communicator() as comm:
        failures, samples = await check_correctness(comm)
        for failure in failures:
            print(f"rank {comm.rank}: FAILED {failure}", file=sys.stderr, flush=True)
        # Every rank learns the total, so every rank exits with the same status.
        total = np.array([len(failures)], dtype=np.float32)
        await comm.allreduce(total)
        failed = int(total[0])

        if comm.rank == 0:
            print(f"trioring demo: {comm.world_size} ranks over {comm.transport}")
            width = max(map(len, samples))
            for name, sample in samples.items():
                print(f"  {name:<{width}}  {sample}")
            if failed:
                print(f"{failed} check(s) failed (details on stderr)")
            else:
                print(
                    f"all {len(samples)} checks passed on every rank "
                    f"({N_CHECK:,} float32 elements per array); barrier completed"
                )
        if failed:
            return 1

        rows = await benchmark(comm)
        if comm.rank == 0:
            print(f"\ntimings: median of {REPEATS} runs, slowest rank of each")
            print_table(rows)
    return 0


if __name__ == "__main__":
    sys.exit(trio.run(main))
