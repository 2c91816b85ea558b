"""The allgather family's public methods: allgather and allgatherv (their checks, decisions and algorithms: :mod:`trioring._collectives._allgather`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .._collectives import _allgather
from .._collectives._checks import Refused
from .._core import CommunicatorCore
from .._wire import Kind

if TYPE_CHECKING:
    import numpy as np

__all__ = ["AllgatherMethods"]


class AllgatherMethods(CommunicatorCore):
    """Mixed into :class:`trioring.Communicator`."""

    async def allgather(
        self, x: np.ndarray[Any, Any], *, out: np.ndarray[Any, Any] | None = None
    ) -> np.ndarray[Any, Any]:
        """Gather every rank's ``x`` on every rank.

        Returns a **new array** of shape ``(world_size, *x.shape)`` whose row ``i`` is rank
        ``i``'s ``x`` (``x`` itself is only read), or ``out`` when given, filled in rank
        order. The result is **bitwise identical on every rank**: it is made of copies only.
        A world of one, and a size of 0, work (and still checkpoint).

        Args:
            x: C-contiguous ``numpy.ndarray`` (or ``numpy.memmap``) of a supported dtype, of
                any shape; read-only arrays are fine. Same dtype and element count on every
                rank (the shape may differ: only the element count is checked).
            out: optional C-contiguous, writable array of ``x``'s dtype with
                ``world_size * x.size`` elements, of any shape; rank ``i``'s elements land at
                ``out.reshape(-1)[i * x.size:(i + 1) * x.size]``. ``x`` may be this rank's
                block of ``out`` (in place), but must not overlap it otherwise.

        Algorithm: at a power-of-two world size, up to ``SMALL_POW2_ALLGATHER_BYTES``
        gathered in all, recursive doubling (``log2 n`` exchanges with partners ``rank ^
        2^k``, every block landing in place); otherwise up to ``SMALL_ALLGATHER_BYTES``,
        Bruck's algorithm (``ceil(log2 n)`` rounds at any world size, and one local
        rotation); above, a ring (``n - 1`` steps, streamed in chunks, bandwidth-optimal).
        See the algorithms page and the decision table. On one host (the ``"shm"`` and
        ``"cma"`` entries of :attr:`features`): blocks of up to ``SHM_MAX_BYTES`` go through
        the shared segment (every rank publishes its block and the call, then copies every
        peer's); larger ones stream through the segment's pipe (each rank copies its block
        in, chunk by chunk, every other rank copies it out), from world 3 up to
        ``PIPE_MAX_ALLGATHER_BYTES`` gathered in all where cross-memory attach is agreed
        (2 MiB on Intel CPUs, 8 MiB on others: see the algorithms page);
        above that, at world 2, or without a segment above ``CMA_MIN_COPY_BYTES``, every
        rank reads every peer's block by cross-memory attach out of the peer's ``x``, each
        byte copied once straight from where it is to where it goes; the caller may
        overwrite its arrays as soon as the call returns.

        Raises:
            InvalidArgumentError: bad ``x`` or ``out``, or a forced ``recursive_doubling``
                at a world size that is not a power of two (before any I/O; the
                communicator stays usable).
            CollectiveError: see :meth:`allreduce`; :class:`~trioring.CollectiveMismatchError`
                when ranks pass different dtypes or element counts.
        """
        kind = Kind.ALLGATHER
        try:
            result, body, identity = _allgather.plan_allgather(
                self._world, self._forced.get(kind.label), x, out
            )
        except Refused as exc:
            raise self._invalid(kind, str(exc)) from None
        await self._run(kind, body, identity)
        return result

    async def allgatherv(
        self, x: np.ndarray[Any, Any], *, out: np.ndarray[Any, Any] | None = None
    ) -> list[np.ndarray[Any, Any]]:
        """Gather every rank's ``x``, whose first dimension may differ between ranks, on
        every rank.

        Returns a list of ``world_size`` arrays: ``parts[i]`` has rank ``i``'s shape and
        values (``x`` itself is only read). They are views, in rank order, into one
        contiguous buffer: a new one, or ``out`` when given (``parts[i]`` is then
        ``out.reshape(-1)[start_i:start_i + size_i]`` reshaped to rank ``i``'s shape, and
        the list, not ``out``, is returned). The sizes are found by trioring: the ranks
        first exchange their row counts (and trailing shapes), then the data. The result is
        **bitwise identical on every rank**. Any rank may pass zero rows; a world of one
        works.

        Args:
            x: C-contiguous ``numpy.ndarray`` (or ``numpy.memmap``) of at least one
                dimension and a supported dtype; read-only arrays are fine. Same dtype,
                number of dimensions and trailing shape (``x.shape[1:]``) on every rank;
                ``x.shape[0]`` may differ.
            out: optional C-contiguous, writable array of ``x``'s dtype holding exactly the
                total number of elements of all ranks' ``x``, of any shape, not overlapping
                ``x``. Its dtype and layout are checked before any I/O; its size only once
                the counts are known (every rank's capacity travels with its counts).

        Algorithm: the counts first, by Bruck's algorithm; then the data as
        :meth:`allgather`'s, chosen by the total size once the counts are known
        (identically on every rank). On one host (the ``"shm"`` entry of
        :attr:`features`) every rank publishes its counts in its slot of the shared
        segment instead, with ``x`` beside them where it fits the slot: when every rank's
        does, that one publication is the whole call (each rank copies every block out of
        the slots); otherwise the data follow by the segment's pipe or cross-memory attach
        as for :meth:`allgather`, reading at once what came in the slots.

        Raises:
            InvalidArgumentError: bad ``x`` or ``out``, or a forced ``recursive_doubling``
                at a world size that is not a power of two (before any I/O; the
                communicator stays usable).
            CollectiveError: see :meth:`allreduce`. :class:`~trioring.CollectiveMismatchError`
                on every rank when ranks pass different dtypes, numbers of dimensions or
                trailing shapes, or when some rank's ``out`` does not hold the total (the
                communicator is then broken, as for any mismatch).
        """
        kind = Kind.ALLGATHERV
        try:
            result, body, identity = _allgather.plan_allgatherv(
                self._world, self._forced.get(kind.label), x, out
            )
        except Refused as exc:
            raise self._invalid(kind, str(exc)) from None
        await self._run(kind, body, identity)
        return result
