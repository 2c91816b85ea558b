"""The reduce family: reduce_scatter, reduce_scatterv and reduce. Their checks (the ops and
their dtype rules are allreduce's), what every rank must agree on, and the call into the
algorithm the decision table (or forcing) picked. The contracts are the docstrings of
:meth:`trioring.Communicator.reduce_scatter`, :meth:`~trioring.Communicator.reduce_scatterv`
and :meth:`~trioring.Communicator.reduce`.

What must agree is carried in every frame's call identity: the dtype, the op and the
element count of the input for all three, the root for reduce, and for reduce_scatterv the
counts themselves, as a 31-bit CRC-32 of them in the frame's root field (which
reduce_scatterv has no other use for): ranks that pass different counts raise
CollectiveMismatchError, whether or not the totals agree (unless the counts collide in
CRC-32, a chance of 2**-31 per disagreement).
"""

from __future__ import annotations

import zlib
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import _algorithms
from .._onehost import _cma_reductions, _pipe, _push, _shm_reductions
from .._wire import DTYPE_CODES, NO_ROOT
from . import _decision
from ._allreduce import OP_CODES, UFUNCS, ReduceOp, check
from ._checks import Refused, agree, check_out, check_root

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from .._algorithms import World
    from .._wire import OpSpec
    from ._checks import Identity, Plan

__all__ = [
    "check_reduce",
    "check_reduce_scatter",
    "check_reduce_scatterv",
    "plan_reduce",
    "plan_reduce_scatter",
    "reduce_body",
    "reduce_scatter_body",
    "shm_limit",
    "small_bytes",
    "unrunnable",
]


def check_reduce_scatter(
    array: object, op: object, out: object, world_size: int
) -> tuple[np.ndarray[Any, Any], ReduceOp, np.ndarray[Any, Any], np.ndarray[Any, Any], list[int]]:
    """(input as a flat view, op, result array, its flat view, block bounds), or Refused.

    The result has shape ``array.shape[1:]`` when ``array`` has at least two dimensions and
    ``world_size`` rows, else ``(array.size // world_size,)``; ``out`` replaces it when
    given (any shape with that many elements)."""
    flat, reduce_op = check(array, op)
    total = flat.shape[0]
    if total % world_size:
        raise Refused(
            f"the array's {total} elements do not split into {world_size} equal blocks "
            "(its size must be a multiple of world_size; use reduce_scatterv for uneven "
            "blocks)"
        )
    block = total // world_size
    assert isinstance(array, np.ndarray)  # checked above
    if out is None:
        shape = array.shape[1:] if array.ndim >= 2 and array.shape[0] == world_size else (block,)
        result = np.empty(shape, flat.dtype)
        result_flat = result.reshape(-1)
    else:
        result_flat = check_out(out, flat.dtype, block, flat)
        result = out  # type: ignore[assignment]  # checked to be an ndarray
    bounds = list(range(0, total + 1, block)) if block else [0] * (world_size + 1)
    return flat, reduce_op, result, result_flat, bounds


def check_counts(counts: object, world_size: int, total: int) -> list[int]:
    """``counts`` as a list of ``world_size`` non-negative ints summing to ``total``, or
    Refused."""
    if isinstance(counts, np.ndarray):
        counts = counts.tolist()
    if not isinstance(counts, list | tuple):
        raise Refused(f"counts must be a sequence of {world_size} ints, got {counts!r}")
    if len(counts) != world_size:
        raise Refused(f"counts has {len(counts)} entries, expected world_size ({world_size})")
    checked: list[int] = []
    for count in counts:
        if isinstance(count, bool) or not isinstance(count, int | np.integer) or count < 0:
            raise Refused(f"counts must be non-negative ints, got {count!r}")
        checked.append(int(count))
    if sum(checked) != total:
        raise Refused(f"counts sum to {sum(checked)}, but the array has {total} elements")
    return checked


def counts_code(counts: list[int]) -> int:
    """The 31-bit CRC-32 of ``counts`` that reduce_scatterv's frames carry."""
    return zlib.crc32(np.asarray(counts, dtype="<i8").tobytes()) & 0x7FFFFFFF


