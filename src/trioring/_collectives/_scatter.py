"""Scatter and scatterv: their argument checks, what every rank must agree on and how each
call finds out, and the call into the algorithm that the decision table (or forcing) picked.
The contracts are the docstrings of :meth:`trioring.Communicator.scatter` and
:meth:`~trioring.Communicator.scatterv`.

Only the root knows the dtype and shapes, so the first round is a dissemination of a fixed
header of ``HEADER_WORDS`` int64s (through the shared segment where there is one: every
rank publishes its header and, once all are there, folds them in one pass, see
:func:`_fold`; otherwise by frames of dtype int64 and count ``HEADER_WORDS``, round k
sending to rank + 2^k, each rank merging what it receives). The root's header travels with
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

import functools
import math
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import _algorithms
from .._errors import ProtocolError
from .._onehost import _copies, _pipe
from .._onehost._shm import SHM_MAX_BYTES
from .._onehost._shm_collectives import shm_done
from .._wire import DTYPE_CODES, DTYPES, MAX_NDIM
from . import _decision
from ._checks import Refused, check_array, check_out, check_root
from ._counts import job_id, mismatch
from ._gather import same_memory

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Sequence

    from .._algorithms import World
    from .._wire import OpSpec
    from ._checks import Plan

__all__ = ["HEADER_WORDS", "MAX_DIMS", "SHM_SCATTER_BYTES", "plan_scatter"]

#: The most dimensions a scattered block may have (numpy's own limit).
MAX_DIMS = MAX_NDIM
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
_HEADER_BYTES = HEADER_WORDS * 8
_FIELDS_BYTES = _SHAPE * 8
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
        return box, body, (0, 0, 0, checked_root, None)
    # A list of blocks comes with their shapes; one array (None here) has equal rows.
    shapes: np.ndarray[Any, Any] | None = None
    fields: tuple[int, int, int, tuple[int, ...] | None]
    if isinstance(blocks, (list, tuple)):  # (a tuple: ``list | tuple`` is made per call)
        parts, shapes = _check_list(blocks, n)
        own_shape = tuple(shapes[r].tolist())
        fields = (DTYPE_CODES[parts[0].dtype], _LIST, shapes.shape[1], None)
    else:
        flat, own_shape = _check_rows(blocks, n, uneven=uneven)
        parts = [flat]
        fields = (DTYPE_CODES[flat.dtype], _ARRAY, len(own_shape), own_shape)
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
    header = _start_header(r, fields, _out_fields(result if out is not None else None))

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
        h, _, slots = await _header_round(world, spec, header, checked_root, payload)
        if slots is not None:
            if by == "cma":
                announced = _copies.scatter_words(world, spec, _HEADER_BYTES)
            elif by != "pipe":
                shm_done(world, spec)
        any_out = h[_ANY_OUT]
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
    start = _start_header(r, None, _out_fields(target))

    async def scatter_to_here(spec: OpSpec) -> None:
        h, header, slots = await _header_round(world, spec, start, root)
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
        if h[_FORM] == _LIST and slots is not None and _list_in_slot(slots[root], _HEADER_BYTES):
            _list_from_slot(
                _copies.slot_bytes(world, spec)[root], _HEADER_BYTES, n, h[_NDIM], root, r, prepare
            )
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
            if by == "shm" and result.nbytes:
                assert slots is not None
                # The root's slot holds every block but its own, after the header.
                at = _HEADER_BYTES + (r - (r > root)) * count * dtype.itemsize
                result.data.cast("B")[:] = slots[root][at : at + result.nbytes]
        if slots is not None and by not in ("cma", "pipe"):
            # The copy's end says done (the done words of the header round's publication).
            shm_done(world, spec)
        if by == "shm":
            return
        if h[_FORM] == _ARRAY:
            data = spec._replace(dtype_code=h[_DTYPE], count=count)
            if by == "cma":
                # With a segment, the root's address came with the header (and this rank's
                # done word waits for the end of the copy).
                announced = (
                    None if slots is None else _copies.scatter_words(world, spec, _HEADER_BYTES)
                )
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


#: The header of a rank that passed no ``out=``, and not the root: nobody's dtype and
#: count at the minima, -1 (by nobody) at the maxima; what :func:`_start_header` starts
#: from.
_BLANK = np.zeros(HEADER_WORDS, dtype=np.int64)
_BLANK[[_DTYPE_MIN, _DTYPE_MIN + 1, _COUNT_MIN, _COUNT_MIN + 1]] = _NOBODY
_BLANK[[_DTYPE_MAX, _COUNT_MAX]] = -1
_BLANK[[_DTYPE_MAX + 1, _COUNT_MAX + 1]] = _NOBODY


def _out_fields(target: np.ndarray[Any, Any] | None) -> tuple[int, int] | None:
    """What a rank's header says of its ``out=`` (its flat view ``target``): dtype code and
    element count; None without one."""
    return None if target is None else (DTYPE_CODES[target.dtype], target.shape[0])


@functools.lru_cache(maxsize=64)
def _start_header(
    rank: int,
    root: tuple[int, int, int, tuple[int, ...] | None] | None,
    out: tuple[int, int] | None,
) -> np.ndarray[Any, Any]:
    """The header ``rank`` starts the round with (read-only: through the segment it is
    published as it is, over sockets :func:`_header_round` folds into a copy). ``root``:
    on the root, its dtype code, form, the blocks' number of dimensions and, for one
    array, the block shape (None for a list); None elsewhere. ``out``: see
    :func:`_out_fields`. Kept for the calls a program makes again and again: setting the
    fields one by one took 2-3 us of a 4-byte scatter of 20 (numpy item assignments)."""
    header = _BLANK.copy()
    if root is not None:
        code, form, ndim, shape = root
        header[_KNOWN], header[_DTYPE], header[_FORM], header[_NDIM] = 1, code, form, ndim
        header[_COUNT] = -1 if shape is None else math.prod(shape)
        if shape is not None:
            header[_SHAPE : _SHAPE + ndim] = shape
    if out is not None:
        code, count = out
        header[_ANY_OUT] = 1
        header[_DTYPE_MIN : _DTYPE_MAX + 2] = (code, rank, code, rank)
        header[_COUNT_MIN : _COUNT_MAX + 2] = (count, rank, count, rank)
    header.flags.writeable = False
    return header


async def _header_round(
    world: World,
    spec: OpSpec,
    start: np.ndarray[Any, Any],
    root: int,
    payload: Sequence[np.ndarray[Any, Any]] = (),
) -> tuple[list[int], np.ndarray[Any, Any] | memoryview, list[memoryview] | None]:
    """The header round from this rank's ``start`` (see :func:`_start_header`; the root
    publishes ``payload`` after it where there is a segment). Returns the folded header's
    fields before the shape, checked the same on every rank (:func:`_check_header`); the
    root's header as int64s, whose shape words hold the block shape of one array (through
    the segment, a view of the root's slot, valid until this rank says done); and every
    rank's slot as bytes (what :func:`_copies.shm_post` returns), or None without a
    segment.

    Through the segment every rank's header is there at once, so the fold is one pass over
    them (:func:`_fold`) instead of a merge per peer, and when nobody passed ``out=`` (the
    usual call) it is the root's fields as they stand: merging each peer's took 2 us at
    world 2, in a 4-byte scatter of 20."""
    if world.shm is None:
        merged = start.copy()
        await _algorithms.disseminate(world, spec, merged, _merge)
        return _check_header(world, spec, merged[:_SHAPE].tolist(), root), merged, None
    slots = await _copies.shm_post(world, spec, start, payload)
    # Read as the memoryviews shm_post returns, not as numpy views of every slot (the
    # states, the bytes): the root waits for nobody, so its every microsecond is the call's.
    # With the mismatch message made only on a mismatch, a 4-byte scatter at world 2 took
    # 37.4-38.9 us back to back against 40.1-43.5 (three launches each, alternating), and
    # in bench/paired.py 43.0 against 44.9 (64 KiB 45.9 against 49.4, 256 KiB 54.6 against
    # 58.5).
    fields = _fold([slot[:_FIELDS_BYTES].cast("q").tolist() for slot in slots], root)
    header = slots[root][:_HEADER_BYTES].cast("q")
    return _check_header(world, spec, fields, root), header, slots


def _fold(states: list[list[int]], root: int) -> list[int]:
    """Every rank's header fields before the shape (``states``, in rank order) folded into
    one, as :func:`_merge` folds them pairwise: the root's, with the least and greatest
    ``out=`` dtype code and element count (ties to the lowest rank) where any rank passed
    one. Where every ``out=`` fits the root's blocks (the usual call that passes them),
    each extreme is the root's dtype and count, and which rank holds it changes nothing
    that :func:`_check_header` does: the first rank that passed one stands for all, and
    the search for the extremes (2 us at world 2, in a 4-byte scatter of 20) is left out."""
    folded = states[root]
    code, count, array = folded[_DTYPE], folded[_COUNT], folded[_FORM] == _ARRAY
    first, fits = -1, True
    for q, state in enumerate(states):
        if state[_ANY_OUT]:
            if first < 0:
                first = q
            if state[_DTYPE_MIN] != code or (array and state[_COUNT_MIN] != count):
                fits = False
    if first < 0:
        return folded
    folded = list(folded)
    folded[_ANY_OUT] = 1
    if fits:
        folded[_DTYPE_MIN:_SHAPE] = states[first][_DTYPE_MIN:_SHAPE]
        return folded
    for state in states:
        _take_extremes(folded, state)
    return folded


def _take_extremes(folded: list[int], state: list[int]) -> bool:
    """Fold one rank's ``out=`` extremes (header fields as ints) into ``folded``'s: the
    least and greatest dtype code and element count, ties to the lowest rank. Whether
    ``folded`` changed."""
    changed = False
    for at in (_DTYPE_MIN, _COUNT_MIN):
        if (state[at], state[at + 1]) < (folded[at], folded[at + 1]):
            folded[at : at + 2], changed = state[at : at + 2], True
    for at in (_DTYPE_MAX, _COUNT_MAX):
        if (state[at], -state[at + 1]) > (folded[at], -folded[at + 1]):
            folded[at : at + 2], changed = state[at : at + 2], True
    return changed


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
    if _take_extremes(m, t):
        mine[_DTYPE_MIN:_SHAPE] = m[_DTYPE_MIN:_SHAPE]


def _check_header(world: World, spec: OpSpec, h: list[int], root: int) -> list[int]:
    """Raise, the same on every rank, unless the root's header is in and every ``out=``
    passed anywhere fits it (``h``: the folded header's fields before the shape, as ints);
    return ``h``."""
    r = world.rank
    code = h[_DTYPE]
    if (
        not h[_KNOWN]
        or not 0 < code <= len(DTYPES)
        or h[_FORM] not in (_ARRAY, _LIST)
        or not 0 <= h[_NDIM] <= MAX_DIMS
        or (h[_FORM] == _ARRAY and h[_COUNT] < 0)
    ):
        raise ProtocolError(
            f"rank {r}: {spec.named()}: no valid header from root {root}: {h}",
            rank=r,
            peer=root,
            job_id=job_id(world),
            collective=spec.kind.label,
            seq=spec.seq,
        )
    if not h[_ANY_OUT]:
        return h
    dtype = DTYPES[code - 1]
    for at in (_DTYPE_MIN, _DTYPE_MAX):
        if h[at] != code:
            peer = h[at + 1]
            other = DTYPES[h[at] - 1] if 0 < h[at] <= len(DTYPES) else "?"
            raise mismatch(
                world,
                spec,
                root if peer == r else peer,
                f"{_what(spec, root, peer, r)} out= has dtype {other}, root {root} scatters "
                f"{dtype.name}",
            )
    if h[_FORM] != _ARRAY:
        return h
    count = h[_COUNT]
    for at in (_COUNT_MIN, _COUNT_MAX):
        if h[at] != count:
            peer = h[at + 1]
            raise mismatch(
                world,
                spec,
                root if peer == r else peer,
                f"{_what(spec, root, peer, r)} out= holds {h[at]} elements, root {root}'s "
                f"blocks hold {count}",
            )
    return h


def _what(spec: OpSpec, root: int, peer: int, rank: int) -> str:
    """The start of a mismatch's message: the call, and whose ``out=`` does not fit (made
    only when one does not: the string cost 1 us of every 4-byte scatter that passed
    ``out=``)."""
    whose = "this rank's" if peer == rank else f"rank {peer}'s"
    return f"{spec.kind.label}(root={root}) #{spec.seq}: {whose}"


def _name(value: object) -> str:
    return type(value).__name__
