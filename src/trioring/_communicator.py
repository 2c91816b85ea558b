"""The Communicator: sequencing, state (open / broken / closed) and error handling around the
collective algorithms."""

from __future__ import annotations

import enum
import logging
from typing import TYPE_CHECKING, Any, final

import numpy as np
import trio

from . import _algorithms
from ._collectives import (
    _allgather,
    _allreduce,
    _barrier,
    _broadcast,
    _checks,
    _decision,
    _reduce,
)
from ._collectives._allreduce import ReduceOp
from ._concurrency import is_cancellation
from ._errors import (
    CollectiveError,
    CollectiveMismatchError,
    CommunicatorBrokenError,
    CommunicatorBusyError,
    CommunicatorClosedError,
    InvalidArgumentError,
    PeerAbortedError,
    PeerFailedError,
    ProtocolError,
    TrioringError,
)
from ._framing import Link, WaitCount
from ._util import NoPublicConstructor
from ._wire import DTYPE_CODES, NO_ROOT, AbortKind, Kind, OpSpec

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Sequence

    from .transports import Transport

__all__ = ["Communicator"]

#: Bytes per frame of bulk data. Large enough that per-frame costs vanish, small enough that a
#: ring step streams (and that the reusable scratch buffer stays small).
DEFAULT_CHUNK_BYTES = 1024 * 1024
#: How long a breaking communicator spends telling its peers why, before closing anyway.
_ABORT_NOTICE_SECONDS = 0.25
_logger = logging.getLogger("trioring")
_PAGE = 4096


class _State(enum.Enum):
    OPEN = "open"
    BROKEN = "broken"
    CLOSED = "closed"


def _aligned_scratch(nbytes: int) -> np.ndarray[tuple[int], np.dtype[np.uint8]]:
    # Page-aligned: glibc memcpy is ~10x slower when source and destination are 16 bytes
    # apart modulo 4096, which an arbitrary malloc'ed buffer can be.
    raw = np.zeros(nbytes + _PAGE, dtype=np.uint8)
    start = (-raw.ctypes.data) % _PAGE
    return raw[start : start + nbytes]


