"""Scan and exscan: their checks (the ops and dtype rules are allreduce's, less ``"mean"``),
the identity an exscan gives rank 0, what every rank must agree on, and the call into the
algorithm. The contracts are :meth:`trioring.Communicator.scan`'s and
:meth:`~trioring.Communicator.exscan`'s docstrings.

What must agree is carried in every frame's call identity: the kind (so a rank running scan
where another runs exscan raises CollectiveMismatchError), the dtype, the element count and
the op. There is no agreement round first (as reduce and broadcast have, for the root):
every rank whose result depends on a disagreeing rank meets it in a frame or hears of it in
an abort frame, and in a world that is not a power of two the few that do not (rank 1 of 3
does not wait on rank 2) return a result that is right, and raise in their next call. A
dissemination round first would make every rank raise in the call, at ceil(log2 n) alpha
more on every scan, whose small sizes are all latency.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from .. import _algorithms
from .._onehost import _shm_reductions
from .._wire import DTYPE_CODES, NO_ROOT
from . import _decision
from ._allreduce import OP_CODES, UFUNCS, ReduceOp, check, check_op
from ._checks import Refused
from ._decision import copy_unrunnable

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from .._algorithms import World
    from .._wire import OpSpec
    from ._checks import Identity, Plan

__all__ = ["check_scan", "identity", "plan_scan", "scan_body"]


def check_scan(collective: str, array: object, op: object) -> tuple[np.ndarray[Any, Any], ReduceOp]:
    """(flat view, op), or Refused: allreduce's checks, and ``"mean"`` refused (MPI has no
    mean scan; a prefix mean would divide each rank's result by a different count)."""
    reduce_op = check_op(op)
    if reduce_op is ReduceOp.MEAN:
        divisor = "rank + 1" if collective == "scan" else "rank (rank 0 has no mean)"
        raise Refused(
            f"op 'mean' is not defined for {collective} (MPI has no mean scan either); use "
            f"op='sum' and divide by {divisor}"
        )
    return check(array, reduce_op)


def identity(dtype: np.dtype[Any], op: ReduceOp) -> np.ndarray[Any, Any]:
    """The identity of ``op`` in ``dtype``, as a 0-d array: what an exscan leaves on rank 0.
    0 for sum, bor and bxor; 1 for prod; all bits set for band (-1 in signed integers, the
    maximum in unsigned ones, True in bool); the dtype's largest value for min (+inf in
    floats, True in bool) and its smallest for max (-inf in floats, False in bool)."""
    value = np.zeros((), dtype)
    if op is ReduceOp.PROD:
        value[()] = 1
    elif op is ReduceOp.BAND:
        np.invert(value, out=value)
    elif op in (ReduceOp.MIN, ReduceOp.MAX):
        largest = op is ReduceOp.MIN
        if dtype.kind == "b":
            value[()] = largest
        elif dtype.kind == "f":
            value[()] = np.inf if largest else -np.inf
        else:
            info = np.iinfo(dtype)
            value[()] = info.max if largest else info.min
    else:
        assert op in (ReduceOp.SUM, ReduceOp.BOR, ReduceOp.BXOR), op  # mean is refused before
    return value


def scan_body(
    name: str, world: World, flat: np.ndarray, reduce_op: ReduceOp, *, exclusive: bool
) -> Callable[[OpSpec], Awaitable[None]]:
    """The Communicator's step that scans ``flat`` in place by the algorithm ``name``
    (``"recursive_doubling"``, or ``"shm"`` through the shared segment, in the same order
    of operations)."""
    algorithm = _shm_reductions.shm_scan if name == "shm" else _algorithms.recursive_doubling_scan
    ufunc = UFUNCS[reduce_op]
    start = identity(flat.dtype, reduce_op) if exclusive else None

    async def run(spec: OpSpec) -> None:
        await algorithm(world, spec, flat, ufunc, exclusive=exclusive, identity=start)

    return run


def plan_scan(
    collective: str, world: World, forced: str | None, array: object, op: object
) -> Plan[None]:
    """Everything scan (``collective == "scan"``) or exscan needs before any I/O: the
    checks, the algorithm (``forced``, or the table's), the step and the identity; or
    Refused."""
    flat, reduce_op = check_scan(collective, array, op)
    if forced is not None and (why := copy_unrunnable(collective, forced, world, flat.nbytes)):
        raise Refused(why)
    shm = world.shm is not None and world.size > 1
    name = forced if forced is not None else _decision.scan(flat.nbytes, shm)
    body = scan_body(name, world, flat, reduce_op, exclusive=collective == "exscan")
    identity: Identity = (
        DTYPE_CODES[flat.dtype],
        flat.shape[0],
        OP_CODES[reduce_op],
        NO_ROOT,
        None,
    )
    return None, body, identity
