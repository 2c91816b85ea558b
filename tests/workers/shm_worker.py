"""One rank of tests/test_shm.py: the shared-memory path for small collectives.

``python shm_worker.py SCENARIO OUT_DIR INDEX [ARGS...]`` (see _worker_util). Scenarios:

- ``exact``: allreduces, and with the segment reduces (from every root) and
  reduce_scatters, of every supported op over seeded inputs of 0 to 1024 elements (per
  block) and five dtypes, each checked bitwise against recursive doubling's order of
  operations computed here with numpy; broadcasts from every root; barriers. Records the
  features in use.
- ``late``: rank 1 enters each call only after ``WAIT`` seconds, so the others' waits park
  (past the polling phase); results are checked.
- ``busy``: rank 1 enters a barrier only once rank 0's other task has run 100 times while
  rank 0 waits in it (a wait on the segment that held the thread would hang this).
- ``mismatch``: rank 1 calls ARG (``barrier`` or ``large``: an allreduce too large for the
  segment) where the others allreduce 4 bytes; every rank records its error.
- ``gave_up_later``: rank 0 publishes a barrier and then holds its thread (it cannot look at
  the segment) while rank 1 finishes that barrier and gives up in the next call (cancelled):
  rank 0's barrier must still complete, and its allreduce raise.
- ``closed``: rank 0 waits in a barrier (rank 1 never comes) while another task closes the
  communicator.
- ``woken``: with the parked waits' timer set beyond the test's deadline, rank 1 enters each
  call (a barrier, a 4-byte allreduce, broadcasts through the pipe from rank 1 and from
  rank 0) only once every other rank's wait has parked: only stores into the segment,
  through the eventfds, can end those waits. Results are checked.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import _worker_util
import numpy as np
import trio
import trio.testing

if TYPE_CHECKING:
    from _worker_util import Reporter

    import trioring

HANG_S = 20.0
WAIT_S = 0.03
DTYPES = ("float32", "float64", "float16", "int32", "complex64")
COUNTS = (0, 1, 3, 17, 1024)
UFUNCS = {"sum": np.add, "mean": np.add, "min": np.minimum, "max": np.maximum, "prod": np.multiply}


def inputs(seed: int, rank: int, count: int, dtype: np.dtype[Any]) -> np.ndarray[Any, Any]:
    rng = np.random.default_rng([seed, rank])
    if dtype.kind == "i":
        return rng.integers(-1000, 1000, count).astype(dtype)
    values = rng.standard_normal(count) * 10
    if dtype.kind == "c":
        values = values + 1j * rng.standard_normal(count)
    return values.astype(dtype)


def doubling_order(arrays: list[np.ndarray[Any, Any]], op: str) -> np.ndarray[Any, Any]:
    """What recursive doubling computes: leaf r = op(a_r, a_{r+p}) for the folded ranks,
    then neighbours pair up, lower first, level by level; a mean divides at the end."""
    ufunc, n = UFUNCS[op], len(arrays)
    p = 1 << (n.bit_length() - 1)
    with np.errstate(all="ignore"):
        level = [ufunc(arrays[r], arrays[r + p]) if r < n - p else arrays[r] for r in range(p)]
        while len(level) > 1:
            level = [ufunc(level[i], level[i + 1]) for i in range(0, len(level), 2)]
        result = level[0].copy()
        if op == "mean":
            np.divide(result, n, out=result)
    return result


async def scenario_exact(reporter: Reporter, comm: trioring.Communicator, args: list[str]) -> None:
    n, rank = comm.world_size, comm.rank
    errors: list[str] = []
    calls = 0
    with trio.fail_after(HANG_S):
        for seed, (dtype_name, count) in enumerate((d, c) for d in DTYPES for c in COUNTS):
            dtype = np.dtype(dtype_name)
            for op in UFUNCS:
                if (op == "mean" and dtype.kind == "i") or (
                    op in ("min", "max") and dtype.kind == "c"
                ):
                    continue
                mine = [inputs(seed, q, count, dtype) for q in range(n)]
                array = mine[rank].copy()
                await comm.allreduce(array, op=op)
                calls += 1
                expected = doubling_order(mine, op)
                if array.tobytes() != expected.tobytes():
                    errors.append(f"allreduce {op} {dtype}[{count}]: {array[:4]} != {expected[:4]}")
                array[...] = 0  # overwritten at once: a peer still reading it would see it
                if "shm" not in comm.features:
                    continue  # the sockets' reduce and reduce_scatter add in other orders
                for root in range(n):
                    # The root reads its own array where it lies (real dtypes: in place at
                    # the top of the tree where its leaf meets it): still the same bits.
                    array = mine[rank].copy()
                    await comm.reduce(array, root=root, op=op)
                    calls += 1
                    want = expected if rank == root else mine[rank]
                    if array.tobytes() != want.tobytes():
                        errors.append(f"reduce {op} root {root} {dtype}[{count}] on rank {rank}")
                    array[...] = 0
                # Each rank's own block is read from its input, the peers' from their slots.
                whole = [inputs(seed + 1000, q, n * count, dtype) for q in range(n)]
                block = await comm.reduce_scatter(whole[rank], op=op)
                calls += 1
                want = doubling_order(whole, op)[rank * count : (rank + 1) * count]
                if block.tobytes() != want.tobytes():
                    errors.append(f"reduce_scatter {op} {dtype}[{n}x{count}] on rank {rank}")
                whole[rank][...] = 0
            for root in range(n):
                array = inputs(seed, rank, count, dtype)
                await comm.broadcast(array, root=root)
                calls += 1
                if array.tobytes() != inputs(seed, root, count, dtype).tobytes():
                    errors.append(f"broadcast root {root} {dtype}[{count}]")
                array[...] = 0
            await comm.barrier()
            calls += 1
    reporter.report.update(errors=errors, calls=calls, features=sorted(comm.features))


async def scenario_late(reporter: Reporter, comm: trioring.Communicator, args: list[str]) -> None:
    n, rank = comm.world_size, comm.rank
    errors = []
    with trio.fail_after(HANG_S):
        for i in range(3):
            if rank == 1:
                await trio.sleep(WAIT_S)  # lateness, not synchronisation: any delay works
            await comm.barrier()
            if rank == 1:
                await trio.sleep(WAIT_S)
            array = np.full(5, rank + i, dtype=np.int64)
            await comm.allreduce(array)
            if not (array == sum(q + i for q in range(n))).all():
                errors.append(f"allreduce {i}: {array}")
    reporter.report.update(errors=errors, features=sorted(comm.features))


async def scenario_busy(reporter: Reporter, comm: trioring.Communicator, args: list[str]) -> None:
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while ticks < 100:
            ticks += 1
            await trio.lowlevel.checkpoint()
        reporter.mark("ticked")

    with trio.fail_after(HANG_S):
        if comm.rank == 0:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(ticker)
                await comm.barrier()
        else:
            await reporter.wait_for("w0.ticked")
            await comm.barrier()
    reporter.report.update(ticks=ticks, features=sorted(comm.features))


async def scenario_mismatch(
    reporter: Reporter, comm: trioring.Communicator, args: list[str]
) -> None:
    what = args[0]

    async def call() -> None:
        if comm.rank != 1:
            await comm.allreduce(np.ones(1, np.float32))
        elif what == "barrier":
            await comm.barrier()
        else:
            await comm.allreduce(np.ones(1 << 18, np.float32))

    await reporter.step("agreed", comm.barrier, hang_after=HANG_S)
    await reporter.step("mismatched", call, hang_after=HANG_S)
    reporter.report.update(features=sorted(comm.features))


async def scenario_gave_up_later(
    reporter: Reporter, comm: trioring.Communicator, args: list[str]
) -> None:
    if comm.rank == 1:

        async def later_barrier() -> None:
            await reporter.wait_for("w0.holding")
            await comm.barrier()

        async def cancelled() -> None:
            # Rank 0 holds its thread until this rank has given up: the allreduce cannot
            # finish, and its deadline is what gives up.
            with trio.move_on_after(WAIT_S):
                await comm.allreduce(np.ones(1, np.float32))

        await reporter.step("barrier", later_barrier, hang_after=HANG_S)
        await reporter.step("next", cancelled, hang_after=HANG_S)
        reporter.report.update(broken=comm.broken)
        reporter.mark("gave_up")
        return

    async def hold_once_parked() -> None:
        # Once the barrier waits parked, it has published and not seen rank 1 (which has not
        # come yet): hold the thread, as a descheduled process would, until rank 1 is gone.
        await trio.testing.wait_all_tasks_blocked()
        reporter.mark("holding")
        given_up = reporter.out_dir / "w1.gave_up"
        deadline = time.monotonic() + HANG_S
        while not given_up.exists() and time.monotonic() < deadline:
            time.sleep(_worker_util.POLL_S)  # noqa: ASYNC251 - holding the thread is the point

    async def barrier_while_held() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(hold_once_parked)
            await comm.barrier()

    async def next_call() -> None:
        await comm.allreduce(np.ones(1, np.float32))

    await reporter.step("barrier", barrier_while_held, hang_after=HANG_S)
    await reporter.step("next", next_call, hang_after=HANG_S)


async def scenario_woken(reporter: Reporter, comm: trioring.Communicator, args: list[str]) -> None:
    from trioring._onehost import _shm, _shm_collectives

    _shm_collectives._SHM_PARK_SECONDS = 10 * HANG_S  # only a wake-up ends a parked wait
    slots = comm._world.shm
    assert slots is not None
    others = [word for q, word in enumerate(slots.parked_words) if q != 1]
    big = np.zeros((_shm.PIPE_CHUNKS + 1) * _shm.PIPE_CHUNK_BYTES // 4 + 5, np.float32)
    errors = []

    async def late() -> None:
        # Lateness by looking, not by sleeping: every other rank's wait has parked.
        # (The state is another process's, in shared memory: no Event can say so.)
        while comm.rank == 1:
            if all(slots.seqs[word] for word in others):
                break
            await trio.sleep(_worker_util.POLL_S)

    with trio.fail_after(HANG_S):
        for i in range(2):
            await late()
            await comm.barrier()
            await late()
            array = np.full(1, comm.rank + i, dtype=np.int64)
            await comm.allreduce(array)
            if array[0] != sum(q + i for q in range(comm.world_size)):
                errors.append(f"allreduce {i}: {array}")
            # From rank 1, the others wait for its publication. From rank 0, through more
            # chunks than the ring holds: rank 0 waits for rank 1's reads of the first
            # (consumed words), rank 2 for rank 0's fifth (produced words).
            for root in (1, 0):
                big[...] = comm.rank + i if comm.rank == root else -1
                await late()
                await comm.broadcast(big, root=root)
                if not (big == root + i).all():
                    errors.append(f"broadcast from {root}, {i}: {np.unique(big)}")
    reporter.report.update(errors=errors, features=sorted(comm.features))


async def scenario_closed(reporter: Reporter, comm: trioring.Communicator, args: list[str]) -> None:
    if comm.rank != 0:
        with trio.fail_after(HANG_S):
            await reporter.wait_for("w0.done")
        return

    async def wait_in_barrier() -> None:
        await comm.barrier()

    async def close_soon() -> None:
        for _ in range(10):
            await trio.lowlevel.checkpoint()
        await comm.aclose()

    async def both() -> None:
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(close_soon)
                await wait_in_barrier()
        except BaseExceptionGroup as group:
            # The one error of the barrier, as the report records errors.
            if len(group.exceptions) == 1:
                raise group.exceptions[0] from None
            raise

    await reporter.step("barrier", both, hang_after=HANG_S)
    reporter.mark("done")


if __name__ == "__main__":
    _worker_util.main(
        {
            "exact": scenario_exact,
            "late": scenario_late,
            "busy": scenario_busy,
            "mismatch": scenario_mismatch,
            "gave_up_later": scenario_gave_up_later,
            "closed": scenario_closed,
            "woken": scenario_woken,
        }
    )
