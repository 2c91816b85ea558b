"""Scatter and scatterv: their argument checks, what every rank must agree on and how each
call finds out, and the call into the algorithm that the decision table (or forcing) picked.
The contracts are the docstrings of :meth:`trioring.Communicator.scatter` and
:meth:`~trioring.Communicator.scatterv`.

Only the root knows the dtype and shapes, so the first round is a dissemination of a fixed
header of ``HEADER_WORDS`` int64s (see _scatter_header: through the shared segment where
there is one, every rank publishes its header and, once all are there, folds them in one
pass; otherwise by frames of dtype int64 and count ``HEADER_WORDS``, round k sending to
rank + 2^k, each rank merging what it receives). The root's header travels with
every token, and every rank folds in the dtypes and element counts of the ``out=`` arrays
passed anywhere as their minimum and maximum; after it every rank knows the root's dtype and
block shape and whether every ``out=`` fits, the same on every rank. Through the segment,
the root's slot also carries, after its header, the other ranks' blocks of an array when
they fit (then that round is the whole call), or its address for cross-memory attach; for
a list (and scatterv), a flag, then, when they fit, every block's shape and the other
ranks' blocks (see :func:`_list_payload`).
Otherwise the tree: for an array on the root, frames carrying the dtype and each rank's
element count; for a list (and scatterv), each edge first carries the shapes of the
receiving subtree's blocks, then its data (frames carrying the subtree's element count). An
``out=`` whose size does not fit the block of a list is found only by its own rank, once its
shape has come down the tree: when any rank passed ``out=`` to a list scatter, the call ends
with a dissemination barrier, so that rank's mismatch reaches every rank.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import _algorithms
from .._onehost import _copies, _pipe
from .._onehost._shm import SHM_MAX_BYTES
from .._onehost._shm_collectives import shm_done
from .._wire import DTYPE_CODES, DTYPES
from . import _decision
from ._checks import Refused, check_array, check_out, check_root
from ._counts import mismatch
from ._gather import same_memory
from ._scatter_header import (
    ANY_OUT,
    ARRAY,
    COUNT,
    DTYPE,
    FORM,
    HEADER_BYTES,
    HEADER_WORDS,
    LIST,
    MAX_DIMS,
    NDIM,
    SHAPE,
    header_round,
    out_fields,
    start_header,
)

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from .._algorithms import World
    from .._wire import OpSpec
    from ._checks import Plan

__all__ = ["SHM_SCATTER_BYTES", "plan_scatter"]


def plan_scatter(
    world: World,
    forced: str | None,
    blocks: object,
    root: object,
    out: object,
    *,
    uneven: bool,
) -> Plan[list[np.ndarray[Any, Any]]]:
    """Everything scatter (``uneven`` False) or scatterv needs before any I/O; or Refused.
    The result is a one-element list, whose element (this rank's block) the root has at
    once and the other ranks get from the step."""
    n, r = world.size, world.rank
    checked_root = check_root(root, n)
    if forced is not None and (why := _decision.copy_unrunnable("scatter", forced, world, 0)):
        raise Refused(why)
    box: list[np.ndarray[Any, Any]] = []
    if r != checked_root:
        # The root's blocks decide; whatever a non-root passes as ``blocks`` is ignored.
        target = None
        if out is not None:
            try:
                target = check_array(out)
            except Refused as exc:
                raise Refused(f"out=: {exc}") from None
        body = _scatter_elsewhere(world, forced, checked_root, out, target, box)
        return box, body, (0, 0, 0, checked_root, None)
    # A list of blocks comes with their shapes; one array (None here) has equal rows.
    shapes: np.ndarray[Any, Any] | None = None
    fields: tuple[int, int, int, tuple[int, ...] | None]
    if isinstance(blocks, (list, tuple)):  # (a tuple: ``list | tuple`` is made per call)
        parts, shapes = _check_list(blocks, n)
        own_shape = tuple(shapes[r].tolist())
        fields = (DTYPE_CODES[parts[0].dtype], LIST, shapes.shape[1], None)
    else:
        flat, own_shape = _check_rows(blocks, n, uneven=uneven)
        parts = [flat]
        fields = (DTYPE_CODES[flat.dtype], ARRAY, len(own_shape), own_shape)
    dtype = parts[0].dtype
    own_count = math.prod(own_shape)
    if out is None:
        box.append(np.empty(own_shape, dtype=dtype))
        result = box[0].reshape(-1)
    else:
        result = check_out(out, dtype, own_count)
        for index, part in enumerate(parts):
            if np.may_share_memory(part, result) and not (
                (shapes is None or index == r)
                and same_memory(_own(parts, shapes, r, own_count), result)
            ):
                raise Refused(
                    "out= overlaps the blocks other than as the root's own block; pass a "
                    "separate buffer"
                )
        assert isinstance(out, np.ndarray)
        box.append(out)
    header = start_header(r, fields, out_fields(result if out is not None else None))

    async def scatter_from_root(spec: OpSpec) -> None:
        by = _scatter_by(world, forced, n * own_count * dtype.itemsize if shapes is None else -1)
        announced = None
        payload: tuple[np.ndarray, ...] = ()
        if world.shm is not None:
            if by == "shm":
                payload = _others(parts[0], r * own_count, (r + 1) * own_count)
            elif by == "cma":
                payload = (_copies.scatter_address(parts[0]),)
            elif shapes is not None:
                payload = _list_payload(forced, parts, shapes, r)
        h, _, slots = await header_round(world, spec, header, checked_root, payload)
        if slots is not None:
            if by == "cma":
                announced = _copies.scatter_words(world, spec, HEADER_BYTES)
            elif by != "pipe":
                shm_done(world, spec)
        any_out = h[ANY_OUT]
        if by == "shm":
            # The others copy theirs out of this rank's slot.
            result[...] = parts[0][r * own_count : (r + 1) * own_count]
            return
        if shapes is not None and len(payload) > 1:
            # As for "shm": the others copy theirs, and their shapes, out of this slot.
            result[...] = parts[r]
            if any_out:
                await _algorithms.barrier(world, spec)
            return
        if shapes is None:
            data = spec._replace(dtype_code=DTYPE_CODES[dtype], count=own_count)
            if by == "cma":
                await _copies.cma_scatter(world, data, parts[0], result, checked_root, announced)
                return
            if by == "pipe":
                await _pipe.pipe_scatter(world, data, parts[0], result, checked_root)
                return
            sizes = [own_count] * n
            await _algorithms.tree_scatter(world, data, parts, sizes, checked_root, result)
            return
        data = spec._replace(dtype_code=DTYPE_CODES[dtype])
        await _algorithms.tree_scatterv(
            world, data, checked_root, shapes.shape[1], shapes, parts, lambda _shape: result
        )
        if any_out:
            await _algorithms.barrier(world, spec)

    return box, scatter_from_root, (0, 0, 0, checked_root, None)


def _own(parts: list[np.ndarray], shapes: np.ndarray | None, r: int, count: int) -> np.ndarray:
    """The root's own block: its part of a list, or its row of one array (``parts[0]``
    flat, rows of ``count`` elements). Made only where ``out=`` overlaps the blocks."""
    return parts[r] if shapes is not None else parts[0][r * count : (r + 1) * count]


def _others(flat: np.ndarray, lo: int, hi: int) -> tuple[np.ndarray, ...]:
    """``flat`` but ``[lo, hi)`` (the root's own block, which it copies directly), as the
    pieces that are not empty: a copy costs about 0.4 us even when there is nothing to
    copy, in a 4-byte scatter of 20-30."""
    if lo == 0:
        return (flat[hi:],)
    if hi == flat.shape[0]:
        return (flat[:lo],)
    return flat[:lo], flat[hi:]


def _check_list(
    blocks: list[Any] | tuple[Any, ...], n: int
) -> tuple[list[np.ndarray[Any, Any]], np.ndarray[Any, Any]]:
    """The root's list of blocks as (flat arrays in rank order, an ``(n, ndim)`` int64
    array of each rank's block shape), or Refused."""
    if len(blocks) != n:
        raise Refused(f"the root passes {len(blocks)} arrays; expected world_size ({n})")
    parts = []
    for index, block in enumerate(blocks):
        try:
            parts.append(check_array(block, writable=False))
        except Refused as exc:
            raise Refused(f"blocks[{index}]: {exc}") from None
    arrays: list[np.ndarray[Any, Any]] = list(blocks)
    first = arrays[0]
    for index, block in enumerate(arrays):
        if block.dtype != first.dtype:
            raise Refused(
                f"blocks[{index}] has dtype {block.dtype}, blocks[0] has {first.dtype}; "
                "they must agree"
            )
        if block.ndim != first.ndim:
            raise Refused(
                f"blocks[{index}] has {block.ndim} dimensions, blocks[0] has {first.ndim}; "
                "they must agree"
            )
    shapes = np.zeros((n, first.ndim), dtype=np.int64)
    for index, block in enumerate(arrays):
        shapes[index] = block.shape
    return parts, shapes


def _check_rows(
    blocks: object, n: int, *, uneven: bool
) -> tuple[np.ndarray[Any, Any], tuple[int, ...]]:
    """The root's one array of ``n`` rows as (its flat view, one row's shape), or Refused.
    No shape array as for a list: every row has the same shape, and building one cost
    1.5 us of a 4-byte scatter of 20."""
    if uneven:
        raise Refused(
            f"scatterv takes a list of world_size arrays on the root, got {_name(blocks)}; "
            "scatter takes one array of world_size rows"
        )
    if not isinstance(blocks, np.ndarray):
        raise Refused(
            f"the root passes a numpy.ndarray of world_size ({n}) rows or a list of "
            f"{n} arrays, got {_name(blocks)}"
        )
    flat = check_array(blocks, writable=False)
    shape = blocks.shape
    if not shape or shape[0] != n:
        what = "a 0-d array" if not shape else f"shape {shape}"
        raise Refused(
            f"the root's array has {what}; its first dimension must be world_size ({n}), "
            "one block per rank (pass a list of arrays for uneven blocks)"
        )
    if len(shape) - 1 > MAX_DIMS:
        raise Refused(f"blocks of more than {MAX_DIMS} dimensions are not supported")
    return flat, shape[1:]


#: The most a scatter's root carries in its slot beside the header: a scatter from an array
#: whose other ranks' blocks (all but the root's) come to at most this travels with the
#: header round. Leaving the root's block out took a 256 KiB scatter at world 2 (too big
#: for the slot with it) from 105-139 us over sockets to 75 (bench/compare.py, 3 rounds).
SHM_SCATTER_BYTES = SHM_MAX_BYTES - HEADER_WORDS * 8


def _scatter_by(world: World, forced: str | None, total_nbytes: int) -> str:
    """The algorithm of a scatter from an array of ``total_nbytes`` (-1: a list, or
    scatterv, which always go by the tree), the same on every rank once the header told it
    the size."""
    if total_nbytes < 0:
        return "tree"
    if forced is not None:
        return forced
    slot_bytes = SHM_SCATTER_BYTES if world.shm is not None else -1
    return _decision.scatter(total_nbytes, world.peer_pids is not None, slot_bytes, world.size)


def _scatter_elsewhere(
    world: World,
    forced: str | None,
    root: int,
    out: object,
    target: np.ndarray[Any, Any] | None,
    box: list[np.ndarray[Any, Any]],
) -> Callable[[OpSpec], Awaitable[None]]:
    """A non-root rank's step: learn the header, then receive this rank's block into
    ``target`` (``out``'s flat view) or a new array, which goes into ``box``."""
    n, r = world.size, world.rank
    start = start_header(r, None, out_fields(target))

    async def scatter_to_here(spec: OpSpec) -> None:
        h, header, slots = await header_round(world, spec, start, root)
        dtype = DTYPES[h[DTYPE] - 1]

        def prepare(shape: tuple[int, ...]) -> np.ndarray[Any, Any]:
            if target is None:
                box.append(np.empty(shape, dtype=dtype))
                return box[0].reshape(-1)
            count = math.prod(shape)
            if target.shape[0] != count:
                raise mismatch(
                    world,
                    spec,
                    root,
                    f"{spec.kind.label}(root={root}) #{spec.seq}: out= holds "
                    f"{target.shape[0]} elements, but root {root}'s block for this rank is "
                    f"{dtype.name}{list(shape)} ({count} elements)",
                )
            box.append(out)  # type: ignore[arg-type]  # checked to be an ndarray
            return target

        by = "tree"
        if h[FORM] == LIST and slots is not None and _list_in_slot(slots[root], HEADER_BYTES):
            _list_from_slot(
                _copies.slot_bytes(world, spec)[root], HEADER_BYTES, n, h[NDIM], root, r, prepare
            )
            shm_done(world, spec)
            if h[ANY_OUT]:
                await _algorithms.barrier(world, spec)
            return
        if h[FORM] == ARRAY:
            shape = tuple(header[SHAPE : SHAPE + h[NDIM]].tolist())
            count = h[COUNT]
            if target is None:
                box.append(np.empty(shape, dtype=dtype))
                result = box[0].reshape(-1)
            else:
                box.append(out)  # type: ignore[arg-type]  # checked to be an ndarray
                result = target
            by = _scatter_by(world, forced, n * count * dtype.itemsize)
            if by == "shm" and result.nbytes:
                assert slots is not None
                # The root's slot holds every block but its own, after the header.
                at = HEADER_BYTES + (r - (r > root)) * count * dtype.itemsize
                result.data.cast("B")[:] = slots[root][at : at + result.nbytes]
        if slots is not None and by not in ("cma", "pipe"):
            # The copy's end says done (the done words of the header round's publication).
            shm_done(world, spec)
        if by == "shm":
            return
        if h[FORM] == ARRAY:
            data = spec._replace(dtype_code=h[DTYPE], count=count)
            if by == "cma":
                # With a segment, the root's address came with the header (and this rank's
                # done word waits for the end of the copy).
                announced = (
                    None if slots is None else _copies.scatter_words(world, spec, HEADER_BYTES)
                )
                await _copies.cma_scatter(world, data, None, result, root, announced)
                return
            if by == "pipe":
                await _pipe.pipe_scatter(world, data, None, result, root)
                return
            await _algorithms.tree_scatter(world, data, None, [count] * n, root, result)
            return
        data = spec._replace(dtype_code=h[DTYPE])
        await _algorithms.tree_scatterv(world, data, root, h[NDIM], None, None, prepare)
        if h[ANY_OUT]:
            await _algorithms.barrier(world, spec)

    return scatter_to_here


#: What a list scatter's root publishes after its header, first: whether the blocks follow.
_IN_SLOT, _NOT_IN_SLOT = np.ones(1, dtype=np.int64), np.zeros(1, dtype=np.int64)


def _list_payload(
    forced: str | None, parts: list[np.ndarray], shapes: np.ndarray, root: int
) -> tuple[np.ndarray, ...]:
    """What a list scatter's (and scatterv's) root publishes after its header: whether
    the blocks follow, then, where they fit its slot (and the tree is not forced), every
    block's shape (``shapes``, ``(n, ndim)`` int64s) and the other ranks' blocks in rank
    order. The others copy theirs out of the slot, and then the header round was the
    whole call."""
    others = [part for q, part in enumerate(parts) if q != root]
    nbytes = _IN_SLOT.nbytes + shapes.nbytes + sum(part.nbytes for part in others)
    if forced is not None or nbytes > SHM_SCATTER_BYTES:
        return (_NOT_IN_SLOT,)
    return (_IN_SLOT, shapes.reshape(-1), *others)


def _list_in_slot(slot: memoryview, at: int) -> bool:
    """Whether the root's ``slot`` (bytes) holds the blocks of a list scatter after its
    header of ``at`` bytes (see :func:`_list_payload`)."""
    return bool(slot[at : at + _IN_SLOT.nbytes].cast("q")[0])


def _list_from_slot(
    slot: np.ndarray,
    at: int,
    n: int,
    ndim: int,
    root: int,
    rank: int,
    prepare: Callable[[tuple[int, ...]], np.ndarray[Any, Any]],
) -> None:
    """Copy this rank's block of a list scatter out of the root's ``slot``, into the array
    that ``prepare`` returns for its shape (see :func:`_list_payload`)."""
    at += _IN_SLOT.nbytes
    shapes = slot[at : at + n * ndim * 8].view(np.int64).reshape(n, ndim).tolist()
    at += n * ndim * 8
    into = prepare(tuple(shapes[rank]))
    # Every block but the root's, in rank order, after the shapes.
    itemsize = into.itemsize
    at += sum(math.prod(shapes[q]) * itemsize for q in range(rank) if q != root)
    into.view(np.uint8)[...] = slot[at : at + into.nbytes]


def _name(value: object) -> str:
    return type(value).__name__
