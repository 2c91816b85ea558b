"""Allreduce: its ops and their dtype rules, the limits of each algorithm, and the call into
the one the decision table (or forcing) picked. The contract is
:meth:`trioring.Communicator.allreduce`'s docstring."""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import _algorithms
from .._onehost import _cma_reductions, _pipe, _shm, _shm_reductions
from .._wire import OP_NAMES
from ._checks import Refused, check_array

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from .._algorithms import World
    from .._wire import OpSpec

__all__ = ["ReduceOp", "body", "check", "check_op", "shm_bytes", "unrunnable"]


class ReduceOp(enum.StrEnum):
    """Reduce operations for :meth:`Communicator.allreduce`. Each member equals its string
    name, so ``op="mean"`` and ``op=ReduceOp.MEAN`` are interchangeable."""

    SUM = "sum"
    MEAN = "mean"
    MIN = "min"
    MAX = "max"
    PROD = "prod"
    BAND = "band"
    BOR = "bor"
    BXOR = "bxor"


UFUNCS: dict[ReduceOp, np.ufunc] = {
    ReduceOp.SUM: np.add,
    ReduceOp.MEAN: np.add,
    ReduceOp.MIN: np.minimum,
    ReduceOp.MAX: np.maximum,
    ReduceOp.PROD: np.multiply,
    ReduceOp.BAND: np.bitwise_and,
    ReduceOp.BOR: np.bitwise_or,
    ReduceOp.BXOR: np.bitwise_xor,
}
_BITWISE = frozenset((ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR))
#: What bool arrays may be reduced with: numpy's add and multiply on bools are a logical or
#: and and (never a count), so "sum" would silently not count; MPI allows only logical ops
#: on MPI_C_BOOL. min and max are the logical and and or.
_BOOL_OPS = frozenset((ReduceOp.MIN, ReduceOp.MAX, *_BITWISE))
# A dict finds an op (by name or member) in a fraction of the time ReduceOp(op) takes, which
# counts next to a 4-byte allreduce's few microseconds.
_OPS: dict[object, ReduceOp] = {**{op.value: op for op in ReduceOp}, **{op: op for op in ReduceOp}}
OP_CODES: dict[ReduceOp, int] = {op: OP_NAMES.index(op.value) + 1 for op in ReduceOp}


def check_op(op: object) -> ReduceOp:
    """``op`` as a ReduceOp, or Refused."""
    try:
        return _OPS[op]
    except (KeyError, TypeError):  # TypeError: unhashable
        names = ", ".join(repr(o.value) for o in ReduceOp)
        raise Refused(f"unknown op {op!r}; expected one of {names}") from None


def check(array: object, op: object) -> tuple[np.ndarray[Any, Any], ReduceOp]:
    """``array`` as a flat view and ``op`` as a ReduceOp, or Refused: the op is looked up
    first, then the array checked, then the op's dtype rules (``"min"``/``"max"`` refuse
    complex dtypes, ``"mean"`` integer ones, the bitwise ops all but integers and bools,
    and bools all but min, max and the bitwise ops). One call, for a 4-byte allreduce's
    sake."""
    reduce_op = check_op(op)
    flat = check_array(array)
    dtype = flat.dtype
    kind = dtype.kind
    if kind == "b" and reduce_op not in _BOOL_OPS:
        raise Refused(
            f"op {reduce_op.value!r} is not defined for dtype bool (numpy would give a "
            "logical or/and, not a count); use 'bor', 'band', 'bxor', 'min' or 'max', or "
            "convert to an integer dtype to count"
        )
    if reduce_op in _BITWISE and kind not in "iub":
        raise Refused(f"op {reduce_op.value!r} needs an integer or bool dtype, not {dtype}")
    if reduce_op in (ReduceOp.MIN, ReduceOp.MAX) and kind == "c":
        raise Refused(f"op {reduce_op.value!r} is not defined for complex dtype {dtype}")
    if reduce_op is ReduceOp.MEAN and dtype.kind in "iu":
        raise Refused(
            f"op 'mean' needs a floating or complex dtype, not {dtype} (the mean of "
            "integers is not an integer); use 'sum' and divide, or convert first"
        )
    return flat, reduce_op


def shm_bytes(world: World) -> int:
    """The largest array the shared-memory allreduce takes: SHM_MAX_BYTES, and the scratch
    that its reduction needs (see _onehost._shm_reductions.reduce_temporaries). Worked out
    once, with :attr:`World.slot_wide_reduce_bytes`, the reduce's, up to the whole slot."""
    limit = world.slot_reduce_bytes
    if limit < 0:
        share = world.scratch.nbytes // _shm_reductions.reduce_temporaries(world.size)
        limit = world.slot_reduce_bytes = min(_shm.SHM_MAX_BYTES, share)
        world.slot_wide_reduce_bytes = min(_shm.SLOT_PAYLOAD_BYTES, share)
    return limit


def unrunnable(name: str, world: World, nbytes: int) -> str | None:
    """Why the forced algorithm ``name`` cannot allreduce ``nbytes`` here; None if it can."""
    if name == "shm":
        if world.shm is None:
            return "the forced allreduce algorithm 'shm' needs the \"shm\" feature"
        if nbytes > shm_bytes(world):
            return (
                f"the forced allreduce algorithm 'shm' takes arrays of at most "
                f"{shm_bytes(world)} bytes here, not {nbytes}"
            )
    elif name == "cma":
        if world.peer_pids is None:
            return "the forced allreduce algorithm 'cma' needs the \"cma\" feature"
    elif name == "pipe":
        if world.shm is None:
            return "the forced allreduce algorithm 'pipe' needs the \"shm\" feature"
    elif name == "recursive_doubling" and world.size > 1 and nbytes > world.scratch.nbytes:
        return (
            "the forced allreduce algorithm 'recursive_doubling' takes arrays of at most "
            f"chunk_bytes ({world.scratch.nbytes}) bytes, not {nbytes}"
        )
    return None


def body(
    name: str, world: World, flat: np.ndarray, ufunc: np.ufunc, divide: bool
) -> Callable[[OpSpec], Awaitable[None]]:
    """The Communicator's step that allreduces ``flat`` in place by the algorithm ``name``.
    (Made here, one closure per call and no coroutine in between, so that a 4-byte allreduce
    pays nothing for the indirection.)"""
    if name == "shm":
        algorithm = _shm_reductions.shm_allreduce
    elif name == "cma":
        algorithm = _cma_reductions.cma_allreduce
    elif name == "pipe":
        algorithm = _pipe.pipe_allreduce
    elif name == "recursive_doubling":
        algorithm = _algorithms.recursive_doubling_allreduce
    else:
        algorithm = _algorithms.ring_allreduce

    async def run(spec: OpSpec) -> None:
        await algorithm(world, spec, flat, ufunc, divide=divide)

    return run
