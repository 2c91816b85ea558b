"""Where one small allreduce's time goes on the shared segment: run under the launcher,

    .venv/bin/trioring run -n 2 --tag-output bench/percall.py [--size 1] [--calls 20000]

Part 1, a ladder of depths, back-to-back calls, median of 5 rounds, per rank (µs per call):
``public`` is ``comm.allreduce``; ``run`` the communicator's call machinery around the
algorithm (sequence number, identity, the busy and broken rules); ``algo`` the
shared-segment algorithm alone, plus the schedule point the call owes when it did not wait;
``bare`` a Trio checkpoint loop, the floor under all three.

Part 2, timers at the phase boundaries of the algorithm (the same steps as
``shm_allreduce``, written out), summed over the calls, per rank; and the schedule point
alone, where a call takes it after the reduction (its peer had published first, so it had
no wait to take it in): the median over those calls, and how many they were. A call's
Python leaves the caches, and what predicts the interpreter's branches, holding its own
code and data, and the scheduler's pass then costs more than in a loop of nothing else
(``bare``): on the Intel machine of 2026-12-07, 4.6-5.0 us here against 3.8-4.0 (two
launches; taken in 54-65 % of the calls on each rank), and 7.7-7.8 us inside the public
call, whose path runs more Python (timers in ``CommunicatorCore._run``, a scratch copy of
the source); 9-10 us at the end of a 4-byte scatter's root. ``bench/paired.py``'s "floor +
Trio" takes its point after far less Python, and so pays less for it.

It reaches into trioring's internals (``comm._world``, ``comm._seq``) to time the layers
apart; every call still goes through the segment's real protocol, so the ranks stay in step.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import trio

import trioring
from trioring._collectives import _allreduce
from trioring._onehost import _shm_collectives as shm, _shm_reductions
from trioring._wire import DTYPE_CODES, NO_ROOT, Kind, OpSpec


async def main(size: int, calls: int) -> None:
    async with trioring.open_communicator() as comm:
        world = comm._world
        if world.shm is None:
            raise SystemExit("percall.py needs the shared segment (the 'shm' feature)")
        # Zeros stay zeros under any number of sums, so every result can be checked.
        x = np.zeros(size, np.float32)
        code = DTYPE_CODES[x.dtype]

        async def public() -> None:
            for _ in range(calls):
                await comm.allreduce(x)

        async def run() -> None:
            for _ in range(calls):
                body = _allreduce.body("shm", world, x, np.add, False)
                await comm._run(Kind.ALLREDUCE, body, (code, size, 1, NO_ROOT, None))

        async def algo() -> None:
            for _ in range(calls):
                comm._seq += 1
                waits = comm._waits.count
                spec = OpSpec(Kind.ALLREDUCE, comm._seq, code, size, 1)
                await _shm_reductions.shm_allreduce(world, spec, x, np.add, divide=False)
                if comm._waits.count == waits:
                    await trio.lowlevel.cancel_shielded_checkpoint()

        async def bare() -> None:
            for _ in range(calls):
                await trio.lowlevel.cancel_shielded_checkpoint()

        ladder: dict[str, list[float]] = {"public": [], "run": [], "algo": [], "bare": []}
        steps = {"public": public, "run": run, "algo": algo, "bare": bare}
        for _ in range(5):
            for name, step in steps.items():
                await comm.barrier()
                start = time.perf_counter()
                await step()
                ladder[name].append((time.perf_counter() - start) / calls * 1e6)
        print(
            f"rank {comm.rank}: ladder (us per call, {size} float32): "
            + "  ".join(f"{name} {statistics.median(v):.1f}" for name, v in ladder.items()),
            flush=True,
        )

        names = ("identity", "slot+claim", "write", "publish", "wait", "reduce", "checkpoint")
        sums = [0] * len(names)
        points: list[int] = []
        clock = time.perf_counter_ns
        await comm.barrier()
        for _ in range(calls):
            comm._seq += 1
            waits = comm._waits.count
            t0 = clock()
            spec = OpSpec(Kind.ALLREDUCE, comm._seq, code, size, 1)
            t1 = clock()
            parity = spec.seq & 1
            rows = world.shm.rows(parity, x.dtype, size)
            await shm.shm_claim(world, spec)
            t2 = clock()
            rows[world.rank] = x
            t3 = clock()
            shm.shm_publish(world, spec, x.nbytes)
            t4 = clock()
            await shm.shm_wait(world, spec)
            t5 = clock()
            _shm_reductions._reduce_rows(
                world, (parity, x.dtype, 0, size, -1), rows, x, np.add, False
            )
            shm.shm_done(world, spec)
            t6 = clock()
            if comm._waits.count == waits:
                await trio.lowlevel.cancel_shielded_checkpoint()
                points.append(clock() - t6)
            t7 = clock()
            for i, (a, b) in enumerate(
                ((t0, t1), (t1, t2), (t2, t3), (t3, t4), (t4, t5), (t5, t6), (t6, t7))
            ):
                sums[i] += b - a
        if np.any(x != 0):
            raise SystemExit(f"rank {comm.rank}: wrong allreduce result: {x[:4]}")
        print(
            f"rank {comm.rank}: phases (us per call): "
            + " ".join(
                f"{name} {total / calls / 1000:.2f}"
                for name, total in zip(names, sums, strict=True)
            )
            + f"; the schedule point where taken after the reduction "
            f"{statistics.median(points) / 1000 if points else 0.0:.2f} "
            f"({len(points)} of {calls} calls)",
            flush=True,
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=int, default=1, help="float32 elements (default 1)")
    parser.add_argument("--calls", type=int, default=20_000)
    args = parser.parse_args()
    trio.run(main, args.size, args.calls)
