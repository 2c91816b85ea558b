"""Gather and gatherv: their argument checks, what every rank must agree on and how each call
finds out, and the call into the algorithm that the decision table (or forcing) picked. The
contracts are the docstrings of :meth:`trioring.Communicator.gather` and
:meth:`~trioring.Communicator.gatherv`.

In a tree a rank talks to its parent and children only, so a disagreement that only two
neighbours can see would leave the others returning (or waiting): each call therefore starts
with a step in which every rank hears, directly or through others, from every rank, and every
rank decides from what that step brought, the same way. By call:

- gather: with a shared segment, the call's publication there (its identity: kind, dtype,
  every rank's element count, root), for the slots and the pipe alike. Without, a
  dissemination barrier (round k sends to rank + 2^k and receives from rank - 2^k) whose
  tokens carry the identity, then the tree's (or cross-memory attach's) frames with the same
  identity. Any disagreement is a mismatch of identity in that first step, raised on every
  rank.
- gatherv: one small int64 vector per rank, ``[rows, out= capacity or -1, *trailing
  shape]``, under an identity of the dtype and the vector's length (so a different dtype or
  number of dimensions is a mismatch of identity). With a segment, each rank publishes its
  vector in its slot, and a non-root its ``x`` after it where that fits: when every
  non-root's does, that publication is the whole call (the root copies the blocks out of
  the slots). Without, an allgather (Bruck, whose rounds follow the dissemination pattern)
  of the vectors. Every rank then checks every vector: different trailing shapes, or a
  root's ``out=`` that does not hold the total, raise CollectiveMismatchError on every rank.
  Then, unless the slots carried it, the tree, whose frames carry the total element count.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import _algorithms
from .._onehost import _copies, _pipe
from .._onehost._cma import data_address
from .._onehost._shm import SHM_MAX_BYTES, SLOT_PAYLOAD_BYTES
from .._onehost._shm_collectives import shm_done
from .._wire import DTYPE_CODES
from . import _decision
from ._checks import Refused, agree, check_array, check_out, check_root
from ._counts import bounds_of, checked_rows, parts_of

if TYPE_CHECKING:
    from .._algorithms import World
    from .._wire import OpSpec
    from ._checks import Identity, Plan

__all__ = ["plan_gather", "plan_gatherv", "same_memory", "shm_limit"]


def shm_limit(world: World) -> int:
    """The largest block per rank the decision table gathers through the segment's slots
    here (-1: no segment): the whole slot where no rank is crowded, else SHM_MAX_BYTES,
    where the larger blocks measured no faster (_onehost._shm.SLOT_PAYLOAD_BYTES)."""
    slots = world.shm
    if slots is None:
        return -1
    return SHM_MAX_BYTES if slots.crowded else SLOT_PAYLOAD_BYTES


def plan_gather(
    world: World, forced: str | None, x: object, root: object, out: object
) -> Plan[np.ndarray[Any, Any] | None]:
    """Everything gather needs before any I/O: the checks, the step and the identity; or
    Refused. The result is root's (``out`` or a new array), None elsewhere."""
    n, r = world.size, world.rank
    checked_root = check_root(root, n)
    flat = check_array(x, writable=False)
    assert isinstance(x, np.ndarray)
    count = flat.shape[0]
    result: np.ndarray[Any, Any] | None = None
    gathered: np.ndarray[Any, Any] | None = None
    in_place = False  # whether x is the root's block of out=
    if r == checked_root:
        if out is None:
            result = np.empty((n, *x.shape), dtype=flat.dtype)
            gathered = result.reshape(-1)
        else:
            gathered = check_out(out, flat.dtype, n * count)
            own = gathered[r * count : (r + 1) * count]
            in_place = np.may_share_memory(flat, gathered)
            if in_place and not same_memory(flat, own):
                raise Refused(
                    "x overlaps out= other than as the root's block of it (out.reshape(-1)"
                    "[root * x.size:(root + 1) * x.size]); pass a copy of x"
                )
            result = out  # type: ignore[assignment]  # checked to be an ndarray
    if forced is None:
        shm = flat.nbytes <= shm_limit(world)
        name = _decision.gather(
            n * flat.nbytes,
            (shm, world.peer_pids is not None),
            segment=world.shm is not None,
            world_size=n,
        )
    elif (why := _decision.copy_unrunnable("gather", forced, world, flat.nbytes)) is not None:
        raise Refused(why)
    else:
        name = forced
    sizes = [count] * n

    async def agree_then_gather(spec: OpSpec) -> None:
        if name == "shm":
            # Every rank publishes the call on the segment: a disagreement raises everywhere.
            await _copies.shm_gather(world, spec, flat, gathered, checked_root, in_place=in_place)
            return
        if name == "pipe":
            # As for "shm": the publication agrees.
            await _pipe.pipe_gather(world, spec, flat, gathered, checked_root, in_place=in_place)
            return
        await agree(world, spec, name)
        if name == "cma":
            await _copies.cma_gather(world, spec, flat, gathered, checked_root)
            if gathered is not None and not in_place:
                # Last, so that no peer waits for it (see _pipe._end).
                gathered[r * count : (r + 1) * count] = flat
        else:
            await _algorithms.tree_gather(world, spec, flat, sizes, checked_root, gathered)

    identity: Identity = (DTYPE_CODES[flat.dtype], count, 0, checked_root, None)
    return result, agree_then_gather, identity


