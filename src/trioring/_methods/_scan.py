"""The scan family's public methods: scan and exscan (their checks, decisions and
algorithms: :mod:`trioring._collectives._scan`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .._collectives import _scan
from .._collectives._checks import Refused
from .._core import CommunicatorCore
from .._wire import Kind

if TYPE_CHECKING:
    import numpy as np

    from .._collectives._allreduce import ReduceOp

__all__ = ["ScanMethods"]


class ScanMethods(CommunicatorCore):
    """Mixed into :class:`trioring.Communicator`."""

    async def scan(self, array: np.ndarray[Any, Any], *, op: ReduceOp | str = "sum") -> None:
        """Inclusive prefix reduction, in place: on return, rank ``i``'s ``array`` holds the
        element-wise reduction of ranks ``0..i``'s inputs (rank 0 keeps its own; MPI's
        ``MPI_Scan``). Results differ between ranks by design.

        Every rank passes the same dtype, element count (the shape may differ) and op,
        checked: every frame carries them, and a disagreement, or a rank running
        :meth:`exscan` instead, raises :class:`~trioring.CollectiveMismatchError` on every
        rank whose result depends on the odd rank's call (directly, or through the partial
        results it waits for); nobody hangs. When ``world_size`` is a power of two that is
        every rank, and so it is through the shared segment (see below). Otherwise a rank
        whose result does not depend on it (rank 1 of 3, when rank 2 differs) returns its
        result, which is right, and its next call raises. If
        the call fails or is cancelled, ``array``'s contents are unspecified and the
        communicator is broken (see :class:`Communicator`). A world of one, and a size of
        0, work (and still checkpoint).

        Ops: those of :meth:`allreduce` with its dtype rules (``"min"``/``"max"`` refuse
        complex dtypes, the bitwise ``"band"``/``"bor"``/``"bxor"`` take only integer and
        ``bool`` dtypes, ``bool`` takes only those and ``"min"``/``"max"``), except
        ``"mean"``, which is refused: MPI has no mean scan, and a prefix mean would divide
        each rank's sum by a different count (use ``"sum"`` and divide by ``rank + 1``).

        The order of operations is fixed by the world size, never by timing, so two runs
        give bitwise the same result. With ``T(lo, 1) = x_lo`` and ``T(lo, 2d) = T(lo, d) op
        T(lo + d, d)`` (a balanced tree over ranks ``lo .. lo + 2d - 1``), rank ``r``'s
        result is ``T(b_j, 2^k_j) op (... op (T(b_1, 2^k_1) op x_r))``, where ``k_1 < ... <
        k_j`` are the bits set in ``r`` and ``b_i`` is ``r`` with bits ``0..k_i`` cleared: at
        rank 5, ``((x_0 op x_1) op (x_2 op x_3)) op (x_4 op x_5)``. The lower ranks' operand
        is always on the left.

        Algorithm: recursive doubling (Thakur, Rabenseifner and Gropp 2005; MPICH's
        default): ``ceil(log2 n)`` rounds, in round ``k`` an exchange of partial results with
        rank ``rank ^ 2^k`` where that rank exists, for arrays of any size in chunks of
        ``DEFAULT_CHUNK_BYTES`` (the whole algorithm once per chunk). Cost per chunk of
        ``m`` bytes: ``ceil(log2 n) (alpha + m beta + m gamma)``. Scratch: two chunks (the
        partial result and the incoming one), never a copy of the array. On one host (the
        ``"shm"`` entry of :attr:`features`), arrays of up to ``SHM_MAX_BYTES`` go through
        the shared segment instead: every rank but the last publishes its array and the
        call, every rank checks every rank's call, and rank ``r`` folds the ranks below it
        from the slots with recursive doubling's operations in its order, so the result is
        bitwise the same as through the sockets (``r`` reductions on rank ``r``, with up to
        ``log2 r`` temporary arrays).

        Args:
            array: C-contiguous, writable ``numpy.ndarray`` (or ``numpy.memmap``) of a
                supported dtype.
            op: ``"sum"`` (default), ``"min"``, ``"max"``, ``"prod"``, ``"band"``, ``"bor"``,
                ``"bxor"``, or a :class:`ReduceOp`; the same on every rank.

        Raises:
            InvalidArgumentError: bad array or op, ``"mean"`` included (before any I/O; the
                communicator stays usable).
            CollectiveError: see :meth:`allreduce`.
        """
        kind = Kind.SCAN
        try:
            _, body, identity = _scan.plan_scan(
                kind.label, self._world, self._forced.get(kind.label), array, op
            )
        except Refused as exc:
            raise self._invalid(kind, str(exc)) from None
        await self._run(kind, body, identity)

    async def exscan(self, array: np.ndarray[Any, Any], *, op: ReduceOp | str = "sum") -> None:
        """Exclusive prefix reduction, in place: on return, rank ``i``'s ``array`` holds the
        element-wise reduction of ranks ``0..i-1``'s inputs (MPI's ``MPI_Exscan``), and
        rank 0's holds the op's **identity**, where MPI leaves it undefined: 0 for
        ``"sum"``, ``"bor"`` and ``"bxor"``; 1 for ``"prod"``; all bits set for ``"band"``
        (-1 in signed integers, the largest value in unsigned ones, ``True`` in ``bool``);
        the dtype's largest value for ``"min"`` (``inf`` in floats, ``True`` in ``bool``) and
        its smallest for ``"max"`` (``-inf`` in floats, ``False`` in ``bool``).

        Everything else is as in :meth:`scan` (what must agree, ops, ``"mean"`` refused,
        failure, algorithm, cost and scratch), and the order of operations is scan's without
        the rank's own term: rank ``r``'s result is ``T(b_j, 2^k_j) op (... op T(b_1,
        2^k_1))``; at rank 6, ``((x_0 op x_1) op (x_2 op x_3)) op (x_4 op x_5)``. A rank
        running :meth:`scan` where another runs exscan is a mismatch.

        Args:
            array: C-contiguous, writable ``numpy.ndarray`` (or ``numpy.memmap``) of a
                supported dtype.
            op: as in :meth:`scan`.

        Raises:
            InvalidArgumentError: bad array or op, ``"mean"`` included (before any I/O; the
                communicator stays usable).
            CollectiveError: see :meth:`allreduce`.
        """
        kind = Kind.EXSCAN
        try:
            _, body, identity = _scan.plan_scan(
                kind.label, self._world, self._forced.get(kind.label), array, op
            )
        except Refused as exc:
            raise self._invalid(kind, str(exc)) from None
        await self._run(kind, body, identity)
