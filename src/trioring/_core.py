"""What every collective call goes through, whatever its family: the Communicator's state
(open / broken / closed), sequencing, the busy rule, and what happens when a call fails or is
cancelled (the abort frames that tell the peers, then closing everything). The public
methods live in :mod:`trioring._communicator` and the family modules of
:mod:`trioring._methods`, each of which validates, picks an algorithm and calls
:meth:`CommunicatorCore._run`."""

from __future__ import annotations

import contextlib
import contextvars
import enum
import functools
import hashlib
import logging
from typing import TYPE_CHECKING

import numpy as np
import trio

from . import _algorithms
from ._collectives import _allreduce, _decision
from ._concurrency import cancel_cause, first_leaf, is_cancellation, run_with_grace
from ._errors import (
    RANKS_NOTE,
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
    echoed_ranks,
    ranks_note,
)
from ._framing import Link, WaitCount
from ._p2p import Leaving, Scope
from ._wire import NO_ROOT, AbortKind, Kind, OpSpec

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Iterator

    from ._collectives._checks import Identity
    from ._family import Family

__all__ = ["DEFAULT_CHUNK_BYTES", "CommunicatorCore", "State", "steps_of"]

#: Bytes per frame of bulk data. Large enough that per-frame costs vanish, small enough that a
#: ring step streams (and that the reusable scratch buffer stays small).
DEFAULT_CHUNK_BYTES = 1024 * 1024
#: How long a breaking communicator spends telling its peers why, before closing anyway.
_ABORT_NOTICE_SECONDS = 0.25
_logger = logging.getLogger("trioring")
_PAGE = 4096

#: The identity of a call that has only its kind (a barrier's).
_NO_IDENTITY: Identity = (0, 0, 0, NO_ROOT, None)

#: The method whose steps the current task's collectives are (``broadcast_object``, whose
#: steps are broadcasts), for the messages about them: a user who never called a broadcast
#: is told which call of theirs it was. A context variable, so it is the task's own (Trio
#: gives each task a copy of its parent's context): another task's call is not named so.
_WITHIN: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "trioring_within", default=None
)


@contextlib.contextmanager
def steps_of(method: str) -> Iterator[None]:
    """The collectives this task calls inside the block are steps of ``method``."""
    token = _WITHIN.set(method)
    try:
        yield
    finally:
        _WITHIN.reset(token)


def _bare(exc: BaseException) -> str:
    """``exc``'s message without the job id a TrioringError appends (a peer's error adds
    its own)."""
    return exc._bare_message if isinstance(exc, TrioringError) else str(exc)


def comm_id(key: str) -> int:
    """The 64-bit id of the communicator named ``key`` in point-to-point frames: identical
    on every member, and two names of one world collide with probability 2**-64."""
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")


class State(enum.Enum):
    OPEN = "open"
    BROKEN = "broken"
    CLOSED = "closed"


def _aligned_scratch(nbytes: int) -> np.ndarray[tuple[int], np.dtype[np.uint8]]:
    # Page-aligned: glibc memcpy is ~10x slower when source and destination are 16 bytes
    # apart modulo 4096, which an arbitrary malloc'ed buffer can be.
    raw = np.zeros(nbytes + _PAGE, dtype=np.uint8)
    start = (-raw.ctypes.data) % _PAGE
    return raw[start : start + nbytes]


