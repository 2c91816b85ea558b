"""The alltoall family's public methods: alltoall and alltoallv (their checks, decisions and
algorithms: :mod:`trioring._collectives._alltoall`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .._collectives import _alltoall
from .._collectives._checks import Refused
from .._core import CommunicatorCore
from .._errors import InvalidArgumentError
from .._wire import Kind

if TYPE_CHECKING:
    from collections.abc import Sequence

    import numpy as np

__all__ = ["AlltoallMethods"]


class AlltoallMethods(CommunicatorCore):
    """Mixed into :class:`trioring.Communicator`."""

    async def alltoall(
        self, x: np.ndarray[Any, Any], *, out: np.ndarray[Any, Any] | None = None
    ) -> np.ndarray[Any, Any]:
        """Send block ``i`` of ``x`` to rank ``i``, and receive every rank's block for this
        rank.

        ``x`` is cut into ``world_size`` equal blocks of its flattened elements, as
        mpi4py's ``Alltoall`` cuts a buffer: for ``x`` of shape ``(world_size, ...)``
        block ``i`` is ``x[i]``, and a 1-D ``x`` of ``world_size * k`` elements gives
        blocks of ``k``. Its size must be a multiple of ``world_size``; zero is fine.
        Returns a **new array** of ``x``'s shape whose block ``i`` is the block that rank
        ``i`` sent to this rank (``t[i]`` for a ``(world_size, ...)`` input), or ``out`` when
        given, filled the same way. ``x`` itself is only read (read-only arrays are fine;
        there is no in-place form: ``out`` must not overlap ``x``). The result is made of
        copies only, so every block is bitwise its sender's. A world of one returns a copy
        of ``x`` (and still checkpoints).

        Args:
            x: C-contiguous ``numpy.ndarray`` (or ``numpy.memmap``) of a supported dtype
                (``bool`` included), of any shape. Same dtype and element count on every
                rank (the shape may differ: only the element count is checked).
            out: optional C-contiguous, writable array of ``x``'s dtype with ``x.size``
                elements, of any shape, not overlapping ``x``; block ``i`` lands at
                ``out.reshape(-1)[i * k:(i + 1) * k]`` with ``k = x.size // world_size``.

        Algorithm: for blocks of up to ``SMALL_ALLTOALL_BLOCK_BYTES`` at world sizes of four
        and more, Bruck's algorithm (``ceil(log2 n)`` rounds, each sending about half the
        array, plus local rotations); otherwise the pairwise exchange (``n - 1`` steps: in
        step ``k`` send to rank ``rank + k`` while receiving from ``rank - k``, in chunks;
        each byte sent once). See the algorithms page. On one host (the ``"shm"`` and
        ``"cma"`` entries of :attr:`features`): an input whose blocks for the other ranks
        come to at most ``SHM_MAX_BYTES`` goes through the shared segment (every rank
        publishes those blocks and the call, copies its own block directly, then copies its
        block out of every peer's slot); larger inputs stream through the segment's pipe
        (every block copied in by its sender, out by its receiver, chunk by chunk) where
        cross-memory attach is not agreed, or from world 3 up to ``PIPE_MAX_ALLTOALL_BYTES``
        (0 on Intel CPUs, where cross-memory attach takes them all; no limit on others: see
        the algorithms page); otherwise
        cross-memory attach takes them, as it does above ``CMA_MIN_COPY_BYTES`` in all
        without a segment: every rank reads its block of every peer's ``x`` directly, each
        byte copied once; the caller may overwrite its arrays as soon as the call
        returns.

        If the call fails or is cancelled, the communicator is broken (as for any
        collective) and the contents of the result are unspecified; ``x`` is untouched.

        Raises:
            InvalidArgumentError: bad ``x`` or ``out``, or a size that is not a multiple of
                ``world_size`` (before any I/O; the communicator stays usable).
            CollectiveError: see :meth:`allreduce`; :class:`~trioring.CollectiveMismatchError`
                on the ranks that exchange frames with a rank whose dtype, element count or
                collective differs (and, relayed, on the others).
        """
        kind = Kind.ALLTOALL
        try:
            result, body, identity = _alltoall.plan_alltoall(
                self._world, self._forced.get(kind.label), x, out
            )
        except Refused as exc:
            raise self._invalid(kind, str(exc)) from None
        await self._run(kind, body, identity)
        return result

    async def alltoallv(
        self,
        xs: Sequence[np.ndarray[Any, Any]],
        *,
        out: np.ndarray[Any, Any] | None = None,
    ) -> list[np.ndarray[Any, Any]]:
        """Send ``xs[i]`` to rank ``i``, and receive what every rank sends to this rank;
        the sizes may differ for every pair of ranks.

        Returns a list of ``world_size`` arrays: ``got[i]`` is the array that rank ``i``
        passed for this rank, with its shape and values (``xs`` itself is only read). They
        are views, in rank order, into one contiguous buffer: a new one, or ``out`` when
        given (``got[i]`` is then ``out.reshape(-1)[start_i:start_i + size_i]`` reshaped to
        the received shape, and the list, not ``out``, is returned). The sizes are found by
        trioring: the ranks first exchange, under the same sequence number, how many rows
        each sends to each (and their trailing shapes), then the data. Any array may have
        zero rows, for any pair of ranks; a world of one works. This is the list form that
        Gloo lacks (pytorch#88245); with equal sizes it is an alltoall of separate arrays.

        Args:
            xs: a list (or tuple) of ``world_size`` C-contiguous ``numpy.ndarray`` (or
                ``numpy.memmap``) of at least one dimension, ``xs[i]`` for rank ``i``;
                read-only arrays are fine. They share one dtype and one trailing shape
                (``x.shape[1:]``), on this rank (checked before any I/O) and across ranks
                (a difference is a mismatch); ``x.shape[0]`` may differ for every pair.
            out: optional C-contiguous, writable array of ``xs``' dtype, of any shape, not
                overlapping any of ``xs``, that must hold exactly the elements this rank
                receives in all. Its dtype and layout are checked before any I/O; its size
                only once the counts are known: a wrong size raises InvalidArgumentError on
                this rank **after the call completed on every rank** (what this rank
                received is discarded; the peers' results are complete, and the
                communicator stays usable).

        Algorithm: the counts by Bruck's alltoall (``ceil(log2 n)`` rounds of small
        vectors), then the data by the pairwise exchange (``n - 1`` steps, in chunks). On
        one host (the ``"shm"`` entry of :attr:`features`) every rank publishes its counts
        in its slot of the shared segment instead, with its arrays for the other ranks
        after them where they fit the slot together: when every rank's do, that one
        publication is the whole call (each rank copies its blocks out of the peers'
        slots); otherwise the pairwise exchange follows.

        If the call fails or is cancelled, the communicator is broken (as for any
        collective); ``xs`` are untouched.

        Raises:
            InvalidArgumentError: not a list of ``world_size`` arrays, a bad array or
                ``out``, or arrays of different dtypes or trailing shapes on this rank
                (before any I/O; the communicator stays usable); or, after the call, an
                ``out`` of the wrong size (see above).
            CollectiveError: see :meth:`allreduce`. :class:`~trioring.CollectiveMismatchError`
                on every rank when ranks pass different dtypes, numbers of dimensions or
                trailing shapes, or when a rank runs another collective.
        """
        kind = Kind.ALLTOALLV
        problems: list[str] = []
        try:
            parts, body, identity = _alltoall.plan_alltoallv(
                self._world, self._forced.get(kind.label), xs, out, problems
            )
        except Refused as exc:
            raise self._invalid(kind, str(exc)) from None
        await self._run(kind, body, identity)
        if problems:
            seq = self._seq
            raise InvalidArgumentError(
                f"rank {self._rank}: {kind.label} #{seq}: {problems[0]}",
                rank=self._rank,
                job_id=self._job_id,
                collective=kind.label,
                seq=seq,
            )
        return parts
