"""Tests of code that uses trioring, with pytest-trio: every rank is a task of one trio.run.
Run them with ``pytest test_with_pytest_trio.py``."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import pytest
import trio

import trioring
from trioring.testing import open_local_world

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable


async def average_gradients(comm: trioring.Communicator, grads: np.ndarray) -> None:
    """The code under test."""
    await comm.allreduce(grads, op="mean")


async def run_ranks(
    comms: list[trioring.Communicator],
    rank_main: Callable[[trioring.Communicator], Awaitable[None]],
) -> None:
    """Run ``rank_main`` once per rank, concurrently, and wait for all of them."""
    async with trio.open_nursery() as nursery:
        for comm in comms:
            nursery.start_soon(rank_main, comm)


@pytest.mark.trio
@pytest.mark.parametrize("world_size", [1, 2, 3, 5])
async def test_average_is_the_same_on_every_rank(world_size: int) -> None:
    results: dict[int, np.ndarray] = {}

    async def rank_main(comm: trioring.Communicator) -> None:
        grads = np.arange(1000, dtype=np.float32) * (comm.rank + 1)
        await average_gradients(comm, grads)
        results[comm.rank] = grads

    # buffered=False: every send waits for its receive, so code that sends before it
    # receives deadlocks here and now. chunk_bytes=64: arrays travel as many small frames.
    async with open_local_world(world_size, buffered=False, chunk_bytes=64) as comms:
        await run_ranks(comms, rank_main)
    expected = np.arange(1000, dtype=np.float32) * (world_size + 1) / 2
    for grads in results.values():
        assert grads.tobytes() == results[0].tobytes()  # bitwise identical
        np.testing.assert_allclose(grads, expected, rtol=1e-6)


@pytest.mark.trio
async def test_one_deadline_unblocks_every_rank(autojump_clock: trio.testing.MockClock) -> None:
    """Rank 2 hangs; rank 0 gives up after 10 s, and rank 1 is told at that very moment.
    The clock is virtual: the test takes milliseconds."""

    async def rank_main(comm: trioring.Communicator) -> None:
        if comm.rank == 2:
            return  # never calls the collective
        x = np.ones(4)
        if comm.rank == 0:
            with pytest.raises(trio.TooSlowError), trio.fail_after(10):
                await comm.allreduce(x)
        else:
            with pytest.raises(trioring.PeerAbortedError) as info:
                await comm.allreduce(x)
            assert (info.value.peer, info.value.reason) == (0, "cancelled")
        assert trio.current_time() == 10
        with pytest.raises(trioring.CommunicatorBrokenError):
            await comm.barrier()

    async with open_local_world(3) as comms:
        await run_ranks(comms, rank_main)


@pytest.mark.trio
async def test_ranks_that_disagree_raise() -> None:
    async def rank_main(comm: trioring.Communicator) -> None:
        with pytest.raises(trioring.CollectiveMismatchError, match="float32"):
            await comm.allreduce(np.ones(8, dtype=np.float32 if comm.rank else np.float64))

    async with open_local_world(2) as comms:
        await run_ranks(comms, rank_main)
