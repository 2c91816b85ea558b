"""Scatter and scatterv: their argument checks, what every rank must agree on and how each
call finds out, and the call into the algorithm that the decision table (or forcing) picked.
The contracts are the docstrings of :meth:`trioring.Communicator.scatter` and
:meth:`~trioring.Communicator.scatterv`.

Only the root knows the dtype and shapes, so the first round is a dissemination of a fixed
header of ``HEADER_WORDS`` int64s (through the shared segment where there is one: every
rank publishes its header and folds in every peer's; otherwise by frames of dtype int64 and
count ``HEADER_WORDS``, round k sending to rank + 2^k). The root's header travels with
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
from .._errors import ProtocolError
from .._onehost import _copies, _pipe
from .._onehost._shm import SHM_MAX_BYTES
from .._onehost._shm_collectives import shm_done
from .._wire import DTYPE_CODES, DTYPES
from . import _decision
from ._checks import Refused, check_array, check_out, check_root
from ._counts import job_id, mismatch
from ._gather import same_memory

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from .._algorithms import World
    from .._wire import OpSpec
    from ._checks import Plan

__all__ = ["HEADER_WORDS", "MAX_DIMS", "SHM_SCATTER_BYTES", "plan_scatter"]

#: The most dimensions a scattered block may have (numpy's own limit).
MAX_DIMS = 64
# The scatter header, one int64 each: whether the root's part is in, the root's dtype code,
# form (0: one array, 1: a list), the blocks' number of dimensions, the elements per block
# (one array; -1 for a list), whether any rank passed out=; then (value, rank) pairs: the
# least and greatest out= dtype code, the least and greatest out= element count; then the
# block shape (one array).
_KNOWN, _DTYPE, _FORM, _NDIM, _COUNT, _ANY_OUT = range(6)
_DTYPE_MIN, _DTYPE_MAX, _COUNT_MIN, _COUNT_MAX = 6, 8, 10, 12
_SHAPE = 14
#: The scatter header's length, in int64s.
HEADER_WORDS = _SHAPE + MAX_DIMS
_NOBODY = 2**62  # the rank (and least value) where nobody passed out=
_ARRAY, _LIST = 0, 1


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
        return box, body, {"root": checked_root}
    form, parts, shapes = _check_blocks(blocks, n, uneven=uneven)
    dtype = parts[0].dtype
    own_shape = tuple(shapes[r].tolist())
    own_count = math.prod(own_shape)
    if out is None:
        box.append(np.empty(own_shape, dtype=dtype))
        result = box[0].reshape(-1)
    else:
        result = check_out(out, dtype, own_count)
        own = parts[r] if form == _LIST else parts[0][r * own_count : (r + 1) * own_count]
        for index, part in enumerate(parts):
            if np.may_share_memory(part, result) and not (
                (form == _ARRAY or index == r) and same_memory(own, result)
            ):
                raise Refused(
                    "out= overlaps the blocks other than as the root's own block; pass a "
                    "separate buffer"
                )
        assert isinstance(out, np.ndarray)
        box.append(out)
    header = _blank_header(r, result if out is not None else None)
    header[_KNOWN], header[_DTYPE], header[_FORM] = 1, DTYPE_CODES[dtype], form
    header[_NDIM] = shapes.shape[1]
    if form == _ARRAY:
        header[_COUNT] = own_count
        header[_SHAPE : _SHAPE + len(own_shape)] = own_shape
    else:
        header[_COUNT] = -1

    async def scatter_from_root(spec: OpSpec) -> None:
        by = _scatter_by(world, forced, n * own_count * dtype.itemsize if form == _ARRAY else -1)
        announced = None
        payload: tuple[np.ndarray, ...] = ()
        if world.shm is not None:
            if by == "shm":
                payload = _others(parts[0], r * own_count, (r + 1) * own_count)
            elif by == "cma":
                payload = (_copies.scatter_address(parts[0]),)
            elif form == _LIST:
                payload = _list_payload(forced, parts, shapes, r)
            else:
                payload = ()
            rows = await _copies.shm_disseminate(world, spec, header, _merge, payload)
            if by == "cma":
                announced = _copies.scatter_words(rows, header.nbytes)
            elif by != "pipe":
                shm_done(world, spec)
        else:
            await _algorithms.disseminate(world, spec, header, _merge)
        any_out = _check_header(world, spec, header, checked_root)[_ANY_OUT]
        if by == "shm":
            # The others copy theirs out of this rank's slot.
            result[...] = parts[0][r * own_count : (r + 1) * own_count]
            return
        if form == _LIST and len(payload) > 1:
            # As for "shm": the others copy theirs, and their shapes, out of this slot.
            result[...] = parts[r]
            if any_out:
                await _algorithms.barrier(world, spec)
            return
        if form == _ARRAY:
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

    return box, scatter_from_root, {"root": checked_root}


def _others(flat: np.ndarray, lo: int, hi: int) -> tuple[np.ndarray, ...]:
    """``flat`` but ``[lo, hi)`` (the root's own block, which it copies directly), as the
    pieces that are not empty: a copy costs about 0.4 us even when there is nothing to
    copy, in a 4-byte scatter of 20-30."""
    if lo == 0:
        return (flat[hi:],)
    if hi == flat.shape[0]:
        return (flat[:lo],)
    return flat[:lo], flat[hi:]


def _check_blocks(
    blocks: object, n: int, *, uneven: bool
) -> tuple[int, list[np.ndarray[Any, Any]], np.ndarray[Any, Any]]:
    """The root's blocks as (form, flat arrays in rank order, an int64 array of each rank's
    block shape), or Refused."""
    if isinstance(blocks, list | tuple):
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
        return _LIST, parts, shapes
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
    if blocks.ndim == 0 or blocks.shape[0] != n:
        shape = "a 0-d array" if blocks.ndim == 0 else f"shape {blocks.shape}"
        raise Refused(
            f"the root's array has {shape}; its first dimension must be world_size ({n}), "
            "one block per rank (pass a list of arrays for uneven blocks)"
        )
    if blocks.ndim - 1 > MAX_DIMS:
        raise Refused(f"blocks of more than {MAX_DIMS} dimensions are not supported")
    shapes = np.zeros((n, blocks.ndim - 1), dtype=np.int64)
    shapes[:] = blocks.shape[1:]
    return _ARRAY, [flat], shapes


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
    header = _blank_header(r, target)

    async def scatter_to_here(spec: OpSpec) -> None:
        rows = None
        if world.shm is not None:
            rows = await _copies.shm_disseminate(world, spec, header, _merge)
        else:
            await _algorithms.disseminate(world, spec, header, _merge)
        h = _check_header(world, spec, header, root)
        dtype = DTYPES[h[_DTYPE] - 1]

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
        if h[_FORM] == _LIST and rows is not None and _list_in_slot(rows[root], header.nbytes):
            _list_from_slot(rows[root], header.nbytes, n, h[_NDIM], root, r, prepare)
            shm_done(world, spec)
            if h[_ANY_OUT]:
                await _algorithms.barrier(world, spec)
            return
        if h[_FORM] == _ARRAY:
            shape = tuple(header[_SHAPE : _SHAPE + h[_NDIM]].tolist())
            count = h[_COUNT]
            if target is None:
                box.append(np.empty(shape, dtype=dtype))
                result = box[0].reshape(-1)
            else:
                box.append(out)  # type: ignore[arg-type]  # checked to be an ndarray
                result = target
            by = _scatter_by(world, forced, n * count * dtype.itemsize)
            if by == "shm":
                assert rows is not None
                # The root's slot holds every block but its own, after the header.
                at = HEADER_WORDS * 8 + (r - (r > root)) * count * dtype.itemsize
                result.view(np.uint8)[...] = rows[root, at : at + result.nbytes]
        if rows is not None and by not in ("cma", "pipe"):
            # The copy's end says done (the done words of the header round's publication).
            shm_done(world, spec)
        if by == "shm":
            return
        if h[_FORM] == _ARRAY:
            data = spec._replace(dtype_code=h[_DTYPE], count=count)
            if by == "cma":
                # With a segment, the root's address came with the header (and this rank's
                # done word waits for the end of the copy).
                announced = None if rows is None else _copies.scatter_words(rows, header.nbytes)
                await _copies.cma_scatter(world, data, None, result, root, announced)
                return
            if by == "pipe":
                await _pipe.pipe_scatter(world, data, None, result, root)
                return
            await _algorithms.tree_scatter(world, data, None, [count] * n, root, result)
            return
        data = spec._replace(dtype_code=h[_DTYPE])
        await _algorithms.tree_scatterv(world, data, root, h[_NDIM], None, None, prepare)
        if h[_ANY_OUT]:
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


def _list_in_slot(slot: np.ndarray, at: int) -> bool:
    """Whether the root's ``slot`` (bytes) holds the blocks of a list scatter after its
    header of ``at`` bytes (see :func:`_list_payload`)."""
    return bool(slot[at : at + _IN_SLOT.nbytes].view(np.int64)[0])


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


def _blank_header(rank: int, target: np.ndarray[Any, Any] | None) -> np.ndarray[Any, Any]:
    """The header as a rank starts it: nothing of the root's, and its own ``out=``."""
    header = _BLANK.copy()
    if target is not None:
        header[_ANY_OUT] = 1
        code = DTYPE_CODES[target.dtype]
        header[_DTYPE_MIN : _DTYPE_MAX + 2] = (code, rank, code, rank)
        header[_COUNT_MIN : _COUNT_MAX + 2] = (target.shape[0], rank, target.shape[0], rank)
    return header


