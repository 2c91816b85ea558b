"""The reductions through the shared segment's slots (allreduce, reduce_scatter, reduce): every
rank publishes its input with the protocol of :mod:`._shm_collectives`, then reduces the
slots it needs in one fixed order, recursive doubling's, so that every rank's result is
bitwise identical to every other's and to the socket path's."""

from __future__ import annotations

from typing import TYPE_CHECKING, final

import attrs
import numpy as np

from .._util import ignore_fp_errors
from ._shm_collectives import shm_done, shm_exchange

if TYPE_CHECKING:
    from .._algorithms import World
    from .._wire import OpSpec

__all__ = [
    "ReducePlan",
    "reduce_temporaries",
    "shm_allreduce",
    "shm_reduce",
    "shm_reduce_scatter",
    "shm_scan",
]


#: One step of a shared-memory reduction: ``reduce(a, b, out=out)``, where an ``out`` of
#: None stands for the caller's result, and an ``a`` or ``b`` of None for the caller's own
#: input, read where it lies instead of from its slot (both differ from call to call; the
#: plan is cached).
_Step = tuple["np.ndarray | None", "np.ndarray | None", "np.ndarray | None"]


@final
@attrs.frozen
class ReducePlan:
    """The steps of one shared-memory allreduce of a given slot, dtype and length, with the
    views they work on, made once (see :func:`shm_allreduce`)."""

    steps: tuple[_Step, ...]


def reduce_temporaries(world_size: int) -> int:
    """How many arrays of scratch the reduction of :func:`_reduce_plan` needs at most: two
    per level of the tree below the root, ``2 log2 p``, ``p`` the largest power of two <=
    ``world_size``."""
    return max(1, 2 * (world_size.bit_length() - 1))


def _reduce_plan(world: World, rows: np.ndarray, own: int = -1) -> ReducePlan:
    """Recursive doubling's order of operations over the ``(n, count)`` slot rows (row
    ``own``, if any, stands for the caller's input, which is not in its slot): leaf r is
    ``reduce(row r, row r + p)`` for the ranks folded in (``r < n - p``, ``p`` the largest
    power of two <= n) and row r otherwise, then neighbours pair up, lower first, level by
    level: the tree whose result the socket path's every rank ends with. Evaluated depth
    first, each node's halves into the two scratch arrays of the level below it, so it
    needs :func:`reduce_temporaries` arrays of scratch rather than a whole level's worth.
    No step works in place but where the caller's own input (``own``) is also its output
    (:func:`shm_allreduce` above one element, :func:`shm_reduce`'s root), and never for
    complex dtypes: numpy's in-place loop for one complex element rounds differently from
    its out-of-place one (seen with complex64 products); for real and integer dtypes it
    rounds each element the same either way."""
    n, count = rows.shape
    nbytes = count * rows.dtype.itemsize
    p = 1 << (n.bit_length() - 1)
    extra = n - p
    temporaries = [
        world.scratch[i * nbytes : (i + 1) * nbytes].view(rows.dtype)
        for i in range(reduce_temporaries(n))
    ]
    steps: list[_Step] = []

    def leaf(q: int) -> np.ndarray | None:
        return None if q == own else rows[q]

    def build(lo: int, size: int, dest: np.ndarray | None, level: int) -> np.ndarray | None:
        if size == 1:
            if lo < extra:
                steps.append((leaf(lo), leaf(lo + p), dest))
                return dest
            return leaf(lo)
        half = size // 2
        # Below the top, dest is a temporary: None here can only be the caller's input.
        left = build(lo, half, temporaries[2 * level], level + 1)
        right = build(lo + half, half, temporaries[2 * level + 1], level + 1)
        steps.append((left, right, dest))
        return dest

    build(0, p, None, 0)
    return ReducePlan(tuple(steps))


