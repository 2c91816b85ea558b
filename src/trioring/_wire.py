"""The frames on a data connection: their header, the identity of a collective call
(:class:`OpSpec`) that every frame carries, and the errors an ABORT frame turns into.

Every frame starts with a fixed 48-byte little-endian header::

    magic "TRNG" | version u8 | frame type u8 | kind u8 | op u8 | dtype u8 | 3 pad bytes
    root i32 | seq u64 | count u64 | offset u64 | nbytes u64

A DATA frame's header repeats the whole identity of the collective it belongs to (kind,
sequence number, dtype, element count, reduce op, root), so a receiver checks on every frame
that its peer runs the same collective, then that the chunk is the one it expects (offset,
nbytes), and only then lets ``nbytes`` of payload land in the target buffer. An ABORT frame
carries a reason instead of data: ``kind`` is the abort kind, ``root`` the rank the news is
about, and the payload (at most ``MAX_REASON_BYTES``) the reason in UTF-8.
"""

from __future__ import annotations

import enum
import struct
from typing import NamedTuple

import numpy as np

from ._errors import (
    CollectiveError,
    CollectiveMismatchError,
    PeerAbortedError,
    PeerFailedError,
    ProtocolError,
)

MAGIC = b"TRNG"
VERSION = 1
HEADER = struct.Struct("<4sBBBBB3xiQQQQ")
assert HEADER.size == 48
MAX_REASON_BYTES = 4096
NO_ROOT = -1


class FrameType(enum.IntEnum):
    DATA = 1
    ABORT = 2


class Kind(enum.IntEnum):
    ALLREDUCE = 1
    BROADCAST = 2
    BARRIER = 3
    SETUP = 4  # the capability agreement when a communicator opens (seq 0)
    ALLGATHER = 5
    ALLGATHERV = 6
    REDUCE_SCATTER = 7
    REDUCE_SCATTERV = 8
    REDUCE = 9
    GATHER = 10
    GATHERV = 11
    SCATTER = 12
    SCATTERV = 13
    ALLTOALL = 14
    ALLTOALLV = 15
    SCAN = 16
    EXSCAN = 17
    SPLIT = 18
    DUP = 19

    @property
    def label(self) -> str:
        # Looked up, not worked out: Enum.name is a descriptor, and every call asks.
        return _LABELS[self]


_LABELS = {kind: kind.name.lower() for kind in Kind}


class AbortKind(enum.IntEnum):
    """Why a rank broke its communicator; decides what its peers raise."""

    FAILED = 1  # the rank named in the frame failed (connection lost)
    CANCELLED = 2  # the rank named in the frame was cancelled by its caller
    MISMATCH = 3  # the rank named in the frame saw mismatched collectives
    PROTOCOL = 4  # the rank named in the frame received malformed bytes
    ERROR = 5  # anything else (an exception in the aborting rank)
    #: The rank named in the frame closed the communicator, with no error: after the
    #: collective before the frame's (it finished that one), or during the frame's.
    CLOSED = 6


# Wire codes of the supported dtypes; 0 means "no data" (barrier).
DTYPES: tuple[np.dtype[np.generic], ...] = tuple(
    np.dtype(name)
    for name in (
        "int8",
        "int16",
        "int32",
        "int64",
        "uint8",
        "uint16",
        "uint32",
        "uint64",
        "float16",
        "float32",
        "float64",
        "complex64",
        "complex128",
        "bool",
    )
)
DTYPE_CODES: dict[np.dtype[np.generic], int] = {dt: i + 1 for i, dt in enumerate(DTYPES)}
# Reduce op codes, index = code - 1; order is part of the wire format.
OP_NAMES: tuple[str, ...] = ("sum", "mean", "min", "max", "prod", "band", "bor", "bxor")
#: The kinds whose frames carry a reduce op, and those whose frames carry a root.
_WITH_OP = frozenset(("allreduce", "reduce_scatter", "reduce", "scan", "exscan"))
_WITH_ROOT = frozenset(("broadcast", "reduce", "gather", "gatherv", "scatter", "scatterv"))
#: numpy's limit on an array's dimensions.
MAX_NDIM = 64
#: The uneven calls whose first frames carry, as their count, the length of the vector of
#: counts they exchange: their arrays' number of dimensions plus this.
_COUNT_OVER_NDIM = {Kind.ALLGATHERV: 1, Kind.GATHERV: 1, Kind.ALLTOALLV: 0}
#: The calls whose frames carry data of trioring's own, not the caller's (split and dup
#: exchange each rank's color and key): named without it.
_OWN_DATA = frozenset((Kind.SPLIT, Kind.DUP))