#: The header of a rank that passed no ``out=``: nobody's dtype and count at the minima,
#: -1 (by nobody) at the maxima. Copied, not rebuilt: building it took 4.7 us (three fancy
#: indexings), copying it takes 0.35, in a scatter of a few bytes that takes 25-35 in all.
_BLANK = np.zeros(HEADER_WORDS, dtype=np.int64)
_BLANK[[_DTYPE_MIN, _DTYPE_MIN + 1, _COUNT_MIN, _COUNT_MIN + 1]] = _NOBODY
_BLANK[[_DTYPE_MAX, _COUNT_MAX]] = -1
_BLANK[[_DTYPE_MAX + 1, _COUNT_MAX + 1]] = _NOBODY


def _merge(mine: np.ndarray, theirs: np.ndarray) -> None:
    """Fold a peer's header into this rank's (idempotent, so the dissemination's overlaps
    in worlds that are not powers of two do no harm). Compared as Python ints: numpy
    scalars cost a few times more per comparison, and there are a dozen."""
    m, t = mine[:_SHAPE].tolist(), theirs[:_SHAPE].tolist()
    if not m[_KNOWN] and t[_KNOWN]:
        mine[_KNOWN:_ANY_OUT] = theirs[_KNOWN:_ANY_OUT]
        mine[_SHAPE:] = theirs[_SHAPE:]
    if t[_ANY_OUT] and not m[_ANY_OUT]:
        mine[_ANY_OUT] = 1
    for at in (_DTYPE_MIN, _COUNT_MIN):
        if (t[at], t[at + 1]) < (m[at], m[at + 1]):
            mine[at : at + 2] = theirs[at : at + 2]
    for at in (_DTYPE_MAX, _COUNT_MAX):
        if (t[at], -t[at + 1]) > (m[at], -m[at + 1]):
            mine[at : at + 2] = theirs[at : at + 2]


