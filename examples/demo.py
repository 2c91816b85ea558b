"""trioring demo: every collective, a sendrecv ring, a split and two concurrent collectives
on a dup, on float32 arrays, checked against numpy; then the collectives timed.

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

    n, r = comm.world_size, comm.rank
    inputs = [make_input(q) for q in ranks]
    x = inputs[r]
    expect("allgather", (await comm.allgather(x)).reshape(-1), np.concatenate(inputs))
    # Uneven sizes: rank q contributes q * 1000 + 1 elements, found by trioring.
    parts = await comm.allgatherv(x[: r * 1000 + 1])
    expect(
        "allgatherv",
        np.concatenate(parts),
        np.concatenate([inputs[q][: q * 1000 + 1] for q in ranks]),
    )
    block = N_CHECK // n
    expect(
        "reduce_scatter(op='sum')",
        await comm.reduce_scatter(x[: n * block]),
        reference("sum", [v[: n * block] for v in inputs])[r * block : (r + 1) * block],
    )
    y = x.copy()
    await comm.reduce(y, root=n - 1, op="max")
    expect("reduce(op='max', root=last)", y, reference("max", inputs) if r == n - 1 else x)
    gathered = await comm.gather(x[:1000], root=0)
    if r == 0:
        expect("gather(root=0)", gathered.reshape(-1), np.concatenate([v[:1000] for v in inputs]))
    blocks = np.stack([v[:1000] for v in inputs]) if r == 0 else None
    expect("scatter(root=0)", await comm.scatter(blocks, root=0), inputs[r][:1000])
    # Rank q sends block j (its input's j-th 1000 elements plus 1000 q) to rank j.
    sent = x[: n * 1000].reshape(n, 1000) + 1000 * r
    want = np.stack([inputs[q][r * 1000 : (r + 1) * 1000] + 1000 * q for q in ranks])
    expect("alltoall", (await comm.alltoall(sent)).reshape(-1), want.reshape(-1))
    s = x.copy()
    await comm.scan(s)
    expect("scan(op='sum')", s, reference("sum", inputs[: r + 1]))
    e = x.copy()
    await comm.exscan(e)
    # Rank 0 gets the op's identity: zeros for a sum.
    expect("exscan(op='sum')", e, reference("sum", inputs[:r]) if r else np.zeros_like(x))

    # Point-to-point: every rank sends right and receives from the left, both at once.
    right, left = (r + 1) % n, (r - 1) % n
    expect("sendrecv(ring)", await comm.sendrecv(x, dest=right, source=left), inputs[left])
    # A sub-communicator per parity; then a dup whose allgather runs while the world
    # communicator runs an allreduce, from two tasks.
    async with comm.split(color=r % 2) as half:
        assert half is not None
        h = x.copy()
        await half.allreduce(h)
        expect("split(color=r % 2).allreduce", h, reference("sum", inputs[r % 2 :: 2]))
    async with comm.dup() as side:
        w = x.copy()
        got: list[np.ndarray] = []

        async def side_allgather() -> None:
            got.append(await side.allgather(x[:10]))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(comm.allreduce, w)
            nursery.start_soon(side_allgather)
        expect("dup: allreduce || allgather", w, reference("sum", inputs))
        expect(
            "dup: allgather || allreduce",
            got[0].reshape(-1),
            np.concatenate([v[:10] for v in inputs]),
        )

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
        allgather = functools.partial(comm.allgather, x[: len(x) // comm.world_size])
        reduce_scatter = functools.partial(
            comm.reduce_scatter, x[: len(x) // comm.world_size * comm.world_size]
        )
        alltoall = functools.partial(
            comm.alltoall, x[: len(x) // comm.world_size * comm.world_size]
        )
        rows.append((label, "allreduce sum", await timed(comm, allreduce)))
        rows.append((label, "broadcast", await timed(comm, broadcast)))
        rows.append((label, "allgather", await timed(comm, allgather)))
        rows.append((label, "reduce_scatter", await timed(comm, reduce_scatter)))
        rows.append((label, "alltoall", await timed(comm, alltoall)))
    rows.append(("-", "barrier", await timed(comm, comm.barrier)))
    return rows


def print_table(rows: list[tuple[str, str, float]]) -> None:
    # The size is each rank's array: allgather gathers world_size blocks of size / world_size
    # (as in nccl-tests), reduce_scatter and alltoall split it into world_size blocks.
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