def check_reduce_scatterv(
    array: object, counts: object, op: object, out: object, world_size: int, rank: int
) -> tuple[
    np.ndarray[Any, Any], ReduceOp, np.ndarray[Any, Any], np.ndarray[Any, Any], list[int], int
]:
    """(input as a flat view, op, result array, its flat view, block bounds, counts code),
    or Refused. The result is 1-D, of ``counts[rank]`` elements, unless ``out`` is given."""
    flat, reduce_op = check(array, op)
    checked = check_counts(counts, world_size, flat.shape[0])
    mine = checked[rank]
    if out is None:
        result = result_flat = np.empty(mine, flat.dtype)
    else:
        result_flat = check_out(out, flat.dtype, mine, flat)
        result = out  # type: ignore[assignment]  # checked to be an ndarray
    bounds = [0]
    for count in checked:
        bounds.append(bounds[-1] + count)
    return flat, reduce_op, result, result_flat, bounds, counts_code(checked)


def small_bytes(world: World) -> int:
    """The largest input recursive halving reduce-scatters here: it sends each half in one
    frame, through the scratch buffer (one chunk)."""
    return min(_decision.SMALL_REDUCE_SCATTER_BYTES, world.scratch.nbytes)


def shm_limit(world: World, *, scatter: bool = False) -> int:
    """The largest input the decision table sends through the segment's slots here for a
    reduce, or (``scatter``) a reduce_scatter (-1: no shared segment): up to the whole slot
    and the scratch the reduction needs, but allreduce's share for a reduce_scatter where
    some rank is crowded (see _onehost._shm.SLOT_PAYLOAD_BYTES)."""
    slots = world.shm
    if slots is None:
        return -1
    # Both worked out when the communicator was made (see _allreduce.shm_bytes).
    return world.slot_reduce_bytes if scatter and slots.crowded else world.slot_wide_reduce_bytes


def unrunnable(collective: str, name: str, world: World, nbytes: int) -> str | None:
    """Why the forced algorithm ``name`` cannot run this reduce_scatter(v) or reduce of
    ``nbytes`` here; None if it can."""
    if name == "shm":
        if world.shm is None:
            return f"the forced {collective} algorithm 'shm' needs the \"shm\" feature"
        if nbytes > (most := world.slot_wide_reduce_bytes):
            return (
                f"the forced {collective} algorithm 'shm' takes arrays of at most "
                f"{most} bytes here, not {nbytes}"
            )
        return None
    if name == "cma":
        if world.peer_pids is None:
            return f"the forced {collective} algorithm 'cma' needs the \"cma\" feature"
        return None
    if name == "pipe":
        if world.shm is None:
            return f"the forced {collective} algorithm 'pipe' needs the \"shm\" feature"
        return None
    if name == "recursive_halving" and world.size > 1 and nbytes > world.scratch.nbytes:
        return (
            f"the forced {collective} algorithm 'recursive_halving' takes arrays of at most "
            f"chunk_bytes ({world.scratch.nbytes}) bytes, not {nbytes}"
        )
    return None


def check_reduce(
    array: object, op: object, root: object, world_size: int
) -> tuple[np.ndarray[Any, Any], ReduceOp, int]:
    """(flat view, op, root), or Refused."""
    root = check_root(root, world_size)
    flat, reduce_op = check(array, op)
    return flat, reduce_op, root


def reduce_scatter_body(
    name: str,
    world: World,
    flat: np.ndarray,
    bounds: list[int],
    out: np.ndarray,
    reduce_op: ReduceOp,
) -> Callable[[OpSpec], Awaitable[None]]:
    """The Communicator's step that reduce-scatters ``flat`` into ``out`` by the algorithm
    ``name`` (``"shm"``, ``"pipe"``, ``"cma"``, ``"recursive_halving"`` or ``"ring"``), for
    reduce_scatter and reduce_scatterv alike."""
    if name == "shm":
        algorithm = _shm_reductions.shm_reduce_scatter
    elif name == "pipe":
        algorithm = _pipe.pipe_reduce_scatter
    elif name == "cma":
        algorithm = _cma_reductions.cma_reduce_scatter
    elif name == "recursive_halving":
        algorithm = _algorithms.recursive_halving_reduce_scatter
    else:
        algorithm = _algorithms.ring_reduce_scatter
    ufunc, divide = UFUNCS[reduce_op], reduce_op is ReduceOp.MEAN

    async def run(spec: OpSpec) -> None:
        await algorithm(world, spec, flat, bounds, out, ufunc, divide=divide)

    return run


