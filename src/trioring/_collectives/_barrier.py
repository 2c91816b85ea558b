"""Barrier: the limits of each algorithm and the call into the one the decision table (or
forcing) picked. The contract is :meth:`trioring.Communicator.barrier`'s docstring."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .. import _algorithms
from .._onehost import _shm_collectives

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from .._algorithms import World
    from .._wire import OpSpec

__all__ = ["body", "unrunnable"]


def unrunnable(name: str, world: World) -> str | None:
    """Why the forced algorithm ``name`` cannot run a barrier here; None if it can."""
    if name == "shm" and world.shm is None:
        return "the forced barrier algorithm 'shm' needs the \"shm\" feature"
    return None


def body(name: str, world: World) -> Callable[[OpSpec], Awaitable[None]]:
    """The Communicator's step that waits for every rank by the algorithm ``name``."""
    algorithm = _shm_collectives.shm_barrier if name == "shm" else _algorithms.barrier

    async def run(spec: OpSpec) -> None:
        await algorithm(world, spec)

    return run
