"""Running every rank of a local world (``trioring.testing.open_local_world``) at once, and
forcing an algorithm on all of them: the two things every collective's test file does; and
collecting every rank's error where one rank's call differs."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import trio

import trioring

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Iterable

    from trioring import Communicator


async def on_every_rank(
    comms: list[Communicator], fn: Callable[[Communicator], Awaitable[Any]]
) -> None:
    """Run ``fn(comm)`` for every rank concurrently; return once all have."""
    async with trio.open_nursery() as nursery:
        for comm in comms:
            nursery.start_soon(fn, comm)


def force(comms: list[Communicator], collectives: str | Iterable[str], name: str | None) -> None:
    """Force ``name`` (None: the decision table again) for ``collectives`` on every rank."""
    for comm in comms:
        for collective in [collectives] if isinstance(collectives, str) else collectives:
            comm._force_algorithm(collective, name)


async def errors_when_one_differs(
    comms: list[Communicator],
    odd_rank: int,
    odd: Callable[[Communicator], Awaitable[Any]],
    usual: Callable[[Communicator], Awaitable[Any]],
) -> dict[int, BaseException]:
    """Run ``odd`` on rank ``odd_rank`` and ``usual`` on every other rank, all at once (10 s
    at most: a rank that hangs fails the test); each rank's TrioringError, by rank (a rank
    that raised none is missing)."""
    errors: dict[int, BaseException] = {}

    async def one(comm: Communicator) -> None:
        try:
            await (odd if comm.rank == odd_rank else usual)(comm)
        except trioring.TrioringError as exc:
            errors[comm.rank] = exc

    with trio.fail_after(10):
        await on_every_rank(comms, one)
    return errors
