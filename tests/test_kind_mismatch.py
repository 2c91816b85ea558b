"""Two ranks that call different collectives (rank 0 an allgather, rank 1 an alltoall, ...):
for every ordered pair of the Communicator's collectives, with every root placement that
matters, every rank raises instead of waiting for the other, and at world 2 both raise
CollectiveMismatchError naming both calls. A pair of collectives whose first moves are
both receives (a gather's root against a scatter's non-root) is where a hang would hide:
these collectives start by agreeing on the call's identity for that reason."""

from __future__ import annotations

import itertools
import re
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest
import trio

import trioring
from local_runs import on_every_rank
from trioring.testing import open_local_world

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from trioring import Communicator

X = np.arange(6, dtype=np.float32)


def _calls(root: int) -> dict[str, Callable[[Communicator], Awaitable[Any]]]:
    """One call of each collective, valid on its own on every rank of a world of 2 or 3,
    with ``root`` as the root of the rooted ones."""

    def rows(c: Communicator) -> np.ndarray[Any, Any]:
        return np.zeros((c.world_size, 3), np.float32)

    return {
        "allreduce": lambda c: c.allreduce(X.copy()),
        "broadcast": lambda c: c.broadcast(X.copy(), root=root),
        "barrier": lambda c: c.barrier(),
        "reduce": lambda c: c.reduce(X.copy(), root=root),
        "allgather": lambda c: c.allgather(X),
        "allgatherv": lambda c: c.allgatherv(X),
        "reduce_scatter": lambda c: c.reduce_scatter(rows(c)),
        "reduce_scatterv": lambda c: c.reduce_scatterv(
            X, counts=[6 - 2 * (c.world_size - 1)] + [2] * (c.world_size - 1)
        ),
        "gather": lambda c: c.gather(X, root=root),
        "gatherv": lambda c: c.gatherv(X, root=root),
        "scatter": lambda c: c.scatter(rows(c) if c.rank == root else None, root=root),
        "scatterv": lambda c: c.scatterv(list(rows(c)) if c.rank == root else None, root=root),
        "alltoall": lambda c: c.alltoall(rows(c)),
        "alltoallv": lambda c: c.alltoallv(list(rows(c))),
        "scan": lambda c: c.scan(X.copy()),
        "exscan": lambda c: c.exscan(X.copy()),
    }


NAMES = list(_calls(0))
PAIRS = [(a, b) for a, b in itertools.permutations(NAMES, 2)]


async def _run_pair(n: int, root: int, first: str, second: str) -> dict[int, BaseException]:
    """Rank 1 calls ``second``, every other rank ``first``; what each rank raised."""
    calls = _calls(root)
    errors: dict[int, BaseException] = {}
    async with open_local_world(n) as comms:

        async def one(comm: Communicator) -> None:
            try:
                await calls[second if comm.rank == 1 else first](comm)
            except trioring.CollectiveError as exc:
                errors[comm.rank] = exc

        with trio.fail_after(10):
            await on_every_rank(comms, one)
    return errors


@pytest.mark.parametrize("root", [0, 1])
@pytest.mark.parametrize(("first", "second"), PAIRS)
async def test_different_collectives_raise_on_both_ranks(
    first: str, second: str, root: int
) -> None:
    errors = await _run_pair(2, root, first, second)
    assert sorted(errors) == [0, 1], (first, second, errors)
    for rank, exc in errors.items():
        assert isinstance(exc, trioring.CollectiveMismatchError), (rank, exc)
        message = str(exc)
        for name in (first, second):
            # "reduce(sum, root=0) float32[6] #1", "allgather float32[6] #1"
            assert re.search(rf"\b{name}[ (]", message), (name, message)
        # Each side's call, by rank, as the message names it (for trioring run's summary);
        # empty where the error came relayed in an abort frame (see _wire.abort_error).
        assert isinstance(exc, trioring.CollectiveMismatchError)
        if exc.calls:
            assert sorted(exc.calls) == [0, 1], exc.calls
            assert re.match(rf"{first if rank == 0 else second}\b", exc.calls[rank]), exc.calls
            assert all(f"rank {r}: {call}" in message for r, call in exc.calls.items()), message


@pytest.mark.parametrize(("first", "second"), PAIRS[:: len(NAMES) - 2])
async def test_one_odd_rank_of_three_makes_every_rank_raise(first: str, second: str) -> None:
    errors = await _run_pair(3, 2, first, second)
    assert sorted(errors) == [0, 1, 2], (first, second, errors)
    assert any(isinstance(e, trioring.CollectiveMismatchError) for e in errors.values())
