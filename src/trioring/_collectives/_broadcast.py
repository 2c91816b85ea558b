"""Broadcast: the limits of each algorithm and the call into the one the decision table (or
forcing) picked. The contract is :meth:`trioring.Communicator.broadcast`'s docstring."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .. import _algorithms
from .._onehost import _cma_collectives, _pipe, _push, _shm, _shm_collectives
from . import _decision
from ._checks import agree

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    import numpy as np

    from .._algorithms import World
    from .._wire import OpSpec

__all__ = ["body", "decide", "shm_limit", "unrunnable"]


def decide(world: World, nbytes: int) -> str:
    """The decision table's algorithm for a broadcast of ``nbytes`` here: its root pushes
    (by cma) where it may and the pipe's limit for pushed broadcasts is below ``nbytes``."""
    limit = _decision.PIPE_MAX_PUSHED_BROADCAST_BYTES
    pushed = nbytes > limit and _push.push_bytes(world, nbytes) > 0
    threads = pushed or (
        nbytes >= _cma_collectives.READ_THREADS_MIN_BYTES
        and _cma_collectives.read_threads(world, nbytes, world.size - 1) > 1
    )
    return _decision.broadcast(
        nbytes, shm_limit(world), world.peer_pids is not None, threads=threads
    )


def shm_limit(world: World) -> int:
    """The largest broadcast the decision table sends through the segment's slots here (-1:
    no segment): the whole slot where the slots take it in pieces (no rank crowded, a CPU
    that takes pieces: see _onehost._shm_collectives.slot_pieces), else SHM_MAX_BYTES.
    Whole, above SHM_MAX_BYTES the pipe was faster (_onehost._shm.SLOT_PAYLOAD_BYTES)."""
    slots = world.shm
    if slots is None:
        return -1
    if slots.crowded or not _shm_collectives.slot_pieces():
        return _shm.SHM_MAX_BYTES
    return _shm.SLOT_PAYLOAD_BYTES


def unrunnable(name: str, world: World, nbytes: int) -> str | None:
    """Why the forced algorithm ``name`` cannot broadcast ``nbytes`` here; None if it can."""
    if name == "shm":
        if world.shm is None:
            return "the forced broadcast algorithm 'shm' needs the \"shm\" feature"
        if nbytes > _shm.SLOT_PAYLOAD_BYTES:
            return (
                "the forced broadcast algorithm 'shm' takes arrays of at most "
                f"{_shm.SLOT_PAYLOAD_BYTES} bytes, not {nbytes}"
            )
    elif name == "pipe" and world.shm is None:
        return "the forced broadcast algorithm 'pipe' needs the \"shm\" feature"
    elif name == "cma" and world.peer_pids is None:
        return "the forced broadcast algorithm 'cma' needs the \"cma\" feature"
    return None


def body(
    name: str, world: World, flat: np.ndarray, root: int
) -> Callable[[OpSpec], Awaitable[None]]:
    """The Communicator's step that broadcasts root's ``flat`` by the algorithm ``name``."""
    if name == "shm":

        async def shm(spec: OpSpec) -> None:
            # Every rank publishes the call's identity there, so this agrees too.
            await _shm_collectives.shm_broadcast(world, spec, flat, root)

        return shm

    if name == "pipe":

        async def pipe(spec: OpSpec) -> None:
            # As for "shm": the publication agrees.
            await _pipe.pipe_broadcast(world, spec, flat, root)

        return pipe

    async def agree_then_copy(spec: OpSpec) -> None:
        await agree(world, spec, name)
        if name == "cma":
            await _cma_collectives.cma_broadcast(world, spec, flat, root)
        elif flat.nbytes <= world.chunk_bytes:
            # The same frames as the streamed tree (one chunk), without its tasks.
            await _algorithms.small_broadcast(world, spec, flat, root)
        else:
            await _algorithms.broadcast(world, spec, flat, root)

    return agree_then_copy