async def shm_allreduce(
    world: World,
    spec: OpSpec,
    flat: np.ndarray,
    reduce: np.ufunc,
    *,
    divide: bool,
) -> None:
    """Allreduce through the shared segment: every rank publishes its array, then reduces
    all of them in recursive doubling's order (see :func:`_reduce_plan`), so the result is
    bitwise identical on every rank, and to the socket path's. Needs
    :func:`reduce_temporaries` arrays' worth of scratch.

    Each rank reads its own values from ``flat``, where they lie, not back from its slot
    (in the same place among the operands, so the order of operations is every rank's),
    except for complex dtypes (see :func:`shm_reduce`) and one element (numpy reduces one
    element in place through a buffered loop, at 3x the cost). Its slot's lines, once a
    peer has read them, come back from the peer's core as slowly as the peer's own slot
    does: in ``bench/slot_lines.py`` (two processes, numpy and a shared mapping, nothing
    else) the reduction of 256 KiB at world 2 took 27.2 us reading both slots and 14.4-14.5
    reading the rank's own values from its array (64 KiB: 6.8-6.9 and 4.1). In trioring's
    64 KiB allreduce at world 2 (phase timers on both ranks) the reduction went from 10.6 us
    to 6.9. At world 2 in the same ranks as Open MPI (``bench/paired.py -n 2
    --collective allreduce``, three launches each, alternating with the code before,
    trioring's median): 256 KiB 46.9-49.4 us against 54.4-55.5, 64 KiB 27.3-28.9 against
    29.8-31.8, 4 KiB the same; at worlds 3 and 4 on 2 cores within the spread."""
    parity, rows = await shm_exchange(world, spec, flat)
    count = flat.shape[0]
    own = world.rank if count > 1 and flat.dtype.kind != "c" else -1
    _reduce_rows(world, (parity, flat.dtype, 0, count, own), rows, flat, reduce, divide, flat)
    shm_done(world, spec)


def _reduce_rows(
    world: World,
    key: tuple[int, np.dtype, int, int, int],
    rows: np.ndarray,
    out: np.ndarray,
    reduce: np.ufunc,
    divide: bool,
    mine: np.ndarray | None = None,
) -> None:
    """Reduce the ``(n, count)`` ``rows`` (slot rows, or a range of their columns) into
    ``out`` by the cached plan ``key`` names (slot parity, dtype, first and end column, and
    the row that ``mine``, this rank's input, stands for, or -1: none)."""
    plan = world.shm_plans.get(key)
    if plan is None:
        if len(world.shm_plans) >= 8:
            world.shm_plans.clear()
        plan = world.shm_plans[key] = _reduce_plan(world, rows, key[4])
    with ignore_fp_errors():
        for a, b, into in plan.steps:
            reduce(
                mine if a is None else a,
                mine if b is None else b,
                out=out if into is None else into,
            )
        if divide:
            np.divide(out, world.size, out=out)


async def shm_reduce_scatter(
    world: World,
    spec: OpSpec,
    flat: np.ndarray,
    bounds: list[int],
    out: np.ndarray,
    reduce: np.ufunc,
    *,
    divide: bool,
) -> None:
    """Reduce-scatter through the shared segment: every rank publishes its input, then
    reduces its own block ``[bounds[r], bounds[r + 1])`` of every rank's, in the order
    of :func:`_reduce_plan`, into ``out``. Blocks may differ in size (reduce_scatterv).
    A rank's own block is read where it lies, never from its slot, so only the blocks its
    peers read go there: 1/n of the copy in fewer. At world 2, in two runs of
    ``bench/paired.py`` alternating with the code before, 256 KiB took 36.5-36.7 us against
    38.5-38.6 (64 KiB: 26.5-27.1 against 27.2-27.3)."""
    r = world.rank
    lo, hi = bounds[r], bounds[r + 1]
    parity, rows = await shm_exchange(world, spec, flat, unread=(lo, hi))
    mine = flat[lo:hi]
    if world.size == 1:
        out[...] = mine
    # Never in place: ``out`` was checked not to overlap ``flat``.
    _reduce_rows(world, (parity, flat.dtype, lo, hi, r), rows[:, lo:hi], out, reduce, divide, mine)
    shm_done(world, spec)


