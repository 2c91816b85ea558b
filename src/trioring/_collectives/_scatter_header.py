"""The scatter's header: its layout, and the round in which every rank learns the root's
dtype and block shape and whether every ``out=`` fits (see _scatter, whose calls start
with it). Through the shared segment every rank publishes its header and all fold them in
one pass (:func:`fold`); otherwise a dissemination merges them pairwise (:func:`merge`),
to the same result on every rank."""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import _algorithms
from .._errors import ProtocolError
from .._onehost import _copies
from .._wire import DTYPE_CODES, DTYPES, MAX_NDIM
from ._counts import job_id, mismatch

if TYPE_CHECKING:
    from collections.abc import Sequence

    from .._algorithms import World
    from .._wire import OpSpec

__all__ = [
    "ANY_OUT",
    "ARRAY",
    "COUNT",
    "DTYPE",
    "FORM",
    "HEADER_BYTES",
    "HEADER_WORDS",
    "LIST",
    "MAX_DIMS",
    "NDIM",
    "SHAPE",
    "check_header",
    "fold",
    "header_round",
    "merge",
    "out_fields",
    "start_header",
]

#: The most dimensions a scattered block may have (numpy's own limit).
MAX_DIMS = MAX_NDIM
# The scatter header, one int64 each: whether the root's part is in, the root's dtype code,
# form (0: one array, 1: a list), the blocks' number of dimensions, the elements per block
# (one array; -1 for a list), whether any rank passed out=; then (value, rank) pairs: the
# least and greatest out= dtype code, the least and greatest out= element count; then the
# block shape (one array).
KNOWN, DTYPE, FORM, NDIM, COUNT, ANY_OUT = range(6)
DTYPE_MIN, DTYPE_MAX, COUNT_MIN, COUNT_MAX = 6, 8, 10, 12
SHAPE = 14
#: The header's length, in int64s.
HEADER_WORDS = SHAPE + MAX_DIMS
_NOBODY = 2**62  # the rank (and least value) where nobody passed out=
HEADER_BYTES = HEADER_WORDS * 8
FIELDS_BYTES = SHAPE * 8
ARRAY, LIST = 0, 1


#: The header of a rank that passed no ``out=``, and not the root: nobody's dtype and
#: count at the minima, -1 (by nobody) at the maxima; what :func:`start_header` starts
#: from.
_BLANK = np.zeros(HEADER_WORDS, dtype=np.int64)
_BLANK[[DTYPE_MIN, DTYPE_MIN + 1, COUNT_MIN, COUNT_MIN + 1]] = _NOBODY
_BLANK[[DTYPE_MAX, COUNT_MAX]] = -1
_BLANK[[DTYPE_MAX + 1, COUNT_MAX + 1]] = _NOBODY


def out_fields(target: np.ndarray[Any, Any] | None) -> tuple[int, int] | None:
    """What a rank's header says of its ``out=`` (its flat view ``target``): dtype code and
    element count; None without one."""
    return None if target is None else (DTYPE_CODES[target.dtype], target.shape[0])


@functools.lru_cache(maxsize=64)
def start_header(
    rank: int,
    root: tuple[int, int, int, tuple[int, ...] | None] | None,
    out: tuple[int, int] | None,
) -> np.ndarray[Any, Any]:
    """The header ``rank`` starts the round with (read-only: through the segment it is
    published as it is, over sockets :func:`header_round` folds into a copy). ``root``:
    on the root, its dtype code, form, the blocks' number of dimensions and, for one
    array, the block shape (None for a list); None elsewhere. ``out``: see
    :func:`out_fields`. Kept for the calls a program makes again and again: setting the
    fields one by one took 2-3 us of a 4-byte scatter of 20 (numpy item assignments)."""
    header = _BLANK.copy()
    if root is not None:
        code, form, ndim, shape = root
        header[KNOWN], header[DTYPE], header[FORM], header[NDIM] = 1, code, form, ndim
        header[COUNT] = -1 if shape is None else math.prod(shape)
        if shape is not None:
            header[SHAPE : SHAPE + ndim] = shape
    if out is not None:
        code, count = out
        header[ANY_OUT] = 1
        header[DTYPE_MIN : DTYPE_MAX + 2] = (code, rank, code, rank)
        header[COUNT_MIN : COUNT_MAX + 2] = (count, rank, count, rank)
    header.flags.writeable = False
    return header


