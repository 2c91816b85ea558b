"""Alltoall and alltoallv: their argument checks, the exchange of counts that alltoallv
starts with, and the call into the algorithm that the decision table (or forcing) picked.
The contracts are :meth:`trioring.Communicator.alltoall`'s and
:meth:`~trioring.Communicator.alltoallv`'s docstrings.

Frames. An alltoall's frames carry the dtype and the input's element count (n equal
blocks), so ranks that pass different dtypes or sizes raise
:class:`CollectiveMismatchError` on the first frame they exchange; both algorithms send
their first frame to rank r+1, so ranks whose sizes put them on different rows of the
decision table still meet there.

An alltoallv runs in two phases under one sequence number. First one small int64 vector per
pair of ranks, ``[rows, *trailing shape]`` (the rows that rank sends to this one), under an
identity of the dtype and that vector's length (so a different dtype or number of
dimensions is a mismatch of identity): with a shared segment each rank publishes its
vectors for every rank in its slot, with its blocks for the others after them where they
fit, and when every rank's fit that publication is the whole call; without, an alltoall of
the vectors by Bruck. Then the data, by pairwise exchange, under the same identity, each
block of exactly the size its sender announced. Different trailing shapes are found by
every rank in the vectors it receives, and every rank raises CollectiveMismatchError.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import _algorithms
from .._onehost import _copies, _pipe
from .._onehost._shm import SHM_MAX_BYTES
from .._onehost._shm_collectives import shm_done
from .._wire import DTYPE_CODES, NO_ROOT
from . import _decision
from ._checks import Refused, check_array, check_out
from ._counts import bounds_of, describe, impossible_counts, mismatch, parts_of

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from .._algorithms import World
    from .._wire import OpSpec
    from ._checks import Identity, Plan

__all__ = ["plan_alltoall", "plan_alltoallv"]


def plan_alltoall(
    world: World, forced: str | None, x: object, out: object
) -> Plan[np.ndarray[Any, Any]]:
    """Everything alltoall needs before any I/O: the checks, the algorithm (``forced``, or
    the table's), the step and the identity; or Refused. The result is a new array of
    ``x``'s shape, or ``out``."""
    flat = check_array(x, writable=False)
    assert isinstance(x, np.ndarray)
    n, total = world.size, flat.shape[0]
    if total % n:
        raise Refused(
            f"the array's {total} elements do not split into {n} equal blocks (its size "
            "must be a multiple of world_size; use alltoallv for blocks of different sizes)"
        )
    block = total // n
    if out is None:
        result = np.empty(x.shape, flat.dtype)
        received = result.reshape(-1)
    else:
        received = check_out(out, flat.dtype, total, flat)
        assert isinstance(out, np.ndarray)
        result = out
    if forced is None:
        shm = world.shm is not None and _decision.others_share(flat.nbytes, n) <= SHM_MAX_BYTES
        onehost = (shm, world.peer_pids is not None)
        name = _decision.alltoall(
            block * flat.dtype.itemsize, n, onehost, segment=world.shm is not None
        )
    elif (
        why := _decision.copy_unrunnable(
            "alltoall", forced, world, _decision.others_share(flat.nbytes, n)
        )
    ) is not None:
        raise Refused(why)
    else:
        name = forced

    if name == "shm":

        async def run(spec: OpSpec) -> None:
            await _copies.shm_alltoall(world, spec, flat, received)

    elif name == "pipe":

        async def run(spec: OpSpec) -> None:
            await _pipe.pipe_alltoall(world, spec, flat, received)

    elif name == "cma":

        async def run(spec: OpSpec) -> None:
            await _copies.cma_alltoall(world, spec, flat, received)

    elif name == "bruck":

        async def run(spec: OpSpec) -> None:
            await _algorithms.bruck_alltoall(world, spec, flat, received, block)

    else:

        async def run(spec: OpSpec) -> None:
            sends = [flat[i * block : (i + 1) * block] for i in range(n)]
            recvs = [received[i * block : (i + 1) * block] for i in range(n)]
            await _algorithms.pairwise_alltoall(world, spec, sends, recvs)

    identity: Identity = (DTYPE_CODES[flat.dtype], total, 0, NO_ROOT, None)
    return result, run, identity


def check_v(
    xs: object, out: object, world_size: int
) -> tuple[list[np.ndarray[Any, Any]], list[int], tuple[int, ...], np.ndarray[Any, Any] | None]:
    """(the arrays flat, their rows, their common trailing shape, ``out`` flat or None), or
    Refused. In a world of one, ``out``'s size is checked here too (elsewhere only the
    exchanged counts tell the total)."""
    if not isinstance(xs, list | tuple):
        raise Refused(
            f"alltoallv takes a list of world_size ({world_size}) arrays, one per "
            f"destination rank, got {type(xs).__name__}"
        )
    if len(xs) != world_size:
        raise Refused(
            f"alltoallv takes one array per rank: got {len(xs)} arrays at world size {world_size}"
        )
    flats: list[np.ndarray[Any, Any]] = []
    rows: list[int] = []
    first: np.ndarray[Any, Any] | None = None
    for i, x in enumerate(xs):
        try:
            flat = check_array(x, writable=False)
        except Refused as exc:
            raise Refused(f"the array for rank {i}: {exc}") from None
        assert isinstance(x, np.ndarray)
        if x.ndim == 0:
            raise Refused(
                f"the array for rank {i} has no dimensions; alltoallv needs arrays of at least "
                "one dimension (their rows vary)"
            )
        if first is None:
            first = x
        elif x.dtype != first.dtype or x.shape[1:] != first.shape[1:]:
            raise Refused(
                f"the arrays must share dtype and trailing shape (x.shape[1:]): the one for "
                f"rank 0 is {_shape_of(first)}, the one for rank {i} {_shape_of(x)}"
            )
        flats.append(flat)
        rows.append(x.shape[0])
    assert first is not None  # world_size >= 1
    trailing = tuple(first.shape[1:])
    if out is None:
        return flats, rows, trailing, None
    received = check_out(out, first.dtype, None, *flats)
    if world_size == 1 and received.shape[0] != flats[0].shape[0]:
        raise Refused(
            f"out= holds {received.shape[0]} elements; in a world of one the alltoallv "
            f"receives its own {flats[0].shape[0]}"
        )
    return flats, rows, trailing, received


def plan_alltoallv(
    world: World, forced: str | None, xs: object, out: object, problems: list[str]
) -> Plan[list[np.ndarray[Any, Any]]]:
    """Everything alltoallv needs before any I/O, as :func:`plan_alltoall`; or Refused. The
    result is the list that the step fills with one view per rank. An ``out=`` that turns
    out, once the counts are known, not to hold what this rank receives is reported in
    ``problems`` (the call completes on every rank, into a buffer of its own here)."""
    flats, rows, trailing, out_flat = check_v(xs, out, world.size)
    assert forced in (None, "pairwise"), forced  # "shm" is not forceable (see _decision)
    parts: list[np.ndarray[Any, Any]] = []
    body = _body_v(world, forced, flats, rows, trailing, out_flat, parts, problems)
    identity: Identity = (DTYPE_CODES[flats[0].dtype], len(trailing) + 1, 0, NO_ROOT, trailing)
    return parts, body, identity


def _body_v(
    world: World,
    forced: str | None,
    flats: list[np.ndarray[Any, Any]],
    rows: list[int],
    trailing: tuple[int, ...],
    out: np.ndarray[Any, Any] | None,
    parts: list[np.ndarray[Any, Any]],
    problems: list[str],
) -> Callable[[OpSpec], Awaitable[None]]:
    n, r = world.size, world.rank
    dtype = flats[0].dtype
    size = math.prod(trailing)
    m = len(trailing) + 1
    # [rows, *trailing] for each destination rank (made from one list: filling the
    # columns of an empty array took 3.2 us, this 1.5-2.5).
    mine = np.array([[rows_q, *trailing] for rows_q in rows] if trailing else rows, np.int64)
    mine = mine.reshape(n, m)
    room = SHM_MAX_BYTES - mine.nbytes
    # Through the segment, the blocks for the other ranks go with the counts when they fit
    # beside them (unless the algorithm is forced); when every rank's do, that one
    # publication is the whole call. In worlds too large for the counts in one slot, Bruck.
    segment = world.shm is not None and n > 1 and room >= 0
    sent = sum(flat.nbytes for q, flat in enumerate(flats) if q != r)
    payload = [f for q, f in enumerate(flats) if q != r] if forced is None and sent <= room else []

    def received_for(incoming: list[int]) -> tuple[np.ndarray, list[int], list[np.ndarray]]:
        """The result buffer, each sender's bounds in it and its block of it."""
        bounds = bounds_of(incoming, size)
        total = bounds[n]
        if out is not None and out.shape[0] != total:
            problems.append(
                f"out= holds {out.shape[0]} elements, but this rank receives {total} "
                f"({' + '.join(map(str, incoming))} rows of shape {list(trailing)}); the "
                "call completed on every rank, without out="
            )
            received = np.empty(total, dtype)
        else:
            received = np.empty(total, dtype) if out is None else out
        recvs = [received[bounds[i] : bounds[i + 1]] for i in range(n)]
        parts[:] = parts_of(received, bounds, incoming, trailing)
        return received, bounds, recvs

    async def by_sockets(spec: OpSpec) -> None:
        incoming = rows
        if n > 1:
            vectors = np.empty((n, m), dtype=np.int64)
            await _algorithms.bruck_alltoall(world, spec, mine.reshape(-1), vectors.reshape(-1), m)
            incoming = _checked_incoming(world, spec, vectors.tolist(), trailing)
        _, _, recvs = received_for(incoming)
        await _algorithms.pairwise_alltoall(world, spec, flats, recvs)

    async def by_segment(spec: OpSpec) -> None:
        slots = await _copies.shm_post(world, spec, mine.reshape(-1), payload)
        # Every rank's counts: states[sender] = [rows, *trailing] for each destination.
        states = _copies.posted_states(world, spec, n * m).tolist()
        incoming = _checked_incoming(
            world, spec, [row[r * m : (r + 1) * m] for row in states], trailing
        )
        received, bounds, recvs = received_for(incoming)
        # What each rank sends to each, in bytes; a rank's blocks for the others are in its
        # slot if they fit there.
        block = size * dtype.itemsize
        sends = [[row[d * m] * block for d in range(n)] for row in states]
        slotted = forced is None and all(sum(row) - row[q] <= room for q, row in enumerate(sends))
        if (forced or _decision.alltoallv(slotted=slotted)) == "shm":
            into = received.data.cast("B")
            itemsize = dtype.itemsize
            for q in range(n):
                start, end = bounds[q] * itemsize, bounds[q + 1] * itemsize
                if q != r:
                    # In rank q's slot, after its counts: its blocks for every rank but q.
                    at = mine.nbytes + sum(sends[q][:r]) - (sends[q][q] if q < r else 0)
                    into[start:end] = slots[q][at : at + end - start]
                else:
                    into[start:end] = flats[r].data.cast("B")
            shm_done(world, spec)
            return
        # The segment's part of the call ends with the counts.
        shm_done(world, spec)
        await _algorithms.pairwise_alltoall(world, spec, flats, recvs)

    return by_segment if segment else by_sockets


def _checked_incoming(
    world: World,
    spec: OpSpec,
    vectors: list[list[int]],
    trailing: tuple[int, ...],
) -> list[int]:
    """The rows every rank sends to this one, from the ``[rows, *trailing]`` each sent it,
    once every rank's trailing shape agreed with this one's."""
    incoming = [vector[0] for vector in vectors]
    if not trailing and min(incoming) >= 0:
        return incoming  # 1-D blocks (most calls): only the rows to check
    for peer, (peer_rows, *peer_trailing) in enumerate(vectors):
        if peer_rows < 0 or min(peer_trailing, default=0) < 0:
            raise impossible_counts(world, spec, peer, vectors[peer])
        if tuple(peer_trailing) != trailing:
            mine, theirs = describe(spec, trailing), describe(spec, tuple(peer_trailing))
            calls = {world.rank: mine, peer: theirs}
            raise mismatch(world, spec, peer, f"{mine}, rank {peer}: {theirs}", calls)
    return incoming


def _shape_of(x: np.ndarray[Any, Any]) -> str:
    return f"{x.dtype.name}{list(x.shape)}"
