"""Allgather and allgatherv: their argument checks, the exchange of counts that allgatherv
starts with, and the call into the algorithm that the decision table (or forcing) picked.
The contracts are :meth:`trioring.Communicator.allgather`'s and
:meth:`~trioring.Communicator.allgatherv`'s docstrings.

Frames. An allgather's frames carry the dtype and each rank's element count, so ranks that
pass different dtypes or counts raise :class:`CollectiveMismatchError` on the first frame.
An allgatherv runs in two phases under one sequence number. First every rank's small int64
vector, ``[rows, out= capacity or -1, *trailing shape]``, under an identity of the dtype and
that vector's length (so a different dtype or number of dimensions is a mismatch of
identity): with a shared segment each rank publishes it in its slot, with its ``x`` after it
where that fits (else ``x``'s address, for cross-memory attach), and when every rank's fits
that publication is the whole call; without, an allgather of the vectors by Bruck. Then the
data, whose frames (or stream through the segment's pipe) carry the dtype and the total
element count, which every rank worked out from the same vectors. Different trailing shapes,
or an ``out=`` on some rank that does not hold the total, are found by every rank in the
same vectors, and every rank raises CollectiveMismatchError.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import _algorithms
from .._onehost import _copies, _pipe
from .._onehost._cma import data_address
from .._onehost._shm import SHM_MAX_BYTES
from .._onehost._shm_collectives import shm_done
from .._wire import DTYPE_CODES, NO_ROOT
from ._checks import Refused, check_array, check_out
from ._counts import bounds_of, checked_rows, parts_of
from ._decision import allgather as decide, copy_unrunnable

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Sequence

    from .._algorithms import World
    from .._wire import OpSpec
    from ._checks import Identity, Plan

__all__ = ["body", "body_v", "check", "check_v", "plan_allgather", "plan_allgatherv", "unrunnable"]

#: The algorithms that start from this rank's block in place, by the name that the decision
#: table and forcing use; "cma" and "shm" start from ``x`` itself (see
#: :func:`_allgather_into`).
_IN_PLACE: dict[str, Callable[[World, OpSpec, np.ndarray, Sequence[int]], Awaitable[None]]] = {
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


def plan_allgather(
    world: World, forced: str | None, x: object, out: object
) -> Plan[np.ndarray[Any, Any]]:
    """Everything allgather needs before any I/O: the checks, the step and the identity;
    or Refused."""
    flat, result, gathered = check(x, out, world.size, world.rank)
    if forced is not None and (why := unrunnable("allgather", forced, world, flat.nbytes)):
        raise Refused(why)
    identity: Identity = (DTYPE_CODES[flat.dtype], flat.shape[0], 0, NO_ROOT, None)
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
    identity: Identity = (DTYPE_CODES[flat.dtype], len(trailing) + 2, 0, NO_ROOT, trailing)
    return parts, run, identity


def _onehost(world: World, block_nbytes: int | None) -> tuple[bool, bool]:
    """(whether the shared segment can take blocks of ``block_nbytes``; None: not asked,
    as for allgatherv's blocks of differing sizes, whose counts decide; whether
    cross-memory attach was agreed)."""
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
    if name == "shm":
        await _copies.shm_allgather(world, spec, gathered, bounds, flat)
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
    size = math.prod(trailing)
    capacity = -1 if out is None else out.shape[0]
    m = len(trailing) + 2
    room = SHM_MAX_BYTES - (m + 2) * 8
    # Through the segment, x goes with the vector when it fits beside it (unless an
    # algorithm is forced); when every rank's does, that one publication is the whole call.
    in_slot = name is None and flat.nbytes <= room
    if world.shm is None:
        mine = np.array([rows, capacity, *trailing], dtype=np.int64)
    else:
        # Else the vector carries x's address, where cross-memory attach reads it (1.8 us
        # to ask for, in a call of 30: not asked for when x is in the slot).
        address = data_address(flat) if world.peer_pids is not None and not in_slot else 0
        mine = np.array([rows, capacity, *trailing, address, flat.nbytes], dtype=np.int64)
    payload = (flat,) if in_slot else ()

    def gathered_for(all_rows: list[int]) -> tuple[np.ndarray, list[int]]:
        """The result buffer and every rank's bounds in it, with ``parts`` filled."""
        bounds = bounds_of(all_rows, size)
        gathered = np.empty(bounds[n], dtype=flat.dtype) if out is None else out
        parts[:] = parts_of(gathered, bounds, all_rows, trailing)
        return gathered, bounds

    async def by_sockets(spec: OpSpec) -> None:
        all_rows = [rows]
        if n > 1:
            table = np.empty((n, m), dtype=np.int64)
            table[r] = mine
            await _algorithms.bruck_allgather(
                world, spec, table.reshape(-1), range(0, n * m + 1, m)
            )
            all_rows = checked_rows(world, spec, table.tolist(), m)
        gathered, bounds = gathered_for(all_rows)
        if n == 1:
            _place(flat, gathered, bounds, r)
            return
        chosen = name or decide(gathered.nbytes, n, _onehost(world, None), segment=False)
        await _allgather_into(chosen, world, spec._replace(count=bounds[n]), flat, gathered, bounds)

    async def by_segment(spec: OpSpec) -> None:
        slots = await _copies.shm_post(world, spec, mine, payload)
        vectors = _copies.posted_states(world, spec, mine.shape[0])
        table = vectors.tolist()
        gathered, bounds = gathered_for(checked_rows(world, spec, table, m))
        itemsize = flat.dtype.itemsize
        slotted = [name is None and row[-1] <= room for row in table]
        onehost = (all(slotted), world.peer_pids is not None)
        chosen = name or decide(gathered.nbytes, n, onehost, segment=True)
        if chosen == "shm":
            # Every block came with the counts, this rank's own too: one copy each, from
            # the slots (this rank's is in its cache), as the even allgather's.
            into = gathered.data.cast("B")
            for q in range(n):
                start, end = bounds[q] * itemsize, bounds[q + 1] * itemsize
                into[start:end] = slots[q][mine.nbytes : mine.nbytes + end - start]
            shm_done(world, spec)
            return
        data = spec._replace(count=bounds[n])
        if chosen == "cma":
            # What fits a slot came with the counts; the rest is read where it is, at the
            # addresses that came with them (read before the call's end, as the slots).
            into = gathered.data.cast("B")
            for q in range(n):
                if q != r and slotted[q]:
                    start, end = bounds[q] * itemsize, bounds[q + 1] * itemsize
                    into[start:end] = slots[q][mine.nbytes : mine.nbytes + end - start]
            far = [q for q in range(n) if q != r and not slotted[q]]
            announced = vectors[:, m:]
            await _copies.cma_allgather(world, data, gathered, bounds, flat, announced, far)
            return
        _place(flat, gathered, bounds, r)
        if chosen == "pipe":
            await _pipe.pipe_allgather(world, data, gathered, bounds, agreed=True)
            return
        # Through the sockets: the segment's part of the call ends with the counts.
        shm_done(world, spec)
        await _IN_PLACE[chosen](world, data, gathered, bounds)

    return by_segment if world.shm is not None and n > 1 else by_sockets


def _is_block(flat: np.ndarray, gathered: np.ndarray, rank: int) -> bool:
    """Whether ``flat`` is exactly rank ``rank``'s block of ``gathered`` (in place)."""
    count = flat.shape[0]
    block = gathered[rank * count : (rank + 1) * count]
    return data_address(flat) == data_address(block)


def _place(flat: np.ndarray, gathered: np.ndarray, bounds: Sequence[int], rank: int) -> None:
    """This rank's own block into ``gathered``, unless it is there already (in place).
    The checks allow ``flat`` to overlap ``gathered`` only as exactly this block, so any
    overlap means in place; ``may_share_memory`` answers in 0.25 us, comparing the
    ``ctypes.data`` addresses took 2.3 (a tenth of a small allgather)."""
    block = gathered[bounds[rank] : bounds[rank + 1]]
    if block.shape[0] and not np.may_share_memory(flat, block):
        block[:] = flat