@final
class Communicator(metaclass=NoPublicConstructor):
    """A connected group of ``world_size`` ranks that run collectives together.

    Get one from :func:`open_communicator` (or :func:`trioring.testing.open_local_world`);
    do not instantiate it yourself.

    **Ordering.** Every rank must call the same collectives, with the same dtype, element
    count, op and root, in the same order. Each call gets the next sequence number (1, 2,
    ...); every frame on the wire carries the call's identity, and a rank that receives
    anything else raises :class:`~trioring.CollectiveMismatchError` naming both sides. One
    communicator runs one collective at a time: a second task calling in while one runs gets
    :class:`~trioring.CommunicatorBusyError` (open several communicators for concurrency).

    **Arrays.** Collectives work in place on numpy arrays of any shape that are C-contiguous,
    writable and of a supported dtype (int8..int64, uint8..uint64, float16/32/64,
    complex64/128, native byte order). Only the element count must match across ranks, not
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

    def __init__(
        self,
        *,
        rank: int,
        world_size: int,
        transport: Transport,
        links: dict[int, Link],
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        job_id: str = "",
    ) -> None:
        self._job_id = job_id or None
        self._rank = rank
        self._world_size = world_size
        self._transport = transport
        self._links = links
        self._seq = 0
        self._state = _State.OPEN
        self._broken_by: BaseException | None = None
        self._running: OpSpec | None = None
        self._waits = WaitCount()
        for link in links.values():
            link.waits = self._waits
        self._world = _algorithms.World(
            rank=rank,
            size=world_size,
            links=links,
            chunk_bytes=chunk_bytes,
            scratch=_aligned_scratch(chunk_bytes if world_size > 1 else 0),
        )
        # The decision table's limits that depend on this world, worked out once.
        self._shm_allreduce_bytes = _allreduce.shm_bytes(self._world)
        self._small_allreduce_bytes = min(
            _decision.SMALL_ALLREDUCE_BYTES, self._world.scratch.nbytes
        )
        #: Algorithms forced per collective (see _force_algorithm); empty by default.
        self._forced: dict[str, str] = {}

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
        return self._transport.name

    @property
    def features(self) -> frozenset[str]:
        """The gated fast paths this communicator uses (see :func:`trioring.capabilities`):
        ``"cma"`` when all ranks agreed at opening to move large arrays by cross-memory
        attach, ``"shm"`` when they agreed to pass small ones through a shared segment,
        ``"spin"`` when receives poll briefly before parking. The same on every rank for
        ``"cma"`` and ``"shm"``; ``"spin"`` is a local choice."""
        features = set()
        if self._world.peer_pids is not None:
            features.add("cma")
        if self._world.shm is not None:
            features.add("shm")
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
        return self._state is _State.BROKEN or self._broken_by is not None

    @property
    def closed(self) -> bool:
        """Whether :meth:`aclose` was called."""
        return self._state is _State.CLOSED

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
            op: ``"sum"`` (default), ``"mean"``, ``"min"``, ``"max"`` or ``"prod"``, or a
                :class:`ReduceOp`; the same on every rank. ``"min"``/``"max"`` refuse complex
                dtypes and ``"mean"`` refuses integer dtypes. A mean is a sum divided by
                ``world_size`` in the array's dtype. With recursive doubling (below) every
                rank divides the (bitwise identical) sum; otherwise the division happens once
                per element, on the rank that finishes that element's sum, before it is
                shared. Either way the mean is bitwise identical everywhere.

        Algorithm (the size thresholds are internal tuning constants; the algorithms page of
        the documentation gives their current values): above ``CMA_MIN_BYTES``, when every
        rank agreed at opening to use cross-memory attach (the ``"cma"`` entry of
        :attr:`features`), each rank reduces its ``1/n`` segment by reading the peers'
        arrays directly and then copies the other finished segments, each byte copied once.
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
                self._shm_allreduce_bytes if world.shm is not None else -1,
                world.peer_pids is not None,
                self._small_allreduce_bytes,
            )
        elif (why := _allreduce.unrunnable(name, world, nbytes)) is not None:
            raise self._invalid(kind, why)
        body = _allreduce.body(
            name, world, flat, _allreduce.UFUNCS[reduce_op], reduce_op is ReduceOp.MEAN
        )
        await self._run(
            kind,
            body,
            dtype_code=DTYPE_CODES[flat.dtype],
            count=flat.shape[0],
            op_code=_allreduce.OP_CODES[reduce_op],
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
        Above ``CMA_MIN_BYTES`` with cross-memory attach (see :meth:`allreduce`), every rank
        copies the root's array directly instead, and the root returns once all have. Up to
        ``SHM_MAX_BYTES`` with a shared segment (``"shm"``), the root writes its array there
        and every rank its call's identity, and the others copy it once all have.

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
            name = _decision.broadcast(nbytes, world.shm is not None, world.peer_pids is not None)
        elif (why := _broadcast.unrunnable(name, world, nbytes)) is not None:
            raise self._invalid(kind, why)
        await self._run(
            kind,
            _broadcast.body(name, world, flat, root),
            dtype_code=DTYPE_CODES[flat.dtype],
            count=flat.shape[0],
            root=root,
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

        Algorithm: up to ``SMALL_REDUCE_SCATTER_BYTES`` (and one chunk), recursive halving:
        ``log2 p`` exchanges of halves of the array (p the largest power of two <= n, and two
        more steps when n is not one), in an order fixed by n (see the algorithms page);
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
        except _checks.Refused as exc:
            raise self._invalid(kind, str(exc)) from None
        await self._run(kind, body, **identity)
        assert result is not None
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
        the counts). The result is a **new 1-D array** of ``counts[rank]`` elements, or
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
        except _checks.Refused as exc:
            raise self._invalid(kind, str(exc)) from None
        await self._run(kind, body, **identity)
        assert result is not None
        return result

    async def reduce(
        self, array: np.ndarray[Any, Any], *, root: int = 0, op: ReduceOp | str = "sum"
    ) -> None:
        """Reduce ``array`` element-wise across all ranks into ``root``'s ``array``, in
        place there. **Non-root arrays are left unchanged**, even if the call fails or is
        cancelled (only read; they must still be writable): partial results go through two
        chunks of scratch, never through the caller's buffer. The root's ``array`` holds the
        result (its contents are unspecified after a failure).

        Every rank passes the same dtype, element count, op and ``root`` (checked: a
        disagreement raises :class:`~trioring.CollectiveMismatchError`, never a hang). Ops
        and their dtype rules are :meth:`allreduce`'s. The order of operations is fixed by
        the world size and the root, never by timing: in virtual ranks ``v = (rank - root)
        mod n``, each rank reduces its own array with its children's partial results in the
        binomial tree, ``((x_v op P_(v+1)) op P_(v+2)) op P_(v+4) ...``; the root divides a
        mean by ``world_size`` once.

        Algorithm: a dissemination round of tokens carrying the call's identity (as in
        :meth:`broadcast`), then a binomial tree reduce, chunk by chunk: ``ceil(log2 n)``
        hops, the root receiving ``ceil(log2 n)`` arrays.

        Raises:
            InvalidArgumentError: bad array or op, or ``root`` not in ``range(world_size)``.
            CollectiveError: see :meth:`allreduce`.
        """
        kind = Kind.REDUCE
        try:
            _, body, identity = _reduce.plan_reduce(
                self._world, self._forced.get(kind.label), array, op, root
            )
        except _checks.Refused as exc:
            raise self._invalid(kind, str(exc)) from None
        await self._run(kind, body, **identity)

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

        Algorithm: up to ``SMALL_ALLGATHER_BYTES`` gathered in all, Bruck's algorithm
        (``ceil(log2 n)`` rounds at any world size); above, a ring (``n - 1`` steps,
        streamed in chunks, bandwidth-optimal). See the algorithms page.

        Raises:
            InvalidArgumentError: bad ``x`` or ``out`` (before any I/O; the communicator
                stays usable).
            CollectiveError: see :meth:`allreduce`; :class:`~trioring.CollectiveMismatchError`
                when ranks pass different dtypes or element counts.
        """
        kind = Kind.ALLGATHER
        try:
            flat, result, gathered = _allgather.check(x, out, self._world_size, self._rank)
        except _checks.Refused as exc:
            raise self._invalid(kind, str(exc)) from None
        name = self._forced.get("allgather") if self._forced else None
        await self._run(
            kind,
            _allgather.body(name, self._world, flat, gathered),
            dtype_code=DTYPE_CODES[flat.dtype],
            count=flat.shape[0],
        )
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

        Algorithm: as :meth:`allgather`, chosen by the total size once the counts are
        known; the counts themselves go by Bruck's algorithm.

        Raises:
            InvalidArgumentError: bad ``x`` or ``out`` (before any I/O; the communicator
                stays usable).
            CollectiveError: see :meth:`allreduce`. :class:`~trioring.CollectiveMismatchError`
                on every rank when ranks pass different dtypes, numbers of dimensions or
                trailing shapes, or when some rank's ``out`` does not hold the total (the
                communicator is then broken, as for any mismatch).
        """
        kind = Kind.ALLGATHERV
        try:
            flat, rows, trailing, gathered = _allgather.check_v(x, out, self._world_size)
        except _checks.Refused as exc:
            raise self._invalid(kind, str(exc)) from None
        name = self._forced.get("allgatherv") if self._forced else None
        parts: list[np.ndarray[Any, Any]] = []
        await self._run(
            kind,
            _allgather.body_v(name, self._world, flat, rows, trailing, gathered, parts),
            dtype_code=DTYPE_CODES[flat.dtype],
            count=len(trailing) + 2,
        )
        return parts

    async def aclose(self) -> None:
        """Close every connection. Idempotent; later calls raise
        :class:`~trioring.CommunicatorClosedError`. Peers that are still inside a collective
        with this rank see :class:`~trioring.PeerFailedError`. A collective running in another
        task raises :class:`~trioring.CommunicatorClosedError`."""
        if self._state is not _State.CLOSED:
            self._state = _State.CLOSED
            with trio.CancelScope(shield=True):
                await self._close_connections()
        await trio.lowlevel.checkpoint()

    # -- machinery ---------------------------------------------------------------------

    def _where(self, kind: Kind, seq: int | None = None) -> str:
        return f"rank {self._rank}: {kind.label} #{self._seq + 1 if seq is None else seq}"

    def _invalid(self, kind: Kind, message: str) -> InvalidArgumentError:
        return InvalidArgumentError(
            f"{self._where(kind)}: {message}",
            rank=self._rank,
            job_id=self._job_id,
            collective=kind.label,
            seq=self._seq + 1,
        )

    def _force_algorithm(self, collective: str, name: str | None) -> None:
        """Run every later ``collective`` (``"allreduce"``, ``"broadcast"``, ``"barrier"``)
        by the algorithm ``name`` of the decision table (see _collectives._decision), or
        again by the table's choice when ``name`` is None. For tests and experts: it changes
        the frames on the wire, so every rank must force the same. Unknown names raise
        ConfigurationError; a call that the forced algorithm cannot run here raises
        InvalidArgumentError before any I/O."""
        if name is None:
            self._forced.pop(collective, None)
        else:
            _decision.check_forced(collective, name)
            self._forced[collective] = name

    #: (``"allreduce #22"``, ``" after 5.0 s while waiting for rank 2"``) once a collective
    #: was cancelled (see _run).
    _cancelled: tuple[str, str] | None = None

    def _check_usable(self, kind: Kind) -> None:
        if self._state is _State.OPEN and self._running is None:
            return  # the common case, in two comparisons
        if self._state is _State.CLOSED:
            raise CommunicatorClosedError(
                f"{self._where(kind)}: the communicator is closed",
                rank=self._rank,
                job_id=self._job_id,
                collective=kind.label,
                seq=self._seq + 1,
            )
        if self._state is _State.BROKEN:
            if self._broken_by is not None and is_cancellation(self._broken_by):
                what, detail = self._cancelled or (f"collective #{self._seq}", "")
                why = f"{what} was cancelled{detail}"
            else:
                why = (
                    f"collective #{self._seq} failed "
                    f"({type(self._broken_by).__name__}: {self._broken_by})"
                )
            raise CommunicatorBrokenError(
                f"{self._where(kind)}: the communicator is broken since {why}; open a new "
                "communicator",
                rank=self._rank,
                job_id=self._job_id,
                collective=kind.label,
                seq=self._seq + 1,
            ) from self._broken_by
        if self._running is not None:
            raise CommunicatorBusyError(
                f"{self._where(kind)}: another task is running {self._running.describe()} on "
                "this communicator; call collectives one at a time, in the same order on "
                "every rank",
                rank=self._rank,
                job_id=self._job_id,
                collective=kind.label,
                seq=self._seq + 1,
            )

    async def _run(
        self,
        kind: Kind,
        body: Callable[[OpSpec], Awaitable[None]],
        *,
        dtype_code: int = 0,
        count: int = 0,
        op_code: int = 0,
        root: int = NO_ROOT,
    ) -> None:
        self._check_usable(kind)
        # An already-cancelled caller gets Cancelled here, before any I/O, so the communicator
        # stays usable.
        await trio.lowlevel.checkpoint_if_cancelled()
        self._seq += 1
        spec = OpSpec(kind, self._seq, dtype_code, count, op_code, root)
        self._running = spec
        waits = self._waits.count
        try:
            await body(spec)
            if self._waits.count == waits:
                # Every public async function must be a schedule point, and a collective
                # whose data was all there at once (or a world of one) has not yielded yet.
                await trio.lowlevel.cancel_shielded_checkpoint()
        except CollectiveError as exc:
            cause = exc
            try:
                cause = await self._relayed_cause(exc, spec)
            finally:
                # Even if the caller's deadline fires while we look for the cause.
                await self._break(cause, spec)
            if cause is exc:
                raise
            cause.add_note(f"first noticed on this rank as: {type(exc).__name__}: {exc}")
            raise cause from exc
        except BaseException as exc:
            if is_cancellation(exc):
                # When every rank's deadline fires at once nobody gets an abort frame, and
                # trio.fail_after raises a TooSlowError of its own in place of this
                # Cancelled: so say here, on the Cancelled, in the abort frame and in every
                # later call's error, what was cancelled and whom it was waiting for. Only
                # now is that worked out, from what the waits left behind.
                what = f"{kind.label} #{spec.seq}"
                detail = _algorithms.interrupted_wait(self._world, spec)
                self._cancelled = (what, detail)
                message = f"rank {self._rank}: {what} cancelled{detail}"
                if self._job_id:
                    message += f" [job {self._job_id}]"
                _logger.warning("%s", message)
                exc.add_note(message)
            await self._break(exc, spec)
            raise
        finally:
            self._running = None

    async def _relayed_cause(self, error: CollectiveError, spec: OpSpec) -> CollectiveError:
        """A lost connection is often the echo of a failure elsewhere: a neighbour broke
        because of it and closed before it could tell us. Its other neighbours did get an
        abort frame through, so look briefly on every link for one, and report the original
        cause (the rank that died, was cancelled or saw the mismatch) instead of the echo."""
        if not isinstance(error, PeerFailedError) or error._trioring_abort is not None:
            return error
        found: list[CollectiveError] = []

        async def look(link: Link) -> None:
            abort = await link.pending_abort(spec)
            # News that a peer lost its connection to *us* only echoes what we saw ourselves.
            if abort is not None and not abort._trioring_about_self:
                found.append(abort)

        async with trio.open_nursery() as nursery:
            for link in self._links.values():
                nursery.start_soon(look, link)
        if not found:
            return error
        return max(found, key=lambda e: 2 if isinstance(e, CollectiveMismatchError) else 1)

    def _abort_notice(self, exc: BaseException) -> tuple[AbortKind, int, str, int]:
        """(kind, subject, reason, reporter) of the abort frame that tells peers about
        ``exc``."""
        me = self._rank
        if is_cancellation(exc):
            if self._cancelled is None:
                return AbortKind.CANCELLED, me, "cancelled", me
            # "cancelled allreduce #22 after 5.0 s while waiting for rank 2": peers make
            # their message of it (see _wire.abort_error).
            what, detail = self._cancelled
            return AbortKind.CANCELLED, me, f"cancelled {what}{detail}", me
        relayed = getattr(exc, "_trioring_abort", None)
        if relayed is not None:
            kind, subject, reason, reporter = relayed
            return AbortKind(kind), subject, reason, reporter
        message = exc._bare_message if isinstance(exc, TrioringError) else str(exc)
        if isinstance(exc, PeerFailedError) and exc.peer is not None:
            return AbortKind.FAILED, exc.peer, message, me
        if isinstance(exc, CollectiveMismatchError):
            return AbortKind.MISMATCH, me, message, me
        if isinstance(exc, ProtocolError):
            return AbortKind.PROTOCOL, me, message, me
        if isinstance(exc, PeerAbortedError) and exc.peer is not None:
            return AbortKind.CANCELLED, exc.peer, exc.reason, exc.peer
        return AbortKind.ERROR, me, f"{type(exc).__name__}: {exc}", me

    async def _break(self, exc: BaseException, spec: OpSpec) -> None:
        """Enter the broken state: tell peers why (best effort), then close everything."""
        if self._state is _State.OPEN:
            self._state = _State.BROKEN
            self._broken_by = exc
        kind, subject, reason, reporter = self._abort_notice(exc)
        if self._world.shm is not None:
            # Before the abort frames: a peer that finds this on the segment reads one.
            self._world.shm.mark_broken()
        with trio.CancelScope(shield=True):
            with trio.move_on_after(_ABORT_NOTICE_SECONDS):
                async with trio.open_nursery() as nursery:
                    for link in self._links.values():
                        if link.send_clean:
                            nursery.start_soon(
                                link.send_abort, kind, subject, spec.seq, reason, reporter
                            )
            await self._close_connections()

    async def _close_connections(self) -> None:
        if self._world.shm is not None:
            self._world.shm.close()
            self._world.shm_plans.clear()
        for link in self._links.values():
            await trio.aclose_forcefully(link.connection)
        self._transport.close()