async def header_round(
    world: World,
    spec: OpSpec,
    start: np.ndarray[Any, Any],
    root: int,
    payload: Sequence[np.ndarray[Any, Any]] = (),
) -> tuple[list[int], np.ndarray[Any, Any] | memoryview, list[memoryview] | None]:
    """The header round from this rank's ``start`` (see :func:`start_header`; the root
    publishes ``payload`` after it where there is a segment). Returns the folded header's
    fields before the shape, checked the same on every rank (:func:`check_header`); the
    root's header as int64s, whose shape words hold the block shape of one array (through
    the segment, a view of the root's slot, valid until this rank says done); and every
    rank's slot as bytes (what :func:`_copies.shm_post` returns), or None without a
    segment.

    Through the segment every rank's header is there at once, so the fold is one pass over
    them (:func:`fold`) instead of a merge per peer, and when nobody passed ``out=`` (the
    usual call) it is the root's fields as they stand: merging each peer's took 2 us at
    world 2, in a 4-byte scatter of 20."""
    if world.shm is None:
        merged = start.copy()
        await _algorithms.disseminate(world, spec, merged, merge)
        return check_header(world, spec, merged[:SHAPE].tolist(), root), merged, None
    slots = await _copies.shm_post(world, spec, start, payload)
    # Read as the memoryviews shm_post returns, not as numpy views of every slot (the
    # states, the bytes): the root waits for nobody, so its every microsecond is the call's.
    # With the mismatch message made only on a mismatch, a 4-byte scatter at world 2 took
    # 37.4-38.9 us back to back against 40.1-43.5 (three launches each, alternating), and
    # in bench/paired.py 43.0 against 44.9 (64 KiB 45.9 against 49.4, 256 KiB 54.6 against
    # 58.5).
    fields = fold([slot[:FIELDS_BYTES].cast("q").tolist() for slot in slots], root)
    header = slots[root][:HEADER_BYTES].cast("q")
    return check_header(world, spec, fields, root), header, slots


def fold(states: list[list[int]], root: int) -> list[int]:
    """Every rank's header fields before the shape (``states``, in rank order) folded into
    one, as :func:`merge` folds them pairwise: the root's, with the least and greatest
    ``out=`` dtype code and element count (ties to the lowest rank) where any rank passed
    one. Where every ``out=`` fits the root's blocks (the usual call that passes them),
    each extreme is the root's dtype and count, and which rank holds it changes nothing
    that :func:`check_header` does: the first rank that passed one stands for all, and
    the search for the extremes (2 us at world 2, in a 4-byte scatter of 20) is left out."""
    folded = states[root]
    code, count, array = folded[DTYPE], folded[COUNT], folded[FORM] == ARRAY
    first, fits = -1, True
    for q, state in enumerate(states):
        if state[ANY_OUT]:
            if first < 0:
                first = q
            if state[DTYPE_MIN] != code or (array and state[COUNT_MIN] != count):
                fits = False
    if first < 0:
        return folded
    folded = list(folded)
    folded[ANY_OUT] = 1
    if fits:
        folded[DTYPE_MIN:SHAPE] = states[first][DTYPE_MIN:SHAPE]
        return folded
    for state in states:
        _take_extremes(folded, state)
    return folded


def _take_extremes(folded: list[int], state: list[int]) -> bool:
    """Fold one rank's ``out=`` extremes (header fields as ints) into ``folded``'s: the
    least and greatest dtype code and element count, ties to the lowest rank. Whether
    ``folded`` changed."""
    changed = False
    for at in (DTYPE_MIN, COUNT_MIN):
        if (state[at], state[at + 1]) < (folded[at], folded[at + 1]):
            folded[at : at + 2], changed = state[at : at + 2], True
    for at in (DTYPE_MAX, COUNT_MAX):
        if (state[at], -state[at + 1]) > (folded[at], -folded[at + 1]):
            folded[at : at + 2], changed = state[at : at + 2], True
    return changed


def merge(mine: np.ndarray, theirs: np.ndarray) -> None:
    """Fold a peer's header into this rank's (idempotent, so the dissemination's overlaps
    in worlds that are not powers of two do no harm). Compared as Python ints: numpy
    scalars cost a few times more per comparison, and there are a dozen."""
    m, t = mine[:SHAPE].tolist(), theirs[:SHAPE].tolist()
    if not m[KNOWN] and t[KNOWN]:
        mine[KNOWN:ANY_OUT] = theirs[KNOWN:ANY_OUT]
        mine[SHAPE:] = theirs[SHAPE:]
    if t[ANY_OUT] and not m[ANY_OUT]:
        mine[ANY_OUT] = 1
    if _take_extremes(m, t):
        mine[DTYPE_MIN:SHAPE] = m[DTYPE_MIN:SHAPE]


def check_header(world: World, spec: OpSpec, h: list[int], root: int) -> list[int]:
    """Raise, the same on every rank, unless the root's header is in and every ``out=``
    passed anywhere fits it (``h``: the folded header's fields before the shape, as ints);
    return ``h``."""
    r = world.rank
    code = h[DTYPE]
    if (
        not h[KNOWN]
        or not 0 < code <= len(DTYPES)
        or h[FORM] not in (ARRAY, LIST)
        or not 0 <= h[NDIM] <= MAX_DIMS
        or (h[FORM] == ARRAY and h[COUNT] < 0)
    ):
        raise ProtocolError(
            f"rank {r}: {spec.named()}: no valid header from root {root}: {h}",
            rank=r,
            peer=root,
            job_id=job_id(world),
            collective=spec.kind.label,
            seq=spec.seq,
        )
    if not h[ANY_OUT]:
        return h
    dtype = DTYPES[code - 1]
    for at in (DTYPE_MIN, DTYPE_MAX):
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
    if h[FORM] != ARRAY:
        return h
    count = h[COUNT]
    for at in (COUNT_MIN, COUNT_MAX):
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
