"""The Communicator: sequencing, state (open / broken / closed) and error handling around the
collective algorithms."""

from __future__ import annotations

import array
import enum
import logging
import os
import socket
import struct
import sys
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any, final

import numpy as np
import trio

from . import _algorithms, _cma, _config, _registry, _shm
from ._concurrency import is_cancellation
from ._errors import (
    CollectiveError,
    CollectiveMismatchError,
    CommunicatorBrokenError,
    CommunicatorBusyError,
    CommunicatorClosedError,
    ConcurrentOpenError,
    ConfigurationError,
    InvalidArgumentError,
    PeerAbortedError,
    PeerFailedError,
    ProtocolError,
    RendezvousError,
    TrioringError,
)
from ._framing import (
    DTYPE_CODES,
    HEADER,
    NO_ROOT,
    OP_NAMES,
    AbortKind,
    Kind,
    Link,
    OpSpec,
    WaitCount,
    pack_data_header,
)
from ._rendezvous import connect_world
from ._util import NoPublicConstructor
from .transports import TcpTransport, Transport, TransportContext, UnixTransport

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Awaitable, Callable

__all__ = ["Communicator", "ReduceOp", "open_communicator"]

#: Bytes per frame of bulk data. Large enough that per-frame costs vanish, small enough that a
#: ring step streams (and that the reusable scratch buffer stays small).
DEFAULT_CHUNK_BYTES = 1024 * 1024
#: Arrays up to this size (and the scratch buffer, DEFAULT_CHUNK_BYTES) are allreduced by
#: recursive doubling: log2 n exchanges of the whole array, in few messages and no tasks,
#: which measured faster than the ring below it on 2 to 4 ranks. Larger ones go by the ring
#: (bandwidth-optimal), unless cross-memory attach takes them (CMA_MIN_BYTES).
SMALL_ALLREDUCE_BYTES = 1024 * 1024
#: Arrays above this size are allreduced and broadcast by cross-memory attach, when all ranks
#: agreed to use it at opening (one host, Unix transport, the kernel allows it): below, the
#: rounds of notices cost more than the copies they save. Measured on 2 and 4 ranks with the
#: Unix transport's 1 MiB send buffers, in alternating blocks of one run: at 256 and 512 KiB
#: the sockets were faster for both collectives (allreduce 369-615 us against 621-960 at
#: world 4), at 1 MiB the two were even, and from 2 MiB cross-memory attach was 2-3x faster.
CMA_MIN_BYTES = 512 * 1024
#: How long a breaking communicator spends telling its peers why, before closing anyway.
_ABORT_NOTICE_SECONDS = 0.25
_logger = logging.getLogger("trioring")
_PAGE = 4096


class ReduceOp(enum.StrEnum):
    """Reduce operations for :meth:`Communicator.allreduce`. Each member equals its string
    name, so ``op="mean"`` and ``op=ReduceOp.MEAN`` are interchangeable."""

    SUM = "sum"
    MEAN = "mean"
    MIN = "min"
    MAX = "max"
    PROD = "prod"