class CommunicatorCore:
    """The machinery under :class:`trioring.Communicator` (see its docstring for the
    contract this implements)."""

    def __init__(
        self,
        *,
        rank: int,
        world_size: int,
        family: Family,
        links: dict[int, Link],
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        job_id: str = "",
        key: str = "world",
        members: tuple[int, ...] | None = None,
        parent: CommunicatorCore | None = None,
        label: str = "",
    ) -> None:
        self._job_id = job_id or None
        self._rank = rank
        self._world_size = world_size
        self._family = family
        self._links = links
        #: This communicator's name in the world (identical on its members, unique in the
        #: world: "world", "world/split#4/1", ...), the world rank of each of its ranks, the
        #: communicator it was made from, and those made from it that are still open.
        self._key = key
        self._members = members if members is not None else tuple(range(world_size))
        self._parent = parent
        self._children: list[CommunicatorCore] = []
        #: "" for the world communicator; "split #4 of world (color 1)" for a child.
        self._label = label
        self._scope = Scope(comm_id=comm_id(key), rank=rank, members=self._members, label=label)
        family.endpoint.register(self._scope)
        self._seq = 0
        self._state = State.OPEN
        self._broken_by: BaseException | None = None
        #: Why this rank leaves (see _leave_because and _break): told to the peers' pending
        #: point-to-point calls on this communicator. None: a plain close.
        self._leaving: Leaving | None = None
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
        # The decision table's limits that depend on this world, worked out once: the
        # segment's reductions' (kept on the world as slot_reduce_bytes and
        # slot_wide_reduce_bytes, where the reduce family's planners find them too) and
        # recursive doubling's.
        _allreduce.shm_bytes(self._world)
        self._small_allreduce_bytes = min(
            _decision.SMALL_ALLREDUCE_BYTES, self._world.scratch.nbytes
        )
        #: Algorithms forced per collective (see _force_algorithm); empty by default.
        self._forced: dict[str, str] = {}

    def _where(self, kind: Kind, seq: int | None = None) -> str:
        where = f"rank {self._rank}: {kind.label} #{self._seq + 1 if seq is None else seq}"
        within = _WITHIN.get()
        return where if within is None else f"{where} (in {within})"

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
        if self._state is State.OPEN and self._running is None:
            return  # the common case, in two comparisons
        if self._state is State.CLOSED:
            raise CommunicatorClosedError(
                f"{self._where(kind)}: the communicator{self._named} is closed",
                rank=self._rank,
                job_id=self._job_id,
                collective=kind.label,
                seq=self._seq + 1,
            )
        if self._state is State.BROKEN:
            if self._broken_by is not None and is_cancellation(self._broken_by):
                what, detail = self._cancelled or (f"collective #{self._seq}", "")
                why = f"{what} was cancelled{detail}"
            else:
                why = (
                    f"collective #{self._seq} failed "
                    f"({type(self._broken_by).__name__}: {self._broken_by})"
                )
            raise CommunicatorBrokenError(
                f"{self._where(kind)}: the communicator{self._named} is broken since {why}; "
                "open a new communicator",
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

    def _check_open_for_messages(self, what: str) -> None:
        """Point-to-point calls need an open communicator, but not an idle one (any number
        of tasks may send and receive while a collective runs)."""
        if self._state is State.OPEN:
            return
        if self._state is State.CLOSED:
            raise self._closed_error(what)
        raise self._broken_error(what)

    def _closed_error(self, what: str) -> CommunicatorClosedError:
        return CommunicatorClosedError(
            f"rank {self._rank}: {what}: the communicator{self._named} is closed",
            rank=self._rank,
            job_id=self._job_id,
            collective=what.partition("(")[0],
        )

    def _broken_error(self, what: str) -> CommunicatorBrokenError:
        error = CommunicatorBrokenError(
            f"rank {self._rank}: {what}: the communicator{self._named} is broken since "
            f"collective #{self._seq} failed ({type(self._broken_by).__name__}: "
            f"{self._broken_by}); open a new communicator",
            rank=self._rank,
            job_id=self._job_id,
            collective=what.partition("(")[0],
        )
        error.__cause__ = self._broken_by
        return error

    @property
    def _named(self) -> str:
        return f" ({self._label})" if self._label else ""

    async def _close_tree(self) -> None:
        """Close the communicators made from this one (first, since they may be made from
        it only while it is open), then this one's connections; the pending calls of each
        raise CommunicatorClosedError. The point-to-point plane and the listener are the
        world's: :meth:`Communicator.aclose` closes them with the world communicator."""
        for child in list(self._children):
            await child._close_tree()
        if self._state is not State.CLOSED:
            was_open = self._state is State.OPEN
            self._state = State.CLOSED
            await self._family.endpoint.leave(
                self._scope.comm_id, self._closed_error, self._leaving
            )
            if was_open:
                self._say_closing()
            with trio.CancelScope(shield=True):
                await self._close_connections()
        if self._parent is not None and self in self._parent._children:
            self._parent._children.remove(self)

    async def _run(
        self,
        kind: Kind,
        body: Callable[[OpSpec], Awaitable[None]],
        identity: Identity = _NO_IDENTITY,
    ) -> None:
        """Run ``body`` as the next collective call, of ``identity``'s fields (see
        :data:`~._collectives._checks.Identity`; a family's planner returns them, with the
        body, having checked the arguments: its Refused becomes the method's
        InvalidArgumentError before any I/O, so the communicator stays usable).

        The methods call their planner and this directly, with the identity as one tuple:
        through a helper coroutine that called a planner in a lambda and passed its
        identity as a dict of keywords, a reduce took 1-2 us longer, from the caches the
        benchmark's calls leave (bench/paired.py -n 2 --sizes 4,64K --collective reduce,
        four launches each, alternating, trioring's median: 64 KiB 24.0-25.4 us against
        22.1-23.2, 4 bytes 18.6-20.6 against 17.6-18.0 and once 26.1); through a plain
        function that called the planner (and passed the identity on as ``*identity``),
        64 KiB 23.1-23.5 against 23.7-24.6 (and 21.9-23.1 with no helper)."""
        self._check_usable(kind)
        # An already-cancelled caller gets Cancelled here, before any I/O, so the communicator
        # stays usable.
        await trio.lowlevel.checkpoint_if_cancelled()
        self._seq += 1
        spec = OpSpec(kind, self._seq, *identity, _WITHIN.get())
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
            if cause is not exc:
                cause.add_note(f"first noticed on this rank as: {type(exc).__name__}: {exc}")
            if self._label:
                # Its ranks are not the world's: for the reader, and for trioring run,
                # which must not take "rank 1" of a split for the world's rank 1.
                cause.add_note(self._ranks_note())
                cause._trioring_world_ranks = self._members
            if cause is exc:
                raise
            raise cause from exc
        except BaseException as exc:
            if is_cancellation(exc):
                # When every rank's deadline fires at once nobody gets an abort frame, and
                # trio.fail_after raises a TooSlowError of its own in place of this
                # Cancelled: so say here, on the Cancelled, in the abort frame and in every
                # later call's error, what was cancelled and whom it was waiting for. Only
                # now is that worked out, from what the waits left behind.
                what = spec.named()
                detail = _algorithms.interrupted_wait(self._world, spec) + cancel_cause(exc)
                self._cancelled = (what, detail)
                message = f"rank {self._rank}: {what} cancelled{detail}"
                if self._job_id:
                    message += f" [job {self._job_id}]"
                if self._label:
                    # Its ranks are not the world's: "rank 0" alone points at another process.
                    message += f"; {self._ranks_note()}"
                _logger.warning("%s", message)
                exc.add_note(message)
            await self._break(exc, spec)
            raise
        finally:
            self._running = None

    def _ranks_note(self) -> str:
        """For an error in a sub-communicator: its ranks are not the world's."""
        pairs = ", ".join(f"{r}->{w}" for r, w in enumerate(self._members))
        return f"{RANKS_NOTE}{self._label}; as world ranks: {pairs}"

    async def _relayed_cause(self, error: CollectiveError, spec: OpSpec) -> CollectiveError:
        """A lost connection is often the echo of a failure elsewhere: a neighbour broke
        because of it and closed before it could tell us. Its other neighbours did get an
        abort frame through, so look briefly on every link for one, and report the original
        cause (the rank that died, was cancelled or saw the mismatch) instead of the echo;
        failing that, where the peer closed ours in the middle of a frame, a peer whose
        connection ended between two frames without a word (it died). Not for a peer that
        became unreachable: its own failure is the news (and a partition's far side may
        well have closed on us meanwhile)."""
        if not isinstance(error, PeerFailedError) or error._trioring_abort is not None:
            return error
        found: list[CollectiveError] = []
        died: list[CollectiveError] = []

        async def look(link: Link) -> None:
            abort = await link.pending_abort(spec)
            if abort is not None and abort._trioring_abort is None:
                if link.peer != error.peer:
                    died.append(abort)  # its connection ended between frames, unexplained
                return
            # News that a peer lost its connection to *us* only echoes what we saw ourselves,
            # and news that the same peer failed only repeats it, less precisely.
            if abort is None or abort._trioring_about_self:
                return
            if isinstance(abort, PeerFailedError) and abort.peer == error.peer:
                return
            found.append(abort)

        async with trio.open_nursery() as nursery:
            if error._trioring_clean_close:
                # A live peer that gives up says why on every link it is not in the middle
                # of a frame on, before it closes: a connection that ended between frames
                # without a word means the peer itself died or left. Tell the others now
                # rather than after the look: otherwise every survivor that saw it (on one
                # host, all of them) waits out the whole look for the others' news, which
                # they hold back for their own looks. bench/fault_latency.py, a rank killed
                # in an allreduce over Unix sockets: the median survivor raised 60 ms after
                # at world 4 (50 of them this look), 8 ms with this. The exception, a peer
                # whose abort frame did not fit in our receive buffer before it closed, is
                # still found by the look for this rank's own error; its peers may then
                # name that peer rather than the cause.
                nursery.start_soon(self._tell_peers, self._abort_notice(error), spec.seq)
            for link in self._links.values():
                nursery.start_soon(look, link)
        if found:
            return max(found, key=lambda e: 2 if isinstance(e, CollectiveMismatchError) else 1)
        if died and error._trioring_cut_short:
            # The connection that failed here ended in the middle of a frame: its peer gave
            # up, most likely because of another rank, and could say nothing on it. A peer
            # whose connection ended between two frames without a word died (a live one
            # says why first): name it, the cause, rather than the echo. The chaos trials
            # (seed 2537, a rank killed in a reduce_scatter at world 4 over plain sockets)
            # named the echo in 1 run of 2 before.
            return min(died, key=lambda e: e.peer if e.peer is not None else -1)
        return error

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
        message = _bare(exc)
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
        if self._state is State.OPEN:
            self._state = State.BROKEN
            self._broken_by = exc
        notice = self._abort_notice(exc)
        with trio.CancelScope(shield=True):
            await self._tell_peers(notice, spec.seq)
            await self._close_connections()
        if self._state is State.BROKEN:
            # Told to the peers' point-to-point calls when it closes (see leave_later): what
            # broke it, and the rank the abort frame names where that is another.
            subject = notice[1]
            culprit = self._members[subject] if subject != self._rank else None
            if is_cancellation(exc):
                detail = self._cancelled[1] if self._cancelled is not None else ""
                text = f"when {spec.named()} was cancelled there{detail}"
            else:
                text = f"when {spec.named()} failed there ({type(exc).__name__}: {_bare(exc)})"
            self._leaving = Leaving(text, culprit)
            self._family.endpoint.leave_later(
                self._scope.comm_id, self._broken_error, self._leaving
            )

    async def _leave_because(self, exc: BaseException) -> None:
        """``exc`` escaped the block that holds this communicator, which closes next: tell
        the peers why first, so that one waiting for this rank in a collective, or calling
        one later, raises :class:`PeerAbortedError` with the reason (or, when ``exc`` only
        reported another rank's failure, :class:`PeerFailedError` naming that rank) instead
        of a bare closed connection; the peers' point-to-point calls that wait for this
        rank hear the same when it closes (``_leaving``). Sub-communicators first. Nothing
        for a broken communicator (its peers were told when it broke) or a closed one.
        Shielded: a cancellation that is leaving is told too."""
        for child in list(self._children):
            await child._leave_because(exc)
        if self._state is not State.OPEN:
            return
        me = self._rank
        # ``why`` completes the collective notice "it left its communicator ...", ``said``
        # what its point-to-point peers read, "rank 1 left this communicator ...".
        if is_cancellation(exc):
            why = "cancelled (by its caller's deadline or cancel scope)"
            said = "on a cancellation (by its caller's deadline or cancel scope)"
        else:
            leaf, count = first_leaf(exc)
            text = _bare(leaf)
            why = f"on {type(leaf).__name__}" + (f": {text}" if text else "")
            if leaf is not exc:
                # A nursery in the block raised its task's failure in a group, whose own
                # text ("Exceptions from Trio nursery") says nothing.
                of = f"the first of {count} " if count > 1 else ""
                why += f" ({of}in an exception group)"
            said = why
        echoed = echoed_ranks(exc)
        if (
            echoed is not None
            and len(echoed) == 1
            and (culprit := next(iter(echoed))) in (members := self._members)
        ):
            # It leaves because another rank failed, in another communicator: pass that on,
            # as a breaking collective relays news, so that its peers blame the culprit and
            # not this rank (in this communicator's ranks; the text keeps the other's).
            text = _bare(exc)
            if (note := ranks_note(exc)) is not None:
                text += f" [{note}]"
                said += f" [{note}]"
            notice = (AbortKind.FAILED, members.index(culprit), text, me)
            self._leaving = Leaving(said, culprit)
        else:
            notice = (AbortKind.ERROR, me, f"it left its communicator {why}", me)
            self._leaving = Leaving(said)
        await self._tell_peers(notice, self._seq + 1)

    def _say_closing(self) -> None:
        """Tell the peers that this communicator closes with no error, and after (or during)
        which collective: a peer still waiting for this rank, or calling a collective later,
        then raises PeerFailedError saying so (``rank 2 closed its communicator after
        collective #92``), not only that the connection ended. At the end of a program
        nobody reads it. A peer still finishing this rank's last collective leaves a notice
        about the next one unread (see Link); so does one on the segment, which finds this
        call finished beside the broken mark. Only what the connections take at once."""
        me = self._rank
        if self._running is not None:
            reason, seq = f"closed its communicator during collective #{self._seq}", self._seq
        else:
            reason, seq = f"closed its communicator after collective #{self._seq}", self._seq + 1
        if self._world.shm is not None:
            # As for an abort: a peer waiting on the segment then looks at the connection.
            self._world.shm.mark_broken()
        for link in self._links.values():
            link.send_closing(me, seq, reason)

    async def _tell_peers(self, notice: tuple[AbortKind, int, str, int], seq: int) -> None:
        """Send every link not left mid-frame the abort frame ``notice`` (kind, subject,
        reason, reporter) about collective ``seq`` (best effort, for at most
        ``_ABORT_NOTICE_SECONDS``, shielded); a link told once is not told again."""
        kind, subject, reason, reporter = notice
        if self._world.shm is not None:
            # Before the abort frames: a peer that finds this on the segment reads one.
            self._world.shm.mark_broken()
        with trio.CancelScope(shield=True):
            await run_with_grace(
                _ABORT_NOTICE_SECONDS,
                *(
                    functools.partial(link.send_abort, kind, subject, seq, reason, reporter)
                    for link in self._links.values()
                    if link.send_clean
                ),
            )

    async def _close_connections(self) -> None:
        if self._world.shm is not None:
            self._world.shm.close()
            self._world.shm_plans.clear()
        for link in self._links.values():
            await trio.aclose_forcefully(link.connection)