def plan_gatherv(
    world: World, forced: str | None, x: object, root: object, out: object
) -> Plan[list[np.ndarray[Any, Any]] | None]:
    """Everything gatherv needs before any I/O; or Refused. The result is root's list of
    parts (filled by the step), None elsewhere."""
    n, r = world.size, world.rank
    checked_root = check_root(root, n)
    flat = check_array(x, writable=False)
    assert isinstance(x, np.ndarray)
    if x.ndim == 0:
        raise Refused("gatherv needs an array of at least one dimension (its rows vary)")
    rows, trailing = x.shape[0], tuple(x.shape[1:])
    is_root = r == checked_root
    target: np.ndarray[Any, Any] | None = None
    if is_root and out is not None:
        target = check_out(out, flat.dtype, None)
        if np.may_share_memory(flat, target):
            raise Refused("x overlaps out=; pass a copy of x")
        if n == 1 and target.shape[0] != flat.shape[0]:
            raise Refused(
                f"out= holds {target.shape[0]} elements; in a world of one the gatherv "
                f"gathers x's {flat.shape[0]}"
            )
    assert forced in (None, "tree"), forced  # "shm" is not forceable (see _decision)
    parts: list[np.ndarray[Any, Any]] | None = [] if is_root else None
    dtype = flat.dtype
    capacity = -1 if target is None else target.shape[0]
    mine = np.array([rows, capacity, *trailing], dtype=np.int64)
    m = mine.shape[0]
    room = SHM_MAX_BYTES - mine.nbytes
    # Through the segment, a non-root's x goes with its counts when it fits beside them
    # (unless the algorithm is forced); when every one does, that publication is the call.
    segment = world.shm is not None and n > 1
    payload = (flat,) if segment and forced is None and not is_root and flat.nbytes <= room else ()

    async def exchange_then_gather(spec: OpSpec) -> None:
        slots = None
        if segment:
            slots = await _copies.shm_post(world, spec, mine, payload)
            table = _copies.posted_states(world, spec, m).tolist()
        else:
            vectors = np.empty((n, m), dtype=np.int64)
            vectors[r] = mine
            if n > 1:
                await _algorithms.bruck_allgather(
                    world, spec, vectors.reshape(-1), range(0, n * m + 1, m)
                )
            table = vectors.tolist()
        all_rows = checked_rows(world, spec, table, m, checked_root)
        bounds = bounds_of(all_rows, math.prod(trailing))
        total = bounds[n]
        gathered = None
        if parts is not None:
            gathered = np.empty(total, dtype=dtype) if target is None else target
            parts[:] = parts_of(gathered, bounds, all_rows, trailing)
        by = "tree"
        if slots is not None:
            itemsize = dtype.itemsize
            slotted = forced is None and all(
                (bounds[q + 1] - bounds[q]) * itemsize <= room
                for q in range(n)
                if q != checked_root
            )
            by = _decision.gatherv(slotted=slotted)
            if by == "shm" and gathered is not None:
                into = gathered.data.cast("B")
                for q in range(n):
                    start, end = bounds[q] * itemsize, bounds[q + 1] * itemsize
                    if q != r:
                        into[start:end] = slots[q][mine.nbytes : mine.nbytes + end - start]
                    else:
                        into[start:end] = flat.data.cast("B")
            # The segment's part of the call ends with the counts (or is the whole call).
            shm_done(world, spec)
        if by == "tree":
            sizes = [bounds[q + 1] - bounds[q] for q in range(n)]
            await _algorithms.tree_gather(
                world, spec._replace(count=total), flat, sizes, checked_root, gathered
            )

    identity: Identity = (DTYPE_CODES[dtype], len(trailing) + 2, 0, checked_root, trailing)
    return parts, exchange_then_gather, identity


def same_memory(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether two flat arrays are the same memory."""
    return a.shape[0] == b.shape[0] and data_address(a) == data_address(b)
