"""The exception hierarchy.

Every exception trioring raises on purpose derives from :class:`TrioringError`::

    TrioringError
    ├── ConfigurationError (a ValueError)    bad argument or environment; no I/O
    ├── InvalidArgumentError (a ValueError)  bad array, op or root; no I/O
    ├── TransportUnavailable                 the transport cannot run here
    ├── RendezvousError                      the world could not be assembled
    ├── CommunicatorClosedError              this rank closed the communicator
    ├── CommunicatorBusyError                two tasks used one communicator at once
    ├── ConcurrentOpenError                  two tasks opened one rank at once
    └── CollectiveError                      a collective failed; it is broken
        ├── PeerFailedError                  a peer died or became unreachable
        ├── PeerAbortedError                 a peer gave up and said why
        ├── CollectiveMismatchError          ranks called different collectives
        ├── ProtocolError                    malformed or unexpected bytes
        └── CommunicatorBrokenError          an earlier collective failed here

Every exception carries the context it happened in as attributes (``rank``, ``peer``,
``collective``, ``seq``; ``None`` where not applicable) and names the same facts in its message,
so that a log line from any rank says which rank did what.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, final

if TYPE_CHECKING:
    from collections.abc import Mapping

__all__ = [
    "CollectiveError",
    "CollectiveMismatchError",
    "CommunicatorBrokenError",
    "CommunicatorBusyError",
    "CommunicatorClosedError",
    "ConcurrentOpenError",
    "ConfigurationError",
    "InvalidArgumentError",
    "PeerAbortedError",
    "PeerFailedError",
    "ProtocolError",
    "RendezvousError",
    "TransportUnavailable",
    "TrioringError",
]


class TrioringError(Exception):
    """Base class of every error trioring raises on purpose.

    Attributes:
        rank: the rank that raised it, when known.
        peer: the other rank involved (the one that failed, aborted or disagreed), if any.
        collective: the collective that was running (``"allreduce"``, ``"broadcast"``,
            ``"barrier"``, ``"rendezvous"``), if any.
        seq: the collective's sequence number on this communicator (1 for the first), if any.
        job_id: the job's id (``TRIORING_JOB_ID`` or the launcher's), when there is one; the
            message then ends with ``[job <id>]``.
    """

    def __init__(
        self,
        message: str,
        *,
        rank: int | None = None,
        peer: int | None = None,
        collective: str | None = None,
        seq: int | None = None,
        job_id: str | None = None,
    ) -> None:
        super().__init__(f"{message} [job {job_id}]" if job_id else message)
        self._bare_message = message
        self.rank = rank
        self.peer = peer
        self.collective = collective
        self.seq = seq
        self.job_id = job_id


@final
class ConfigurationError(TrioringError, ValueError):
    """An argument or environment variable of :func:`trioring.open_communicator` is missing or
    invalid. Raised before any I/O; the message names the variable or argument.

    Also raised when :func:`trioring.open_communicator` or
    :func:`trioring.testing.open_local_world` is called outside ``trio.run`` (from asyncio,
    say): trioring runs only under Trio."""


@final
class InvalidArgumentError(TrioringError, ValueError):
    """A collective was called with an array, op or root it cannot accept (non-contiguous,
    read-only, unsupported dtype, ``min`` on complex numbers, root out of range, ...).

    Raised on the calling rank before any I/O; the communicator stays usable and the
    sequence number is not consumed. Other ranks are not told: if they went ahead, their
    collective waits for this one, so fix the call rather than catching this.
    """


@final
class TransportUnavailable(TrioringError):
    """The requested transport is known but cannot be used here.

    Attributes:
        transport: the transport's registered name.
        reason: why it is unavailable, in words (the same as
            ``trioring.capabilities()`` reports).
    """

    def __init__(self, transport: str, reason: str) -> None:
        super().__init__(f"transport {transport!r} is not available here: {reason}")
        self.transport = transport
        self.reason = reason


@final
class RendezvousError(TrioringError):
    """The ranks could not be assembled into a world: inconsistent world sizes, a duplicate
    rank, a listener that cannot be bound, a peer that cannot be reached at the address it
    published, or a malformed handshake."""


@final
class CommunicatorClosedError(TrioringError):
    """The communicator was closed on this rank (by ``aclose()`` or by leaving
    ``open_communicator``) and cannot be used any more."""


@final
class CommunicatorBusyError(TrioringError):
    """Another task of this process is already running a collective on this communicator.

    Collectives on one communicator must be called one at a time and in the same order on
    every rank; run concurrent work on separate communicators. Raised before any I/O; the
    running collective is not disturbed.
    """


@final
class ConcurrentOpenError(TrioringError):
    """:func:`trioring.open_communicator` was called while another call of this process was
    still opening the same rank of the same world (same transport, rendezvous address or
    socket directory, and job id), for example to run collectives on two communicators at
    once.

    Raised at once, before any I/O, by the second call; since every rank makes the same calls,
    every rank raises it. The first call is not disturbed. Run the collectives one after
    another on one communicator instead, or open the second communicator once the first is
    open: with the same settings, that works (and collectives on both may then run at once).
    """


class CollectiveError(TrioringError):
    """A collective failed. The communicator that raised it is broken for good: every later
    call raises :class:`CommunicatorBrokenError`, and its peers have been told or will notice
    promptly. Open a new communicator to continue."""

    # (abort kind, rank the news is about, reason) when this error was relayed by a peer's
    # abort frame, so that passing the news on keeps the original subject and reason.
    #: For an error that came in an abort frame: what to tell peers in turn (kind, subject,
    #: reason, reporter), and whether the news was about this very rank.
    _trioring_abort: tuple[int, int, str, int] | None = None
    _trioring_about_self: bool = False
    #: For a lost connection: it ended between two frames, without an abort frame.
    _trioring_clean_close: bool = False
    #: For a lost connection: the peer closed it (an end of file, or a reset) in the middle
    #: of a frame, as a peer that gives up because of another rank may (see
    #: CommunicatorCore._relayed_cause).
    _trioring_cut_short: bool = False
    #: For an error in a sub-communicator, whose ranks (``rank``, ``peer``, and those in the
    #: message) are its own: the world rank of each of them.
    _trioring_world_ranks: tuple[int, ...] | None = None


@final
class PeerFailedError(CollectiveError):
    """A peer's connection died: end of file, connection reset or broken pipe, whatever the
    socket said. ``peer`` is the rank that failed, which may differ from the rank whose
    connection reported it when a neighbour relayed the news."""


@final
class PeerAbortedError(CollectiveError):
    """A peer abandoned the collective and said why, for example because its caller's cancel
    scope fired (``reason`` is then ``"cancelled"``).

    Attributes:
        reason: the reason the aborting rank gave.
    """

    def __init__(
        self,
        message: str,
        *,
        reason: str,
        rank: int | None = None,
        peer: int | None = None,
        collective: str | None = None,
        seq: int | None = None,
        job_id: str | None = None,
    ) -> None:
        super().__init__(
            message, rank=rank, peer=peer, collective=collective, seq=seq, job_id=job_id
        )
        self.reason = reason


@final
class CollectiveMismatchError(CollectiveError):
    """Two ranks ran different collectives at the same point: a different kind, sequence
    number, dtype, element count, reduce op or root. The message names both sides, e.g.
    ``rank 0: allreduce(sum) float32[1000] #17, rank 1: allreduce(sum) float64[1000] #17``.

    Attributes:
        calls: each side's call as the message names it, by rank (of the communicator that
            raised): ``{0: "allreduce(sum) float32[1000] #17", 1: "allreduce(sum)
            float64[1000] #17"}``; empty where the disagreement is not about the calls
            themselves (a gatherv root's ``out=`` too small for what the ranks send).
            ``trioring run`` gathers them from every rank to say whose call differs from
            the others'.
    """

    def __init__(
        self,
        message: str,
        *,
        calls: Mapping[int, str] | None = None,
        rank: int | None = None,
        peer: int | None = None,
        collective: str | None = None,
        seq: int | None = None,
        job_id: str | None = None,
    ) -> None:
        super().__init__(
            message, rank=rank, peer=peer, collective=collective, seq=seq, job_id=job_id
        )
        self.calls: dict[int, str] = dict(calls or {})


@final
class ProtocolError(CollectiveError):
    """Bytes on a connection did not follow the wire protocol (bad magic, version or length,
    or a frame at an unexpected offset)."""


@final
class CommunicatorBrokenError(CollectiveError):
    """An earlier collective failed (or was cancelled) on this rank, so the communicator is
    broken. The original error is this exception's ``__cause__``."""


#: How the note that maps a sub-communicator's ranks to the world's begins.
RANKS_NOTE = "ranks above are those of "


def ranks_note(exc: BaseException) -> str | None:
    """The note that maps the ranks named by ``exc`` (or by the error that caused it) to the
    world's, for an error of a sub-communicator: ``"ranks above are those of split #2 of
    world (color 1); as world ranks: 0->1, 1->3"``; None when there is none."""
    error: BaseException | None = exc
    while error is not None:
        if isinstance(error, CollectiveError) and error._trioring_world_ranks is not None:
            notes = [n for n in getattr(error, "__notes__", []) if n.startswith(RANKS_NOTE)]
            return notes[-1] if notes else None
        error = error.__cause__
    return None


def echoed_ranks(exc: BaseException) -> frozenset[int] | None:
    """The ranks (of the world) whose failure ``exc`` only reports, or None if ``exc`` is a
    failure of its own. An echo is a :class:`PeerFailedError` or :class:`PeerAbortedError`
    about another rank, a collective error relayed by a peer's abort frame about another
    rank, a :class:`CommunicatorBrokenError` caused by an echo, or an exception group of
    nothing but echoes. (``trioring run`` prints an echo in one line; a rank that leaves a
    communicator on an echo passes the news on.)"""
    if isinstance(exc, BaseExceptionGroup):
        ranks: set[int] = set()
        for inner in exc.exceptions:
            echoed = echoed_ranks(inner)
            if echoed is None:
                return None
            ranks |= echoed
        return frozenset(ranks)
    if isinstance(exc, CommunicatorBrokenError):
        cause = exc.__cause__
        return None if cause is None else echoed_ranks(cause)
    if not isinstance(exc, CollectiveError) or exc.peer is None or exc.peer == exc.rank:
        return None
    relayed = exc._trioring_abort is not None
    if isinstance(exc, PeerFailedError | PeerAbortedError) or relayed:
        peer = world_rank(exc, exc.peer)
        return None if peer is None else frozenset({peer})
    return None


def world_rank(error: CollectiveError, rank: int) -> int | None:
    """The world's rank of ``rank``, a rank of the communicator that raised ``error`` (the
    same rank unless it is a sub-communicator); None if it has no such rank."""
    world = error._trioring_world_ranks
    if world is None:
        return rank
    return world[rank] if 0 <= rank < len(world) else None