class OpSpec(NamedTuple):
    """The identity of one collective call, as every frame of it carries. Immutable; make a
    variant with ``spec._replace(count=...)``.

    A NamedTuple rather than an ``attrs.frozen`` class: every collective call makes one,
    and a frozen attrs instance took 0.52 us to make (a ``setattr`` per field) against 0.27
    for the tuple, measured in a loop; timed in place, in the shared segment's 4-byte
    allreduce (11-14 us at world 2), it went from 0.9-1.4 us to 0.5-0.9 (bench/percall.py)."""

    kind: Kind
    seq: int
    dtype_code: int = 0
    count: int = 0  # type: ignore[assignment]  # shadows tuple.count, which nothing here uses
    op_code: int = 0
    root: int = NO_ROOT
    #: Not on the wire: for the uneven calls whose rows differ by rank (allgatherv, gatherv,
    #: alltoallv), the shape of their arrays after the rows, so that a rank names its own
    #: call as ``allgatherv float32[rows, 3] #4`` (see :meth:`describe`).
    trailing: tuple[int, ...] | None = None
    #: Not on the wire: the method the caller called, where this call is one step of it
    #: (``broadcast_object``, whose steps are broadcasts), so that every message about the
    #: call names what the caller wrote as well (see :meth:`named`).
    within: str | None = None

    def named(self) -> str:
        """``allgatherv #4``, or ``allgatherv #4 (in allgather_object)``."""
        if self.within is None:
            return f"{self.kind.label} #{self.seq}"
        return f"{self.kind.label} #{self.seq} (in {self.within})"

    def describe(self, rows: int | None = None) -> str:
        """``allreduce(sum) float32[1000] #17``, ``broadcast(root=0) ...``, ``barrier #3``,
        ``split #2``; an uneven call as ``allgatherv float32[rows, 3] #4`` (its rows may
        differ by rank; ``float32[2, 3]`` given ``rows``), or, from a peer's frame, where
        only the number of dimensions travels (the count of those calls' first frames,
        whose identity the ranks compare; the frames of their data, which follow from
        counts every rank agreed, carry totals), ``allgatherv float32[rows, *] #4``; a step
        of another method ends with it: ``broadcast(root=0) uint8[4096] #1 (in
        broadcast_object)`` (only this rank knows: a peer's frames do not say)."""
        text = self._describe(rows)
        return text if self.within is None else f"{text} (in {self.within})"

    def _describe(self, rows: int | None) -> str:
        if (self.kind is Kind.BARRIER and not self.dtype_code) or self.kind in _OWN_DATA:
            return f"{self.kind.label} #{self.seq}"
        label = self.kind.label
        args = []
        if label in _WITH_OP or self.kind is Kind.REDUCE_SCATTERV:
            args.append(OP_NAMES[self.op_code - 1] if 0 < self.op_code <= len(OP_NAMES) else "?")
        if label in _WITH_ROOT:
            args.append(f"root={self.root}")
        elif self.kind is Kind.REDUCE_SCATTERV:
            # The root field carries a CRC of the counts (see _collectives._reduce).
            args.append(f"counts #{self.root:08x}")
        head = f"{label}({', '.join(args)})" if args else label
        if not self.dtype_code and not self.count:
            # A call whose dtype is not known yet (a scatter's header round, which goes
            # through the shared segment as the call itself).
            return f"{head} #{self.seq}"
        if 0 < self.dtype_code <= len(DTYPES):
            dtype = DTYPES[self.dtype_code - 1].name
        else:
            dtype = f"dtype#{self.dtype_code}"
        if self.trailing is not None:
            first = "rows" if rows is None else str(rows)
            return f"{head} {dtype}[{', '.join([first, *map(str, self.trailing)])}] #{self.seq}"
        if (extra := _COUNT_OVER_NDIM.get(self.kind)) is not None and (
            0 < self.count - extra <= MAX_NDIM
        ):
            dims = ", ".join(["rows"] + ["*"] * (self.count - extra - 1))
            return f"{head} {dtype}[{dims}] #{self.seq}"
        return f"{head} {dtype}[{self.count}] #{self.seq}"


