"""The reduce family's public methods: reduce_scatter, reduce_scatterv and reduce (their checks, decisions and algorithms: :mod:`trioring._collectives._reduce`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .._collectives import _reduce
from .._collectives._checks import Refused
from .._core import CommunicatorCore
from .._errors import CollectiveMismatchError
from .._wire import Kind

if TYPE_CHECKING:
    from collections.abc import Sequence

    import numpy as np

    from .._collectives._allreduce import ReduceOp

__all__ = ["ReduceMethods"]


class ReduceMethods(CommunicatorCore):
    """Mixed into :class:`trioring.Communicator`."""

    async def reduce_scatter(
        self,
        array: np.ndarray[Any, Any],
        *,
        op: ReduceOp | str = "sum",
        out: np.ndarray[Any, Any] | None = None,
    ) -> np.ndarray[Any, Any]:
        """Reduce ``array`` element-wise across all ranks and return this rank's block of
        the result: block ``rank`` of ``world_size`` equal blocks of the flattened array.

        ``array`` is only read (left unchanged even if the call fails or is cancelled; it
        must still be writable; after a failure the result's contents are unspecified). Its
        size must be a multiple of ``world_size``; the result is a **new array** of shape
        ``array.shape[1:]`` when ``array`` has at least two dimensions and ``world_size``
        rows (``(n, 1000)`` gives ``(1000,)``), else of shape ``(array.size // world_size,)``
        (so a 1-D array of ``n * k`` elements gives ``k``). With ``out=``, the result goes
        there and ``out`` is returned: any shape, the input's dtype, ``array.size //
        world_size`` elements, C-contiguous, writable, not overlapping ``array``.

        The op is honoured, whichever it is (``"sum"``, ``"mean"``, ``"min"``, ``"max"``,
        ``"prod"``, with :meth:`allreduce`'s dtype rules). The order of operations is fixed
        by the world size and the algorithm, never by timing, so two runs give bitwise the
        same result; by the ring, block ``j`` is reduced as
        ``x_j op (x_(j-1) op (... op x_(j+1)))`` (ranks mod n). A mean divides the reduction
        by ``world_size`` once, in the dtype.

        Algorithm: on one host with a shared segment (``"shm"`` in :attr:`features`), an
        input of up to :meth:`allreduce`'s share of the segment (at most ``SHM_MAX_BYTES``;
        where no rank shares its CPUs with more ranks than it has, up to
        ``SLOT_PAYLOAD_BYTES`` and the scratch the reduction needs) goes through it: every
        rank publishes its input (less its own block, which no peer reads), then reduces
        its own block of every rank's in the order of the shared-memory allreduce
        (recursive doubling's tree over the ranks); a larger input
        streams through the segment's pipe, rank r reducing its block of the others'
        inputs, streamed to it chunk by chunk from ranks r - 1, r - 2, ... in turn, into its
        own; above ``PIPE_MAX_REDUCE_BYTES``, where cross-memory attach was agreed too, it
        goes by cross-memory attach instead. By cross-memory attach (``"cma"``: with a
        segment above ``PIPE_MAX_REDUCE_BYTES``, without one above
        ``CMA_MIN_REDUCE_SCATTER_BYTES``), rank r reads its block of every peer's input
        directly (peers r + 1, r + 2, ...). Otherwise, up to ``SMALL_REDUCE_SCATTER_BYTES``
        (and one chunk), recursive halving: ``log2 p`` exchanges of halves of the array (p
        the largest power of two <= n, and two more steps when n is not one), in an order
        fixed by n (see the algorithms page);
        scratch: a copy of the array. Above, ring reduce-scatter: n-1 steps, each rank
        sending and receiving ``(n-1)/n`` of the array, streamed in chunks; scratch: one
        block and one chunk.

        Raises:
            InvalidArgumentError: bad array, op or ``out``, or a size that is not a multiple
                of ``world_size`` (before any I/O; the communicator stays usable).
            CollectiveError: see :meth:`allreduce`. Ranks that disagree on dtype, size or op
                raise :class:`~trioring.CollectiveMismatchError`.
        """
        kind = Kind.REDUCE_SCATTER
        try:
            result, body, identity = _reduce.plan_reduce_scatter(
                kind.label, self._world, self._forced.get(kind.label), array, op, out
            )
        except Refused as exc:
            raise self._invalid(kind, str(exc)) from None
        await self._run(kind, body, identity)
        return result

    async def reduce_scatterv(
        self,
        array: np.ndarray[Any, Any],
        *,
        counts: Sequence[int],
        op: ReduceOp | str = "sum",
        out: np.ndarray[Any, Any] | None = None,
    ) -> np.ndarray[Any, Any]:
        """:meth:`reduce_scatter` with uneven blocks: rank ``i`` gets the ``counts[i]``
        elements that start at ``sum(counts[:i])`` of the flattened reduction.

        Every rank passes the same ``counts`` (``world_size`` non-negative ints, zeros
        allowed, summing to ``array.size``); ranks that pass different ones raise
        :class:`~trioring.CollectiveMismatchError` (every frame carries a 31-bit CRC-32 of
        the counts, which the message shows; a note on each rank's error lists its own
        counts). The result is a **new 1-D array** of ``counts[rank]`` elements, or
        ``out`` (checked as in :meth:`reduce_scatter`) when given. ``array`` is only read.
        Order of operations, ops and algorithms as in :meth:`reduce_scatter` (chosen by
        ``array.size``); the ring's scratch is two buffers of ``max(counts)`` elements and
        one chunk.

        Raises:
            InvalidArgumentError: bad array, op, ``counts`` or ``out`` (before any I/O).
            CollectiveError: see :meth:`allreduce`.
        """
        kind = Kind.REDUCE_SCATTERV
        try:
            result, body, identity = _reduce.plan_reduce_scatter(
                kind.label, self._world, self._forced.get(kind.label), array, op, out, counts
            )
        except Refused as exc:
            raise self._invalid(kind, str(exc)) from None
        try:
            await self._run(kind, body, identity)
        except CollectiveMismatchError as exc:
            # The frames carry only a CRC of the counts; each rank's own, side by side in
            # the ranks' logs, say which differ. (Counts that were refused never got here.)
            listed = [int(c) for c in counts]
            exc.add_note(
                f"rank {self._rank}'s counts: {listed} (#{_reduce.counts_code(listed):08x})"
            )
            raise
        return result

    async def reduce(
        self, array: np.ndarray[Any, Any], *, root: int = 0, op: ReduceOp | str = "sum"
    ) -> None:
        """Reduce ``array`` element-wise across all ranks into ``root``'s ``array``, in
        place there. **Non-root arrays are left unchanged**, even if the call fails or is
        cancelled (only read; they must still be writable): partial results go through
        scratch, never through the caller's buffer. The root's ``array`` holds the result
        (its contents are unspecified after a failure).

        Every rank passes the same dtype, element count, op and ``root`` (checked: a
        disagreement raises :class:`~trioring.CollectiveMismatchError`, never a hang). Ops
        and their dtype rules are :meth:`allreduce`'s. The order of operations is fixed by
        the world size, the size of the array and the root, never by timing, so two runs
        give bitwise the same result; it is the algorithm's:

        - by the binomial tree (up to ``SMALL_REDUCE_BYTES``, and always at world 2): in
          virtual ranks ``v = (rank - root) mod n``, each rank reduces its own array with
          its children's partial results, ``((x_v op P_(v+1)) op P_(v+2)) op P_(v+4)
          ...``; the root divides a mean by ``world_size`` once.
        - through the shared segment (on one host, with ``"shm"`` in :attr:`features`, up
          to ``SLOT_PAYLOAD_BYTES`` and the scratch its reduction needs, twice
          :meth:`allreduce`'s share at worlds 2 and 3): every other rank publishes its
          array and the root reduces them and its own in the shared-memory allreduce's
          order (recursive doubling's tree over the ranks, bitwise :meth:`allreduce`'s
          result); the root divides a mean once.
        - through the segment's pipe (on one host with a segment, larger arrays), or by
          cross-memory attach (with a segment, above ``PIPE_MAX_REDUCE_BYTES``; without
          one, at world 3 and more, above ``CMA_MIN_COPY_BYTES``): as
          :meth:`reduce_scatter` by the same path, each rank reducing its block
          (``[j * size // n, (j + 1) * size // n)``), whatever the root, and dividing a
          mean once; the root then receives the finished blocks. With ``"push"`` in
          :attr:`features`, every array above ``PIPE_MAX_PUSHED_REDUCE_BYTES`` (on Intel
          CPUs every array the slots cannot take) goes by cross-memory attach,
          each other rank writing each finished piece of its block straight into the
          root's array (through one piece of scratch, never through its own array); a root
          that leaves early waits for the writes in progress to stop, as
          :meth:`broadcast` says.
        - by reduce-scatter + gather (above): the array is cut into ``world_size`` blocks
          (block ``j``: elements ``[j * size // n, (j + 1) * size // n)``), each reduced as
          :meth:`reduce_scatter` reduces it (by the ring, ``x_j op (x_(j-1) op (... op
          x_(j+1)))`` in ranks mod n, or, for an array of one chunk at most, by recursive
          halving in an order fixed by n), whatever the root: so the order differs from
          the tree's, and a float result may differ from the tree's in the last bits. A
          mean is divided once, by the rank that finishes each block.

        Algorithm: the shared segment where it applies (above). Otherwise, up to
        ``SMALL_REDUCE_BYTES`` (or at world 2), a dissemination round of
        tokens carrying the call's identity (as in :meth:`broadcast`), then a binomial tree
        reduce, chunk by chunk: ``ceil(log2 n)`` hops, the root receiving ``ceil(log2 n)``
        arrays; scratch: two chunks. Above (Rabenseifner's algorithm), a reduce-scatter
        (as :meth:`reduce_scatter` would run it) into scratch of one block per rank, then
        every rank sends its block to the root, which receives them all at once, straight
        into place: the root receives about ``2 (n-1)/n`` of the array instead of
        ``ceil(log2 n)`` arrays; scratch: one block and the reduce-scatter's. See the
        decision table for the measured threshold.

        Raises:
            InvalidArgumentError: bad array or op, or ``root`` not in ``range(world_size)``.
            CollectiveError: see :meth:`allreduce`.
        """
        kind = Kind.REDUCE
        try:
            _, body, identity = _reduce.plan_reduce(
                self._world, self._forced.get(kind.label), array, op, root
            )
        except Refused as exc:
            raise self._invalid(kind, str(exc)) from None
        await self._run(kind, body, identity)