_UFUNCS: dict[ReduceOp, np.ufunc] = {
    ReduceOp.SUM: np.add,
    ReduceOp.MEAN: np.add,
    ReduceOp.MIN: np.minimum,
    ReduceOp.MAX: np.maximum,
    ReduceOp.PROD: np.multiply,
}
# A dict finds an op (by name or member) in a fraction of the time ReduceOp(op) takes, which
# counts next to a 4-byte allreduce's few microseconds.
_OPS: dict[object, ReduceOp] = {**{op.value: op for op in ReduceOp}, **{op: op for op in ReduceOp}}
_OP_CODES: dict[ReduceOp, int] = {op: OP_NAMES.index(op.value) + 1 for op in ReduceOp}


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
        # The shared-memory allreduce needs 2 p arrays' worth of scratch, p the largest power
        # of two <= world_size (see _algorithms.shm_allreduce).
        p = 1 << (world_size.bit_length() - 1)
        self._shm_allreduce_bytes = min(_shm.SHM_MAX_BYTES, self._world.scratch.nbytes // (2 * p))

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
        reduce_op = self._check_op(op)
        flat = self._check_array(array, kind)
        if reduce_op in (ReduceOp.MIN, ReduceOp.MAX) and flat.dtype.kind == "c":
            raise self._invalid(
                kind, f"op {reduce_op.value!r} is not defined for complex dtype {flat.dtype}"
            )
        if reduce_op is ReduceOp.MEAN and flat.dtype.kind in "iu":
            raise self._invalid(
                kind,
                f"op 'mean' needs a floating or complex dtype, not {flat.dtype} (the mean of "
                "integers is not an integer); use 'sum' and divide, or convert first",
            )
        ufunc = _UFUNCS[reduce_op]

        divide = reduce_op is ReduceOp.MEAN
        small = flat.nbytes <= min(SMALL_ALLREDUCE_BYTES, self._world.scratch.nbytes)

        world = self._world
        cma = world.peer_pids is not None and flat.nbytes > CMA_MIN_BYTES
        shm = world.shm is not None and flat.nbytes <= self._shm_allreduce_bytes

        async def body(op_spec: OpSpec) -> None:
            if shm:
                await _algorithms.shm_allreduce(world, op_spec, flat, ufunc, divide=divide)
            elif cma:
                await _algorithms.cma_allreduce(world, op_spec, flat, ufunc, divide=divide)
            elif small:
                await _algorithms.recursive_doubling_allreduce(
                    world, op_spec, flat, ufunc, divide=divide
                )
            else:
                await _algorithms.ring_allreduce(world, op_spec, flat, ufunc, divide=divide)

        await self._run(
            kind,
            body,
            dtype_code=DTYPE_CODES[flat.dtype],
            count=flat.shape[0],
            op_code=_OP_CODES[reduce_op],
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
        if isinstance(root, bool) or not isinstance(root, int | np.integer):
            raise self._invalid(kind, f"root must be an int rank, got {root!r}")
        if not 0 <= root < self._world_size:
            raise self._invalid(
                kind, f"root {root} is not a rank of this world (0..{self._world_size - 1})"
            )
        root = int(root)
        flat = self._check_array(array, kind)

        async def body(op_spec: OpSpec) -> None:
            if self._world.shm is not None and flat.nbytes <= _shm.SHM_MAX_BYTES:
                # Every rank publishes the call's identity there, so this agrees too.
                await _algorithms.shm_broadcast(self._world, op_spec, flat, root)
                return
            # Agree first: a dissemination round of tokens carrying this call's identity (root
            # included) reaches every rank from every rank, so ranks that disagree about the
            # root find out before any data moves. A tree alone cannot: if the root itself
            # thinks another rank is the root, nobody would ever send.
            await _algorithms.barrier(self._world, op_spec)
            if self._world.peer_pids is not None and flat.nbytes > CMA_MIN_BYTES:
                await _algorithms.cma_broadcast(self._world, op_spec, flat, root)
            elif flat.nbytes <= self._world.chunk_bytes:
                await _algorithms.small_broadcast(self._world, op_spec, flat, root)
            else:
                await _algorithms.broadcast(self._world, op_spec, flat, root)

        await self._run(
            kind, body, dtype_code=DTYPE_CODES[flat.dtype], count=flat.shape[0], root=root
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

        async def body(op_spec: OpSpec) -> None:
            if self._world.shm is not None:
                await _algorithms.shm_barrier(self._world, op_spec)
            else:
                await _algorithms.barrier(self._world, op_spec)

        await self._run(kind, body)

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

    def _check_op(self, op: ReduceOp | str) -> ReduceOp:
        try:
            return _OPS[op]
        except (KeyError, TypeError):  # TypeError: unhashable
            names = ", ".join(repr(o.value) for o in ReduceOp)
            raise self._invalid(
                Kind.ALLREDUCE, f"unknown op {op!r}; expected one of {names}"
            ) from None

    def _check_array(self, array: object, kind: Kind) -> np.ndarray[Any, Any]:
        # The algorithms work on the raw buffer through a flat view, so only types whose data
        # *is* that buffer are accepted: an exact ndarray, or a memmap (an ndarray whose
        # buffer is a mapped file). Any other subclass may mean more than its buffer (a
        # masked array's mask) or reshape differently (np.matrix stays 2-D, so its element
        # count would read as 1 and the algorithm would fail half-way, breaking the
        # communicator): refused before any I/O, with what to pass instead.
        if type(array) is not np.ndarray and type(array) is not np.memmap:
            raise self._invalid(kind, _unsupported_array_type(array))
        dtype = array.dtype
        if dtype not in DTYPE_CODES:
            if dtype.names is not None:
                detail = (
                    f"structured dtype {dtype} is not supported; reduce or broadcast each "
                    "field as an array of its own"
                )
            elif dtype.byteorder not in "=|" and dtype.newbyteorder("=") in DTYPE_CODES:
                detail = f"dtype {dtype.str} is not in native byte order; convert with .astype({dtype.name!r})"
            else:
                supported = ", ".join(dt.name for dt in DTYPE_CODES)
                detail = f"dtype {dtype} is not supported; supported dtypes: {supported}"
            raise self._invalid(kind, detail)
        flags = array.flags
        if not flags.c_contiguous:
            raise self._invalid(
                kind, "array is not C-contiguous; pass np.ascontiguousarray(a) and copy back"
            )
        if not flags.writeable:
            raise self._invalid(kind, "array is read-only; collectives work in place")
        return array if array.ndim == 1 else array.reshape(-1)

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
            # their message of it (see _framing.abort_error).
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


async def _create_communicator(
    config: _config.Config,
    make_transport: Callable[[TransportContext], Transport],
    *,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> Communicator:
    if config.transport == "memory":
        make_rendezvous: Callable[[TransportContext], Transport] = make_transport
    elif config.rendezvous_over_socket_dir:
        make_rendezvous = UnixTransport
    else:
        make_rendezvous = TcpTransport
    peer_pids: dict[int, int] | None = None
    shm: _shm.SharedSlots | None = None

    async def agree(links: dict[int, Link]) -> None:
        # Runs inside connect_world's set-up, so that a rank failing here (or dying) aborts
        # every rank's open_communicator, not only its neighbours'.
        nonlocal peer_pids, shm
        for link in links.values():
            link.spin_seconds = config.spin_seconds
        if config.transport != "unix" or config.world_size == 1:
            return
        try:
            peer_pids = await _agree_on_cma(config, links)
            shm = await _agree_on_shm(config, links)
        except CollectiveError as exc:
            raise RendezvousError(
                f"rank {config.rank}: rendezvous failed while agreeing on capabilities: "
                f"{exc._bare_message}",
                rank=config.rank,
                peer=exc.peer,
                collective="rendezvous",
                job_id=config.credentials.job_id or None,
            ) from exc

    try:
        transport, links = await connect_world(config, make_transport, make_rendezvous, agree)
    except BaseException:
        # connect_world closed the links and the transport; the segment is ours.
        if shm is not None:
            shm.close()
        raise
    comm = Communicator._create(
        rank=config.rank,
        world_size=config.world_size,
        transport=transport,
        links=links,
        chunk_bytes=chunk_bytes,
        job_id=config.credentials.job_id,
    )
    comm._world.peer_pids = peer_pids
    comm._world.shm = shm
    # Only now: a long wait watches the other links by reading their frames ahead, and the
    # set-up above reads the segment's frame straight off the socket (its descriptor travels
    # beside the bytes), which must not have been read ahead. With 64 ranks on 2 cores the
    # set-up's waits outlast _WATCH_AFTER_SECONDS, and a watch took rank 0's segment frame:
    # every 64-rank world failed to open.
    for link in links.values():
        link.watch = list(links.values())
    return comm


_OFFER = struct.Struct("<QQQ")  # offered (0/1), address of our cookie, the cookie's value


async def _agree_on_cma(config: _config.Config, links: dict[int, Link]) -> dict[int, int] | None:
    """Decide, identically on every rank, whether collectives may use cross-memory attach:
    only if every rank offers it and every rank could read a cookie from every peer's memory
    (the kernel's ptrace rules, seccomp and containers decide that, per pair). Two rounds of
    small frames on every link (``setup #0``). Returns the peers' pids, or None."""
    spec = OpSpec(Kind.SETUP, 0)
    offer = config.cma and _cma.unavailable_reason() is None
    cookie = np.frombuffer(os.urandom(8), dtype=np.uint64).copy()
    pids = (
        {peer: _cma.peer_pid(link.connection.socket) for peer, link in links.items()}  # type: ignore[attr-defined]
        if offer
        else {}
    )
    mine = memoryview(_OFFER.pack(offer, cookie.ctypes.data, int(cookie[0])))
    for link in links.values():
        await link.send(spec, 0, mine)
    readable = offer
    theirs = bytearray(_OFFER.size)
    probe = np.zeros(1, dtype=np.uint64)
    for peer, link in links.items():
        await link.recv(spec, 0, memoryview(theirs))
        offered, address, value = _OFFER.unpack(theirs)
        if not (offered and readable):
            readable = False
            continue
        try:
            _cma.read_into(pids[peer], address, probe.ctypes.data, 8)
        except _cma.CmaError:
            readable = False
        else:
            readable = int(probe[0]) == value
    verdict = memoryview(struct.pack("<Q", readable))
    for link in links.values():
        await link.send(spec, 1, verdict)
    agreed = readable
    answer = bytearray(8)
    for link in links.values():
        await link.recv(spec, 1, memoryview(answer))
        agreed = agreed and struct.unpack("<Q", answer)[0] == 1
    # Keep the cookie alive until every peer has read it (they answered after reading).
    del cookie
    return pids if agreed else None


def _unsupported_array_type(array: object) -> str:
    """Why ``array``, which is not an exact ndarray or memmap, is refused, and what to pass."""
    name = f"{type(array).__module__}.{type(array).__qualname__}"
    if isinstance(array, np.ma.MaskedArray):
        return (
            f"{name} is not supported: its mask would be ignored. Reduce the data and the mask "
            "as two plain arrays, e.g. data = a.filled(0) (a new array; fill with a value that "
            "is neutral for the op) and mask = np.ma.getmaskarray(a).astype(np.uint8) with "
            "op='max'"
        )
    if isinstance(array, np.matrix):
        return (
            f"{name} is not supported: it stays 2-D when flattened. Pass np.asarray(m), a view "
            "of the same memory, so the result still lands in m"
        )
    if isinstance(array, np.ndarray):
        return (
            f"{name} is not supported: collectives work on the raw buffer, which only "
            "numpy.ndarray and numpy.memmap are exactly. If the data is all that matters, "
            "pass np.asarray(a), a view of the same memory"
        )
    return f"expected a numpy.ndarray, got {type(array).__name__}"


def _require_trio(what: str) -> None:
    """Raise ConfigurationError unless running inside ``trio.run``: called from asyncio (or no
    event loop at all), Trio's own calls would fail later with internal RuntimeErrors.

    Only the entry points check (open_communicator, open_local_world): a Communicator can only
    be made inside Trio, so its methods need not pay for the check on every collective."""
    try:
        trio.lowlevel.current_task()
    except RuntimeError:
        pass
    else:
        return
    # Without importing asyncio ourselves (and sniffio is not a dependency): a running
    # asyncio loop can only exist if the program imported asyncio.
    asyncio = sys.modules.get("asyncio")
    if asyncio is not None and asyncio._get_running_loop() is not None:
        where = (
            "from asyncio. Run the program with trio.run(main) instead (from asyncio code, "
            "trio.run can run in a thread: await asyncio.to_thread(trio.run, main))"
        )
    else:
        where = "outside trio.run. Run the program with trio.run(main)"
    raise ConfigurationError(f"trioring needs Trio (trio.run); {what} was called {where}")


def _concurrent_open(config: _config.Config) -> ConcurrentOpenError:
    if config.world_size == 1:
        world = "a world of one rank"
    elif config.rendezvous_over_socket_dir:
        world = f"{config.transport}, socket directory {config.socket_dir}"
    else:
        world = f"{config.transport}, rendezvous at {config.master_addr}:{config.master_port}"
    job_id = config.credentials.job_id or None
    return ConcurrentOpenError(
        f"rank {config.rank}: another open_communicator() call of this process is still "
        f"opening rank {config.rank} of the same world ({world}); opening communicators "
        "concurrently is not supported. Run the collectives one after another on one "
        "communicator, or open the second communicator after the first one is open",
        rank=config.rank,
        collective="rendezvous",
        job_id=job_id,
    )


_OpeningKey = tuple[int, str, str | None, int | None, str | None, str]
#: Who is connecting, and to which world (rank, transport, master address and port, socket
#: directory, job id), for every open_communicator() call of this process that has not
#: finished opening. Two at once for the same rank of one world would both try to be that
#: rank at one rendezvous (rank 0 fails to bind, the others wait forever), so the second one
#: fails at once, on every rank alike (see ConcurrentOpenError).
_OPENING: set[_OpeningKey] = set()


def _opening_key(config: _config.Config) -> _OpeningKey:
    return (
        config.rank,
        config.transport,
        config.master_addr,
        config.master_port,
        config.socket_dir,
        config.credentials.job_id,
    )


@asynccontextmanager
async def open_communicator(
    *,
    rank: int | None = None,
    world_size: int | None = None,
    master_addr: str | None = None,
    master_port: int | None = None,
    transport: str | None = None,
) -> AsyncIterator[Communicator]:
    """Join a world of ``world_size`` processes and yield a connected :class:`Communicator`;
    close it on exit.

    Every argument left as ``None`` is read from the environment, as ``torch.distributed``
    does: ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``, and
    ``TRIORING_TRANSPORT`` (``"tcp"`` by default, ``"unix"``, or any registered transport).
    With ``TRIORING_TRANSPORT=unix`` and ``TRIORING_SOCKET_DIR`` set to a directory shared by
    all ranks, no TCP port is used at all; without it, rendezvous goes through
    ``MASTER_ADDR:MASTER_PORT`` and data through Unix sockets. A world of size 1 needs no
    address. Missing or invalid settings raise :class:`~trioring.ConfigurationError` naming
    the variable, and an unknown or unavailable transport raises
    :class:`~trioring.ConfigurationError` or :class:`~trioring.TransportUnavailable`, all
    before any I/O.

    Rank 0 listens at ``MASTER_ADDR:MASTER_PORT``; the other ranks retry connecting until it
    does. There is no internal timeout: wrap the call in ``trio.fail_after`` to bound how long
    to wait for missing ranks. Cancellation while connecting closes everything opened so far.

    One process opens one communicator per world at a time: a call made while another call
    of this process is still opening the same rank of the same world raises
    :class:`~trioring.ConcurrentOpenError` at once (on every rank, since every rank makes the
    same calls). Opening another communicator with the same settings after this one is open
    works; so do collectives on several open communicators at once.

    Raises:
        ConfigurationError, TransportUnavailable: before any I/O; ``ConfigurationError`` also
            when called outside ``trio.run`` (from asyncio, say).
        ConcurrentOpenError: before any I/O, see above.
        RendezvousError: the world is inconsistent (different ``WORLD_SIZE``, duplicate
            ``RANK``, different transports) or a peer cannot be reached.
    """
    _require_trio("open_communicator()")
    config = _config.resolve(
        rank=rank,
        world_size=world_size,
        master_addr=master_addr,
        master_port=master_port,
        transport=transport,
    )
    transport_cls = _registry.get_transport(config.transport, source=config.transport_source)
    key = _opening_key(config)
    if key in _OPENING:
        raise _concurrent_open(config)
    _OPENING.add(key)
    try:
        comm = await _create_communicator(config, transport_cls)
    finally:
        _OPENING.discard(key)
    try:
        yield comm
    finally:
        await comm.aclose()


async def _agree_on_shm(config: _config.Config, links: dict[int, Link]) -> _shm.SharedSlots | None:
    """Decide, identically on every rank, whether small collectives go through a shared
    segment (see _shm): rank 0 creates it and hands it to every peer over its Unix
    connection; every rank maps it and says whether that worked; it is used only if it
    worked everywhere (``setup #0``, offsets 2 and 3). Off without polling
    (TRIORING_SPIN_US=0, or one CPU): a parked wait on the segment wakes only on a timer."""
    spec = OpSpec(Kind.SETUP, 0)
    offer = config.shm and config.spin_seconds > 0 and _shm.unavailable_reason() is None
    fd = -1
    slots = None
    try:
        if config.rank == 0:
            if offer:
                try:
                    fd = _shm.create_segment(config.world_size)
                except OSError:
                    offer = False
            for link in links.values():
                await _send_segment(link, spec, fd if offer else -1)
        else:
            fd = await _receive_segment(links[0], spec)
        if offer and fd >= 0:
            try:
                slots = _shm.SharedSlots(
                    fd,
                    config.rank,
                    config.world_size,
                    {peer: link.connection.socket.fileno() for peer, link in links.items()},  # type: ignore[attr-defined]
                )
            except (OSError, ValueError):
                slots = None
    finally:
        if fd >= 0:
            os.close(fd)
    try:
        verdict = memoryview(struct.pack("<Q", slots is not None))
        for link in links.values():
            await link.send(spec, 3, verdict)
        agreed = slots is not None
        answer = bytearray(8)
        for link in links.values():
            await link.recv(spec, 3, memoryview(answer))
            agreed = agreed and struct.unpack("<Q", answer)[0] == 1
    except BaseException:
        if slots is not None:
            slots.close()
        raise
    if not agreed and slots is not None:
        slots.close()
        slots = None
    return slots


_SEGMENT = struct.Struct("<Q")  # 1 when the frame carries the segment's descriptor


async def _send_segment(link: Link, spec: OpSpec, fd: int) -> None:
    frame = bytearray(HEADER.size + _SEGMENT.size)
    pack_data_header(frame, spec, 2, _SEGMENT.size)
    _SEGMENT.pack_into(frame, HEADER.size, fd >= 0)
    sock = link.connection.socket  # type: ignore[attr-defined]
    ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))] if fd >= 0 else []
    try:
        sent = await sock.sendmsg([frame], ancillary)
        if sent < len(frame):
            await link.connection.send_all(memoryview(frame)[sent:])
    except (OSError, trio.BrokenResourceError) as exc:
        raise link.peer_failed(spec, f"connection to peer rank {link.peer} broke: {exc}") from exc


async def _receive_segment(link: Link, spec: OpSpec) -> int:
    """The descriptor rank 0 sent over ``link`` (-1 when it offered none)."""
    size = HEADER.size + _SEGMENT.size
    # The frame is read straight off the socket, so nothing of it may sit in the link's
    # buffers (nothing watches the links during set-up; see _create_communicator).
    assert not link.has_buffered_bytes, "setup frame read ahead"
    sock = link.connection.socket  # type: ignore[attr-defined]
    fds: list[int] = []
    try:
        try:
            data, ancillary, flags, _ = await sock.recvmsg(size, socket.CMSG_SPACE(4))
            for level, kind, payload in ancillary:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    usable = len(payload) - len(payload) % 4
                    fds.extend(array.array("i", payload[:usable]))
            received = bytearray(data)
            while data and len(received) < size:
                data = await sock.recv(size - len(received))
                received += data
        except OSError as exc:
            raise link.peer_failed(
                spec, f"connection to peer rank {link.peer} broke: {exc}"
            ) from exc
        if len(received) < size:
            raise link.peer_failed(
                spec,
                f"connection to peer rank {link.peer} was closed during setup (the peer exited)",
            )
        expected = bytearray(HEADER.size)
        pack_data_header(expected, spec, 2, _SEGMENT.size)
        if received[: HEADER.size] != expected:
            raise link.protocol_error(spec, "expected the shared segment's frame during setup")
        (offered,) = _SEGMENT.unpack_from(received, HEADER.size)
        if offered and len(fds) == 1 and not flags & socket.MSG_CTRUNC:
            return fds.pop()
        return -1
    finally:
        for fd in fds:  # all of them, except the one returned
            os.close(fd)