def reduce_body(
    name: str, world: World, flat: np.ndarray, root: int, reduce_op: ReduceOp
) -> Callable[[OpSpec], Awaitable[None]]:
    """The Communicator's step that reduces ``flat`` into root's by the algorithm ``name``
    (``"shm"``, ``"pipe"``, ``"cma"``, ``"tree"`` or ``"reduce_scatter_gather"``, whose reduce-scatter is the one
    the reduce_scatter row picks for ``flat``'s size among the socket algorithms, so that it
    runs at any size)."""
    ufunc, divide = UFUNCS[reduce_op], reduce_op is ReduceOp.MEAN
    if name == "shm":

        async def through_the_segment(spec: OpSpec) -> None:
            await _shm_reductions.shm_reduce(world, spec, flat, root, ufunc, divide=divide)

        return through_the_segment
    if name == "pipe":

        async def through_the_pipe(spec: OpSpec) -> None:
            # Its publication agrees on the call, the root included.
            await _pipe.pipe_reduce(world, spec, flat, root, ufunc, divide=divide)

        return through_the_pipe
    if name == "reduce_scatter_gather":
        halving = _decision.reduce_scatter(flat.nbytes, small_bytes(world)) != "ring"

        async def reduce_scatter_then_gather(spec: OpSpec) -> None:
            # No agreement round: the reduce-scatter's first frames go to rank r+1 (the
            # ring's step, recursive halving's first round), and they carry the root, so
            # ranks that disagree about it find out there, before anyone waits for the root.
            await _algorithms.reduce_scatter_gather(
                world, spec, flat, root, ufunc, divide=divide, halving=halving
            )

        return reduce_scatter_then_gather
    assert name in ("tree", "cma"), name

    async def agree_then_reduce(spec: OpSpec) -> None:
        # In a tree, ranks that disagree about the root could each wait for the other's
        # data forever.
        await agree(world, spec, name)
        if name == "cma":
            await _cma_reductions.cma_reduce(world, spec, flat, root, ufunc, divide=divide)
        else:
            await _algorithms.tree_reduce(world, spec, flat, root, ufunc, divide=divide)

    return agree_then_reduce


def plan_reduce_scatter(
    collective: str,
    world: World,
    forced: str | None,
    array: object,
    op: object,
    out: object,
    counts: object = None,
) -> Plan[np.ndarray[Any, Any]]:
    """Everything reduce_scatter (``counts`` None) or reduce_scatterv needs before any I/O:
    the checks, the algorithm (``forced``, or the table's), the step and the identity; or
    Refused."""
    code = NO_ROOT
    if counts is None:
        flat, reduce_op, result, result_flat, bounds = check_reduce_scatter(
            array, op, out, world.size
        )
    else:
        flat, reduce_op, result, result_flat, bounds, code = check_reduce_scatterv(
            array, counts, op, out, world.size, world.rank
        )
    if forced is None:
        name = _decision.reduce_scatter(
            flat.nbytes,
            small_bytes(world),
            shm_limit(world, scatter=True),
            world.peer_pids is not None,
        )
    elif (why := unrunnable(collective, forced, world, flat.nbytes)) is not None:
        raise Refused(why)
    else:
        name = forced
    body = reduce_scatter_body(name, world, flat, bounds, result_flat, reduce_op)
    identity: Identity = (DTYPE_CODES[flat.dtype], flat.shape[0], OP_CODES[reduce_op], code, None)
    return result, body, identity


def plan_reduce(
    world: World, forced: str | None, array: object, op: object, root: object
) -> Plan[None]:
    """Everything reduce needs before any I/O, as :func:`plan_reduce_scatter`; or Refused."""
    flat, reduce_op, checked_root = check_reduce(array, op, root, world.size)
    if forced is None:
        name = _decision.reduce(
            flat.nbytes,
            world.size,
            shm_limit(world),
            world.peer_pids is not None,
            push=_push.can_push(world),
        )
    elif (why := unrunnable("reduce", forced, world, flat.nbytes)) is not None:
        raise Refused(why)
    else:
        name = forced
    body = reduce_body(name, world, flat, checked_root, reduce_op)
    identity: Identity = (
        DTYPE_CODES[flat.dtype],
        flat.shape[0],
        OP_CODES[reduce_op],
        checked_root,
        None,
    )
    return None, body, identity
