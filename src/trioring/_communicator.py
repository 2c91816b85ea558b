"""The public face of a communicator: its properties, allreduce, broadcast, barrier and
aclose; the other collectives come from the family modules of :mod:`trioring._methods`, and
the sequencing, state and failure handling from :mod:`trioring._core`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, final

import trio

from ._collectives import _allreduce, _barrier, _broadcast, _checks, _decision
from ._collectives._allreduce import ReduceOp
from ._core import DEFAULT_CHUNK_BYTES, CommunicatorCore, State
from ._methods import (
    AllgatherMethods,
    AlltoallMethods,
    GatherMethods,
    GroupMethods,
    ObjectMethods,
    PointToPointMethods,
    ReduceMethods,
    ScanMethods,
)
from ._onehost import _cma_collectives, _push
from ._onehost._shm import SHM_MAX_BYTES
from ._util import NoPublicConstructor
from ._wire import DTYPE_CODES, NO_ROOT, Kind

if TYPE_CHECKING:
    import numpy as np

__all__ = ["DEFAULT_CHUNK_BYTES", "Communicator"]


@final
class Communicator(
    AllgatherMethods,
    ReduceMethods,
    GatherMethods,
    AlltoallMethods,
    ScanMethods,
    ObjectMethods,
    PointToPointMethods,
    GroupMethods,
    CommunicatorCore,
    metaclass=NoPublicConstructor,
):
    """A connected group of ``world_size`` ranks that run collectives together.

    Get one from :func:`open_communicator` (or :func:`trioring.testing.open_local_world`);
    do not instantiate it yourself.

    **Ordering.** Every rank must call the same collectives, with the same dtype, element
    count, op and root, in the same order. Each call gets the next sequence number (1, 2,
    ...); every frame on the wire carries the call's identity, and a rank that receives
    anything else raises :class:`~trioring.CollectiveMismatchError` naming both sides. One
    communicator runs one collective at a time: a second task calling in while one runs gets
    :class:`~trioring.CommunicatorBusyError`.

    **Concurrency.** For collectives at the same time from different tasks, make
    communicators from this one (:meth:`dup`, :meth:`split`): each has its own connections,
    sequence numbers and busy rule, so collectives on different communicators run at once
    and never wait behind each other, whatever order the tasks start them in on each rank.
    Point-to-point messages (:meth:`send`, :meth:`recv`, ...) need no such care: any number
    of tasks may use them at once, also while a collective runs.

    **Arrays.** Collectives work in place on numpy arrays of any shape that are C-contiguous,
    writable and of a supported dtype (int8..int64, uint8..uint64, float16/32/64,
    complex64/128, bool, native byte order). Only the element count must match across ranks, not
    the shape. Bad arrays raise :class:`~trioring.InvalidArgumentError` before any I/O.

    **Failure and cancellation.** If a collective is cancelled (by a cancel scope of the
    caller: ``trio.fail_after``, ``move_on_after``, a nursery being cancelled) or fails on
    this rank, the array's contents are unspecified, and the communicator is *broken*: it
    tells each peer it can (an abort frame with the reason, best effort, for at most
    0.25 s), closes all its connections, and every later call raises
    :class:`~trioring.CommunicatorBrokenError`. Each peer's current or next collective then
    raises promptly (:class:`~trioring.PeerAbortedError` with reason ``"cancelled"``,
    :class:`~trioring.PeerFailedError`, or the relayed mismatch) instead of hanging, and
    that peer's communicator breaks in turn. No task is left running. Open a new communicator
    to continue. Errors raised *before* any I/O (bad arguments, busy, already cancelled on
    entry) do not break it. A cancelled collective says whom it was waiting for, since
    deadlines that fire on every rank at once reach nobody as abort frames and
    ``trio.fail_after`` raises a bare ``TooSlowError``: a WARNING on the ``trioring`` logger
    (``rank 0: allreduce #22 cancelled after 5.0 s while waiting for rank 2``), the same text
    as a note on the ``Cancelled``, in the abort frame (the peers' ``PeerAbortedError`` reads
    ``rank 0 cancelled allreduce #22 after 5.0 s while waiting for rank 2``) and in every
    later call's ``CommunicatorBrokenError``.
    """

    # -- properties --------------------------------------------------------------------

    @property
    def rank(self) -> int:
        """This process's rank, ``0 <= rank < world_size``."""
        return self._rank

    @property
    def world_size(self) -> int:
        """The number of ranks."""
        return self._world_size

    @property
    def transport(self) -> str:
        """The name of the data transport (``"tcp"``, ``"unix"``, ``"memory"``, ...)."""
        return self._family.transport.name

    @property
    def features(self) -> frozenset[str]:
        """The gated fast paths this communicator uses (see :func:`trioring.capabilities`):
        ``"cma"`` when all ranks agreed at opening to move large arrays by cross-memory
        attach, ``"shm"`` when they agreed to pass small ones through a shared segment,
        ``"threads"`` when, with both, the ranks' CPUs let a large broadcast's readers read
        in threads (and its root does not write into their arrays), ``"push"`` when, with
        both, the ranks write into each other's arrays in large allreduces and reduces (and,
        where every rank has a CPU of its own, a broadcast's root writes a share of a large
        array into the readers' while they read the rest), ``"spin"`` when receives poll
        briefly before parking. The same on every rank but
        ``"spin"``, a local choice."""
        features = set()
        world = self._world
        if world.peer_pids is not None:
            features.add("cma")
        if world.shm is not None:
            features.add("shm")
        big = _cma_collectives.READ_THREADS_MIN_BYTES
        # Where the root writes a share into the readers' arrays, they read in one thread.
        if (
            _cma_collectives.read_threads(world, big, world.size - 1) > 1
            and _push.push_bytes(world, big) == 0
        ):
            features.add("threads")
        if _push.can_push(world):
            features.add("push")
        if any(link.spin_seconds for link in self._links.values()):
            features.add("spin")
        return frozenset(features)

    @property
    def seq(self) -> int:
        """Sequence number of the last collective started (0 before the first)."""
        return self._seq

    @property
    def broken(self) -> bool:
        """Whether a collective failed or was cancelled on this communicator."""
        return self._state is State.BROKEN or self._broken_by is not None

    @property
    def closed(self) -> bool:
        """Whether :meth:`aclose` was called."""
        return self._state is State.CLOSED

    def __repr__(self) -> str:
        return (
            f"<trioring.Communicator rank={self._rank} world_size={self._world_size} "
            f"transport={self.transport!r} seq={self._seq} state={self._state.value}>"
        )

    # -- collectives -------------------------------------------------------------------

    async def allreduce(self, array: np.ndarray[Any, Any], *, op: ReduceOp | str = "sum") -> None:
        """Reduce ``array`` element-wise across all ranks, in place.

        On return, ``array`` holds the reduction of every rank's input and is **bitwise
        identical on every rank**: each element is reduced on exactly one rank and copied to
        the others. (The order in which float inputs are added depends on the element's
        position, so the result may differ in the last bits from ``np.sum`` over ranks.)

        Args:
            array: C-contiguous, writable ``numpy.ndarray`` (or ``numpy.memmap``; other
                subclasses, such as ``np.matrix`` and masked arrays, are refused) of a
                supported dtype; same dtype and element count on every rank.
            op: ``"sum"`` (default), ``"mean"``, ``"min"``, ``"max"``, ``"prod"``, or the
                bitwise ``"band"``, ``"bor"``, ``"bxor"``, or a :class:`ReduceOp`; the same on
                every rank. ``"min"``/``"max"`` refuse complex dtypes, ``"mean"`` refuses
                integer dtypes, the bitwise ops take only integer and ``bool`` dtypes, and
                ``bool`` arrays take only ``"band"``, ``"bor"``, ``"bxor"``, ``"min"`` (a
                logical and) and ``"max"`` (a logical or): numpy's sum of bools is a logical
                or, not a count, so ``"sum"`` is refused rather than silently not counting
                (MPI likewise allows only logical ops on ``MPI_C_BOOL``). A mean is a sum divided by
                ``world_size`` in the array's dtype. With recursive doubling (below) every
                rank divides the (bitwise identical) sum; otherwise the division happens once
                per element, on the rank that finishes that element's sum, before it is
                shared. Either way the mean is bitwise identical everywhere.

        Algorithm (the size thresholds are internal tuning constants; the algorithms page of
        the documentation gives their current values): on one host with a shared segment
        (``"shm"`` in :attr:`features`), arrays too large for its slots stream through its
        pipe, a ring of a few chunks that every rank maps: each rank reduces its ``1/n``
        segment of every rank's array, streamed to it chunk by chunk, then streams the
        finished segment to every rank. When every rank agreed at opening to use
        cross-memory attach (the ``"cma"`` entry of :attr:`features`), arrays above
        ``PIPE_MAX_REDUCE_BYTES`` (with a segment) or ``CMA_MIN_BYTES`` (without) go by
        it instead: each rank reduces its ``1/n`` segment by reading the peers'
        arrays directly and then copies the other finished segments, each byte copied once;
        with ``"push"`` in :attr:`features`, every array above
        ``PIPE_MAX_PUSHED_REDUCE_BYTES`` goes this way (on Intel CPUs every array the slots
        cannot take; elsewhere it is ``PIPE_MAX_REDUCE_BYTES``), each rank writing each
        finished piece of its segment straight into the others' arrays instead (a rank
        that leaves early waits for the writes in progress into its array to stop, as
        :meth:`broadcast` says).
        Otherwise, up to ``SMALL_ALLREDUCE_BYTES``, recursive doubling (``ceil(log2 n)``
        exchanges of the whole array: latency-bound sizes); above, ring reduce-scatter then
        ring all-gather, streamed in chunks of ``DEFAULT_CHUNK_BYTES``, each rank sending and
        receiving ``2 (n-1)/n`` times the array. Up to ``SHM_MAX_BYTES``, when every rank
        agreed at opening to share a segment (``"shm"`` in :attr:`features`), every rank
        writes its array there and reduces all of them in recursive doubling's order, so the
        result is bitwise the same as through sockets.

        Raises:
            InvalidArgumentError: bad array or op (before any I/O; the communicator stays
                usable).
            CollectiveError: a subclass saying what went wrong, after which the communicator
                is broken (see the class docs for cancellation).
        """
        kind = Kind.ALLREDUCE
        world = self._world
        try:
            flat, reduce_op = _allreduce.check(array, op)
        except _checks.Refused as exc:
            raise self._invalid(kind, str(exc)) from None
        nbytes = flat.nbytes
        name = self._forced.get("allreduce") if self._forced else None
        if name is None:
            name = _decision.allreduce(
                nbytes,
                world.slot_reduce_bytes if world.shm is not None else -1,
                world.peer_pids is not None,
                self._small_allreduce_bytes,
                # Asked only of arrays too large for the slots.
                nbytes > SHM_MAX_BYTES and _push.can_push(world),
            )
        elif (why := _allreduce.unrunnable(name, world, nbytes)) is not None:
            raise self._invalid(kind, why)
        body = _allreduce.body(
            name, world, flat, _allreduce.UFUNCS[reduce_op], reduce_op is ReduceOp.MEAN
        )
        await self._run(
            kind,
            body,
            (DTYPE_CODES[flat.dtype], flat.shape[0], _allreduce.OP_CODES[reduce_op], NO_ROOT, None),
        )

    async def broadcast(self, array: np.ndarray[Any, Any], *, root: int = 0) -> None:
        """Copy ``root``'s ``array`` into ``array`` on every other rank, in place.

        On return, ``array`` is **bitwise identical on every rank**. Every rank passes an
        array of the same dtype and element count (non-root contents are overwritten; the
        root's array is only read, but must still be writable).

        Algorithm: a dissemination round of small tokens carrying the call's identity (so
        that ranks disagreeing about ``root`` always raise instead of waiting for each
        other), then a binomial tree rooted at ``root``, streamed in chunks, so each rank
        receives the data once and the root's data reaches everyone in ``ceil(log2 n)`` hops.
        Up to ``SHM_MAX_BYTES`` with a shared segment (``"shm"``), the root writes its
        array there and every rank its call's identity, and the others copy it once all
        have (above 192 KiB on Intel CPUs, where every rank has a CPU of its own, piece
        by piece while the root copies the next, and so up to ``SLOT_PAYLOAD_BYTES``).
        Larger arrays (on CPUs other than Intel's, those above
        ``PIPE_MAX_PUSHED_BROADCAST_BYTES``), where every rank has a CPU of its own
        (``"push"`` in :attr:`features`), go by cross-memory attach: each other rank copies
        the root's array directly, all but its last ``1/n``, which the root writes into it
        meanwhile; the call returns on every rank once every rank has
        said it is done (each reader's read, the root's writes), so a rank that fails or
        gives up in the call makes every rank raise in it, and a reader that leaves early
        (cancelled, failing) first waits for the root's write
        in progress to end, at most one step of ``PUSH_STEP_BYTES`` (while the root runs:
        a root stopped by a signal or a debugger at that moment holds it until it runs
        again or dies). Otherwise they stream through the segment's pipe, chunk by chunk,
        and every rank returns once all have copied the whole array; but where the ranks'
        CPUs number two for every rank that copies (``"threads"``), arrays of
        ``READ_THREADS_MIN_BYTES`` and more go by cross-memory attach, each other rank
        copying the root's array directly in two threads at once while the root waits.
        Without a segment, above ``CMA_MIN_BYTES``
        with cross-memory attach (see :meth:`allreduce`), every rank copies the root's
        array directly instead. By cross-memory attach the root returns once every other
        rank has copied the array; with a segment so does every other rank, without one
        each returns as soon as it has its copy.

        Raises:
            InvalidArgumentError: bad array or ``root`` not in ``range(world_size)``.
            CollectiveError: see :meth:`allreduce`.
        """
        kind = Kind.BROADCAST
        world = self._world
        try:
            root = _checks.check_root(root, self._world_size)
            flat = _checks.check_array(array)
        except _checks.Refused as exc:
            raise self._invalid(kind, str(exc)) from None
        nbytes = flat.nbytes
        name = self._forced.get("broadcast") if self._forced else None
        if name is None:
            name = _broadcast.decide(world, nbytes)
        elif (why := _broadcast.unrunnable(name, world, nbytes)) is not None:
            raise self._invalid(kind, why)
        await self._run(
            kind,
            _broadcast.body(name, world, flat, root),
            (DTYPE_CODES[flat.dtype], flat.shape[0], 0, root, None),
        )

    async def barrier(self) -> None:
        """Return once every rank has entered this barrier.

        Algorithm: dissemination barrier (``ceil(log2 n)`` rounds of token exchange). Each
        token carries the barrier's sequence number and round and is checked, so a token left
        over from an earlier barrier can never release a later one. With a shared segment
        (``"shm"`` in :attr:`features`), every rank publishes the barrier there and waits until
        every peer has.

        Raises:
            CollectiveError: see :meth:`allreduce`.
        """
        kind = Kind.BARRIER
        world = self._world
        name = self._forced.get("barrier") if self._forced else None
        if name is None:
            name = _decision.barrier(shm=world.shm is not None)
        elif (why := _barrier.unrunnable(name, world)) is not None:
            raise self._invalid(kind, why)
        await self._run(kind, _barrier.body(name, world))

    async def aclose(self) -> None:
        """Close this communicator and every communicator made from it (by :meth:`split` or
        :meth:`dup`, recursively). Idempotent; later calls raise
        :class:`~trioring.CommunicatorClosedError`, and so does a call running in another
        task (a collective, a send or a receive). Peers that are still inside a collective
        with this rank see :class:`~trioring.PeerFailedError` (or, when an exception left
        the ``async with`` block of :func:`~trioring.open_communicator`, :meth:`split` or
        :meth:`dup` that closes it, :class:`~trioring.PeerAbortedError` naming that
        exception). Closing a sub-communicator
        leaves the one it was made from open; closing the world communicator (what leaving
        :func:`~trioring.open_communicator` does) also ends the point-to-point plane and the
        background tasks of the world."""
        await self._close_tree()
        if self._parent is None:
            await self._family.aclose()
        await trio.lowlevel.checkpoint()
