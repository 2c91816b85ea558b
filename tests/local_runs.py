"""Running every rank of a local world (``trioring.testing.open_local_world``) at once, and
forcing an algorithm on all of them: the two things every collective's test file does."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import trio

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