async def shm_reduce(
    world: World,
    spec: OpSpec,
    flat: np.ndarray,
    root: int,
    reduce: np.ufunc,
    *,
    divide: bool,
) -> None:
    """Reduce through the shared segment: every rank publishes its array (and the call, so
    ranks that disagree about the root raise on every rank), the root reduces them all in
    the order of :func:`_reduce_plan` into its ``flat``; the others' arrays are only read.
    The root reads its own array where it lies, never from its slot, which it leaves
    unwritten, as :func:`~._copies.shm_gather`'s root does: one copy of the array fewer on
    the rank that does all the arithmetic. Except for complex dtypes: that reduces the
    root's array in place where its leaf meets the top of the tree, and numpy's in-place
    loops for complex numbers can round differently from its out-of-place ones (seen with
    complex64 products, see :func:`_reduce_plan`); real and integer arithmetic rounds each
    element the same either way. At world 2 (``bench/paired.py``, runs alternating with the
    code before) 64 KiB took 21.9-22.8 us against 24.9-25.6 (two runs), 256 KiB 37.3-37.6
    against 40.8-41.3 (two runs). The root, which waits for its peers' copies whatever
    happens, takes its schedule point while they copy (:func:`shm_point`): 64 KiB at world
    2 then took 20.5-20.9 us against 21.8-22.0 (4 bytes, 256 KiB even; a gather's root,
    which waits the same way, measured 1 us slower so, and keeps its wait's first look)."""
    own = root if flat.dtype.kind != "c" else -1
    parity, rows = await shm_exchange(
        world, spec, flat, write=world.rank != own, point=world.rank == own
    )
    if world.rank == root:
        key = (parity, flat.dtype, 0, flat.shape[0], own)
        _reduce_rows(world, key, rows, flat, reduce, divide, flat)
    shm_done(world, spec)


async def shm_scan(
    world: World,
    spec: OpSpec,
    flat: np.ndarray,
    reduce: np.ufunc,
    *,
    exclusive: bool,
    identity: np.ndarray | None,
) -> None:
    """Scan (or exscan) through the shared segment: every rank but the last publishes its
    array (nobody reads the last one's), then rank r folds what recursive doubling's rounds
    would have brought it from the ranks below, in the same order and with the same
    operations, in place where that algorithm works in place (see :func:`_partial`): the
    result is bitwise the socket path's (see ``_algorithms.recursive_doubling_scan``). Rank
    r reduces about r arrays, with at most ``log2 r`` temporaries at a time."""
    n, r = world.size, world.rank
    _, rows = await shm_exchange(world, spec, flat, write=r != n - 1)
    with ignore_fp_errors():
        have_result = not exclusive
        mask = 1
        while mask <= r:
            if r & mask:
                # The lower partner's partial: the aligned block of ``mask`` ranks below.
                incoming = _partial(rows, r ^ mask, mask.bit_length() - 1, reduce)
                if have_result:
                    reduce(incoming, flat, out=flat)
                else:
                    flat[...] = incoming
                    have_result = True
            mask <<= 1
        if not have_result:  # rank 0 of an exscan
            flat[...] = identity
    shm_done(world, spec)


def _partial(rows: np.ndarray, q: int, rounds: int, reduce: np.ufunc) -> np.ndarray:
    """Rank ``q``'s partial after its first ``rounds`` rounds of recursive doubling (the
    reduction of the aligned block of ``2**rounds`` ranks around it), computed as rank q
    computes it: its partner's on the left where the partner is lower, in place on its own
    (numpy's in-place loops can round differently from its out-of-place ones for complex
    numbers). A row of the slots when ``rounds`` is 0 (read only), else a new array."""
    if rounds == 0:
        row: np.ndarray = rows[q]
        return row
    partner = q ^ (1 << (rounds - 1))
    mine = _partial(rows, q, rounds - 1, reduce)
    if rounds == 1:
        mine = mine.copy()  # a slot row: the partial starts as a copy of the input
    theirs = _partial(rows, partner, rounds - 1, reduce)
    if partner < q:
        reduce(theirs, mine, out=mine)
    else:
        reduce(mine, theirs, out=mine)
    return mine