def pack_data_header(
    buffer: bytearray | memoryview, spec: OpSpec, offset: int, nbytes: int
) -> None:
    """Write the header of the DATA frame of ``spec`` carrying ``nbytes`` at element
    ``offset`` into ``buffer`` (at least ``HEADER.size`` bytes)."""
    HEADER.pack_into(
        buffer,
        0,
        MAGIC,
        VERSION,
        FrameType.DATA,
        spec.kind,
        spec.op_code,
        spec.dtype_code,
        spec.root,
        spec.seq,
        spec.count,
        offset,
        nbytes,
    )


def pack_abort_frame(
    kind: AbortKind, subject: int, seq: int, reason: str, reporter: int
) -> tuple[bytes, bytes]:
    """The header and the payload (the reason, cut to ``MAX_REASON_BYTES``) of an ABORT
    frame: ``subject`` is the rank the news is about, ``reporter`` the one that noticed."""
    data = reason.encode("utf-8", "replace")[:MAX_REASON_BYTES]
    header = HEADER.pack(
        MAGIC, VERSION, FrameType.ABORT, kind, 0, 0, subject, seq, reporter, 0, len(data)
    )
    return header, data


def describe_remote(kind: int, seq: int, dtype: int, count: int, op: int, root: int) -> str:
    try:
        return OpSpec(Kind(kind), seq, dtype, count, op, root).describe()
    except ValueError:
        return f"unknown collective kind {kind} #{seq}"


_WHAT_HAPPENED: dict[int, tuple[type[CollectiveError], str]] = {
    AbortKind.FAILED: (PeerFailedError, "failed"),
    AbortKind.MISMATCH: (CollectiveMismatchError, "detected mismatched collectives"),
    AbortKind.PROTOCOL: (ProtocolError, "received malformed data"),
}


def abort_error(
    rank: int,
    sender: int,
    spec: OpSpec,
    kind: int,
    subject: int,
    seq: int,
    reason: str,
    reporter: int,
    job_id: str | None = None,
) -> CollectiveError:
    """The exception a rank raises on receiving an abort frame from ``sender``, carrying what
    to tell its own peers in turn."""
    where = f"rank {rank}: {spec.named()}"
    label = spec.kind.label
    about_self = subject == rank
    error: CollectiveError
    if kind == AbortKind.FAILED and about_self:
        # The reporter lost its connection to *us* and says so: from here, it is the
        # reporter whose link failed, not this (live) rank.
        via = "" if reporter == sender else f" (relayed by rank {sender})"
        message = f"{where}: rank {reporter} lost its connection to this rank{via}: {reason}"
        error = PeerFailedError(
            message, rank=rank, peer=reporter, collective=label, seq=spec.seq, job_id=job_id
        )
    elif kind in _WHAT_HAPPENED or kind == AbortKind.CLOSED:
        via = "" if subject == sender else f" (relayed by rank {sender})"
        if kind == AbortKind.CLOSED:
            # "closed its communicator after collective #92": a rank that left early
            # (returned, skipped a call the others made, or caught a cancellation).
            cls: type[CollectiveError] = PeerFailedError
            told = f"{reason}{via}"
        else:
            cls, what = _WHAT_HAPPENED[kind]
            told = f"{what}{via}: {reason}"
        error = cls(
            f"{where}: rank {subject} {told}",
            rank=rank,
            peer=subject,
            collective=label,
            seq=spec.seq,
            job_id=job_id,
        )
        if isinstance(error, CollectiveMismatchError):
            # Seen elsewhere: of the calls, this rank knows its own.
            error.calls = {rank: spec.describe()}
    else:
        via = "" if subject == sender else f" (relayed by rank {sender})"
        if kind == AbortKind.CANCELLED and reason.startswith("cancelled "):
            # The canceller says what it cancelled, after how long and while waiting for
            # whom (see Communicator._run): "cancelled allreduce #22 after 5.0 s while
            # waiting for rank 2". ``reason`` stays "cancelled", as for any cancellation.
            message, short = f"{where}: rank {subject} {reason}{via}", "cancelled"
        else:
            verb = "cancelled" if kind == AbortKind.CANCELLED else "aborted"
            message = f"{where}: rank {subject} {verb} collective #{seq}{via}: {reason}"
            short = reason
        error = PeerAbortedError(
            message,
            reason=short,
            rank=rank,
            peer=subject,
            collective=label,
            seq=spec.seq,
            job_id=job_id,
        )
    # Passed on as is, except news of our own failure: that is news of the reporter's link.
    error._trioring_abort = (kind, reporter if about_self else subject, reason, reporter)
    error._trioring_about_self = about_self
    return error
