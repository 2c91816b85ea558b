"""Allgather and allgatherv: their argument checks, the exchange of counts that allgatherv
starts with, and the call into the algorithm that the decision table (or forcing) picked.
The contracts are :meth:`trioring.Communicator.allgather`'s and
:meth:`~trioring.Communicator.allgatherv`'s docstrings.

Frames. An allgather's frames carry the dtype and each rank's element count, so ranks that
pass different dtypes or counts raise :class:`CollectiveMismatchError` on the first frame.
An allgatherv runs in two phases under one sequence number: first an allgather (Bruck) of
one small int64 vector per rank, ``[rows, out= capacity or -1, *trailing shape]``, whose
frames carry the dtype and that vector's length (so a different dtype or number of
dimensions is a mismatch of frame identity); then the data, whose frames carry the dtype and
the total element count, which every rank worked out from the same vectors. Different
trailing shapes, or an ``out=`` on some rank that does not hold the total, are found by
every rank in the same vectors, and every rank raises CollectiveMismatchError.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import _algorithms
from .._onehost import _copies, _pipe
from .._onehost._shm import SHM_MAX_BYTES
from .._wire import DTYPE_CODES
from ._checks import Refused, check_array, check_out
from ._counts import describe, impossible_counts, mismatch
from ._decision import allgather as decide, copy_unrunnable

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Sequence

    from .._algorithms import World
    from .._wire import OpSpec
    from ._checks import Plan

__all__ = ["body", "body_v", "check", "check_v", "plan_allgather", "plan_allgatherv", "unrunnable"]

#: The algorithms that start from this rank's block in place, by the name that the decision
#: table and forcing use; "cma" starts from ``x`` itself (see :func:`_allgather_into`).
_IN_PLACE = {
    "shm": _copies.shm_allgather,
    "pipe": _pipe.pipe_allgather,
    "bruck": _algorithms.bruck_allgather,
    "recursive_doubling": _algorithms.recursive_doubling_allgather,
    "ring": _algorithms.ring_allgather,
}


def unrunnable(collective: str, name: str, world: World, block_nbytes: int) -> str | None:
    """Why the forced algorithm ``name`` cannot run this allgather(v) here (with blocks of
    ``block_nbytes``, for allgather); None if it can."""
    if (why := copy_unrunnable(collective, name, world, block_nbytes)) is not None:
        return why
    if name == "recursive_doubling" and not _algorithms.is_power_of_two(world.size):
        return (
            f"the forced {collective} algorithm 'recursive_doubling' needs a power-of-two "
            f"world size, not {world.size}"
        )
    return None


def plan_allgather(world: World, forced: str | None, x: object, out: object) -> Plan[Any]:
    """Everything allgather needs before any I/O: the checks, the step and the identity;
    or Refused."""
    flat, result, gathered = check(x, out, world.size, world.rank)
    if forced is not None and (why := unrunnable("allgather", forced, world, flat.nbytes)):
        raise Refused(why)
    identity = {"dtype_code": DTYPE_CODES[flat.dtype], "count": flat.shape[0]}
    return result, body(forced, world, flat, gathered), identity


def plan_allgatherv(
    world: World, forced: str | None, x: object, out: object
) -> Plan[list[np.ndarray[Any, Any]]]:
    """Everything allgatherv needs before any I/O, as :func:`plan_allgather`; the list it
    returns is filled once the call is done."""
    flat, rows, trailing, gathered = check_v(x, out, world.size)
    if forced is not None and (why := unrunnable("allgatherv", forced, world, 0)):
        raise Refused(why)
    parts: list[np.ndarray[Any, Any]] = []
    run = body_v(forced, world, flat, rows, trailing, gathered, parts)
    identity = {"dtype_code": DTYPE_CODES[flat.dtype], "count": len(trailing) + 2}
    return parts, run, identity


def _onehost(world: World, block_nbytes: int | None) -> tuple[bool, bool]:
    """(whether the shared segment can take blocks of ``block_nbytes``: never for
    allgatherv's blocks of differing sizes, None; whether cross-memory attach was agreed)."""
    shm = world.shm is not None and block_nbytes is not None and block_nbytes <= SHM_MAX_BYTES
    return shm, world.peer_pids is not None


def check(
    x: object, out: object, world_size: int, rank: int
) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """(``x`` flat, the array to return, its flat view), or Refused. Without ``out`` the
    array to return is new, of shape ``(world_size, *x.shape)``."""
    flat = check_array(x, writable=False)
    assert isinstance(x, np.ndarray)
    if out is None:
        result = np.empty((world_size, *x.shape), dtype=flat.dtype)
        return flat, result, result.reshape(-1)
    gathered = check_out(out, flat.dtype, None)
    expected = world_size * flat.shape[0]
    if gathered.shape[0] != expected:
        raise Refused(
            f"out= holds {gathered.shape[0]} elements; an allgather of {flat.shape[0]} "
            f"elements per rank at world size {world_size} needs {expected}"
        )
    if np.may_share_memory(flat, gathered) and not _is_block(flat, gathered, rank):
        raise Refused(
            "x overlaps out= other than as this rank's block of it (out.reshape(-1)"
            "[rank * x.size:(rank + 1) * x.size]); pass a copy of x"
        )
    assert isinstance(out, np.ndarray)
    return flat, out, gathered


def body(
    name: str | None, world: World, flat: np.ndarray, gathered: np.ndarray
) -> Callable[[OpSpec], Awaitable[None]]:
    """The Communicator's step that gathers every rank's ``flat`` into ``gathered`` (rank
    i's at ``[i * flat.size, (i + 1) * flat.size)``), by the algorithm ``name`` or by the
    decision table's choice when it is None."""
    count = flat.shape[0]
    bounds = [i * count for i in range(world.size + 1)]
    onehost = _onehost(world, flat.nbytes)
    segment = world.shm is not None
    chosen = name or decide(gathered.nbytes, world.size, onehost, segment=segment)

    async def run(spec: OpSpec) -> None:
        await _allgather_into(chosen, world, spec, flat, gathered, bounds)

    return run


async def _allgather_into(
    name: str,
    world: World,
    spec: OpSpec,
    flat: np.ndarray,
    gathered: np.ndarray,
    bounds: Sequence[int],
) -> None:
    """Every rank's block into ``gathered`` by the algorithm ``name``, this rank's from
    ``flat``: by cross-memory attach the peers read ``flat`` itself while this rank places
    it; every other algorithm starts from it in place."""
    if name == "cma":
        await _copies.cma_allgather(world, spec, gathered, bounds, flat)
        return
    _place(flat, gathered, bounds, world.rank)
    await _IN_PLACE[name](world, spec, gathered, bounds)


def check_v(
    x: object, out: object, world_size: int
) -> tuple[np.ndarray[Any, Any], int, tuple[int, ...], np.ndarray[Any, Any] | None]:
    """(``x`` flat, its rows, its trailing shape, ``out`` flat or None), or Refused. In a
    world of one, ``out``'s size is checked here too (elsewhere only the exchanged counts
    tell the total)."""
    flat = check_array(x, writable=False)
    assert isinstance(x, np.ndarray)
    if x.ndim == 0:
        raise Refused("allgatherv needs an array of at least one dimension (its rows vary)")
    rows, trailing = x.shape[0], tuple(x.shape[1:])
    if out is None:
        return flat, rows, trailing, None
    gathered = check_out(out, flat.dtype, None)
    if np.may_share_memory(flat, gathered):
        raise Refused("x overlaps out=; pass a copy of x")
    if world_size == 1 and gathered.shape[0] != flat.shape[0]:
        raise Refused(
            f"out= holds {gathered.shape[0]} elements; in a world of one the allgatherv "
            f"gathers x's {flat.shape[0]}"
        )
    return flat, rows, trailing, gathered


def body_v(
    name: str | None,
    world: World,
    flat: np.ndarray,
    rows: int,
    trailing: tuple[int, ...],
    out: np.ndarray | None,
    parts: list[np.ndarray],
) -> Callable[[OpSpec], Awaitable[None]]:
    """The Communicator's step that exchanges every rank's rows (see the module docstring),
    then gathers every rank's ``flat`` into ``out`` (or a new buffer) in rank order, and
    fills ``parts`` with one view of it per rank, shaped ``(rows_i, *trailing)``. The
    spec's count is the length of that vector, ``len(trailing) + 2``."""
    n, r = world.size, world.rank

    async def run(spec: OpSpec) -> None:
        all_rows = [rows] if n == 1 else await _exchange_rows(spec)
        size = math.prod(trailing)
        bounds = [0]
        for peer_rows in all_rows:
            bounds.append(bounds[-1] + peer_rows * size)
        gathered = np.empty(bounds[n], dtype=flat.dtype) if out is None else out
        segment = world.shm is not None
        onehost = _onehost(world, None)
        chosen = name or decide(gathered.nbytes, n, onehost, segment=segment)
        if n > 1:
            data = spec._replace(count=bounds[n])
            await _allgather_into(chosen, world, data, flat, gathered, bounds)
        else:
            _place(flat, gathered, bounds, r)
        parts[:] = [
            gathered[bounds[i] : bounds[i + 1]].reshape(all_rows[i], *trailing) for i in range(n)
        ]

    async def _exchange_rows(spec: OpSpec) -> list[int]:
        """Every rank's rows, once every rank's vector agreed with this one's."""
        capacity = -1 if out is None else out.shape[0]
        mine = np.array([rows, capacity, *trailing], dtype=np.int64)
        m = mine.shape[0]
        table = np.empty(n * m, dtype=np.int64)
        table[r * m : (r + 1) * m] = mine
        await _algorithms.bruck_allgather(world, spec, table, [i * m for i in range(n + 1)])
        vectors = table.reshape(n, m)
        me = describe(spec, flat.dtype, rows, trailing)
        for peer in range(n):
            peer_rows, peer_trailing = int(vectors[peer, 0]), tuple(vectors[peer, 2:].tolist())
            if peer_rows < 0 or vectors[peer, 1] < -1 or min(peer_trailing, default=0) < 0:
                raise impossible_counts(world, spec, peer, vectors[peer])
            if peer_trailing != trailing:
                raise mismatch(
                    world,
                    spec,
                    peer,
                    f"{me}, rank {peer}: {describe(spec, flat.dtype, peer_rows, peer_trailing)}",
                )
        all_rows = [int(v) for v in vectors[:, 0]]
        total = sum(all_rows) * math.prod(trailing)
        for peer in range(n):
            capacity = int(vectors[peer, 1])
            if capacity not in (-1, total):
                raise mismatch(
                    world,
                    spec,
                    peer,
                    f"{me} (the ranks' arrays hold {total} elements in all), rank {peer}: "
                    f"out= holds {capacity} elements",
                )
        return all_rows

    return run


def _is_block(flat: np.ndarray, gathered: np.ndarray, rank: int) -> bool:
    """Whether ``flat`` is exactly rank ``rank``'s block of ``gathered`` (in place)."""
    count = flat.shape[0]
    block = gathered[rank * count : (rank + 1) * count]
    return bool(flat.ctypes.data == block.ctypes.data)


def _place(flat: np.ndarray, gathered: np.ndarray, bounds: Sequence[int], rank: int) -> None:
    """This rank's own block into ``gathered``, unless it is there already (in place).
    The checks allow ``flat`` to overlap ``gathered`` only as exactly this block, so any
    overlap means in place; ``may_share_memory`` answers in 0.25 us, comparing the
    ``ctypes.data`` addresses took 2.3 (a tenth of a small allgather)."""
    block = gathered[bounds[rank] : bounds[rank + 1]]
    if block.shape[0] and not np.may_share_memory(flat, block):
        block[:] = flat