def _check_header(world: World, spec: OpSpec, header: np.ndarray, root: int) -> list[int]:
    """Raise, the same on every rank, unless the root's header is in and every ``out=``
    passed anywhere fits it; return the header's fields before the shape, as ints."""
    r = world.rank
    h: list[int] = header[:_SHAPE].tolist()
    code = h[_DTYPE]
    if (
        not h[_KNOWN]
        or not 0 < code <= len(DTYPES)
        or h[_FORM] not in (_ARRAY, _LIST)
        or not 0 <= h[_NDIM] <= MAX_DIMS
        or (h[_FORM] == _ARRAY and h[_COUNT] < 0)
    ):
        raise ProtocolError(
            f"rank {r}: {spec.kind.label} #{spec.seq}: no valid header from root {root}: {h}",
            rank=r,
            peer=root,
            job_id=job_id(world),
            collective=spec.kind.label,
            seq=spec.seq,
        )
    if not h[_ANY_OUT]:
        return h
    dtype = DTYPES[code - 1]
    what = f"{spec.kind.label}(root={root}) #{spec.seq}"
    for at in (_DTYPE_MIN, _DTYPE_MAX):
        if h[at] != code:
            peer = h[at + 1]
            other = DTYPES[h[at] - 1] if 0 < h[at] <= len(DTYPES) else "?"
            whose = "this rank's" if peer == r else f"rank {peer}'s"
            raise mismatch(
                world,
                spec,
                root if peer == r else peer,
                f"{what}: {whose} out= has dtype {other}, root {root} scatters {dtype.name}",
            )
    if h[_FORM] != _ARRAY:
        return h
    count = h[_COUNT]
    for at in (_COUNT_MIN, _COUNT_MAX):
        if h[at] != count:
            peer = h[at + 1]
            whose = "this rank's" if peer == r else f"rank {peer}'s"
            raise mismatch(
                world,
                spec,
                root if peer == r else peer,
                f"{what}: {whose} out= holds {h[at]} elements, root {root}'s blocks hold {count}",
            )
    return h


def _name(value: object) -> str:
    return type(value).__name__
