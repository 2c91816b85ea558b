"""Link, the framed connection to one peer: it sends and receives the frames of
:mod:`trioring._wire`, checks every header against the call it expects, and turns whatever
goes wrong into the precise :class:`~trioring.CollectiveError`."""

from __future__ import annotations

import contextlib
import errno
import os
import time
from typing import TYPE_CHECKING, NoReturn, final

import attrs
import trio

from ._concurrency import run_with_grace
from ._errors import (
    CollectiveError,
    TrioringError,
)
from ._link_errors import FIRST_HEADER, LinkErrors
from ._wire import (
    HEADER,
    MAGIC,
    MAX_REASON_BYTES,
    VERSION,
    AbortKind,
    FrameType,
    OpSpec,
    abort_error,
    pack_abort_frame,
    pack_data_header,
)
from .transports._socket import SocketConnection, advance

if TYPE_CHECKING:
    from .transports import Connection

# Payloads up to this size are received together with their header.
SMALL_FRAME = 64 * 1024
# How long a rank whose send failed looks for the abort frame that may explain it.
_PENDING_ABORT_SECONDS = 0.05
# How many small DATA frames it reads past, at most, looking for it.
_PENDING_FRAMES_SKIPPED = 4
# A poll (a receive's, or a wait on the shared segment) lets other tasks run at least this often.
SPIN_SLICE_SECONDS = 0.0002
# A receive that waits longer than this starts watching the other idle links for aborts.
_WATCH_AFTER_SECONDS = 0.02
# How many small data frames a watch reads ahead on one link, at most, before it gives up.
_WATCH_FRAMES = 8


@final
@attrs.define(eq=False)
class WaitCount:
    """How many times some links waited in the event loop: a collective that never did
    must still pass a schedule point before it returns. Also when the running collective
    first waited, which is what a cancelled one reports as its age (see
    Communicator._run)."""

    count: int = 0
    #: The sequence number of the last collective that waited, and ``trio.current_time()``
    #: at its first wait. Set by waits that reach a checkpoint only, so that a call whose
    #: data is there (at once or after a few looks) pays nothing; a call that does wait
    #: starts waiting soon after it begins, since until then it only handles data that is
    #: there.
    seq: int = -1
    since: float = 0.0

    def begin(self, seq: int) -> None:
        """Note that collective ``seq`` waits (the first time it does, when)."""
        if self.seq != seq:
            self.seq = seq
            self.since = trio.current_time()

    def elapsed(self, seq: int) -> float | None:
        """How long collective ``seq`` has run since its first wait; None if it never
        waited."""
        return trio.current_time() - self.since if self.seq == seq else None


@final
class Link(LinkErrors):
    """The framed connection from this rank to one peer.

    At most one task sends and one task receives on a link at a time (the algorithms make
    sure of it). ``send_clean`` is false while a frame is partly sent, or forever after a send
    was interrupted: no abort frame may follow then, because the peer would read it as
    payload.
    """

    def __init__(self, rank: int, peer: int, connection: Connection, *, job_id: str = "") -> None:
        self.rank = rank
        self.job_id = job_id or None
        self.peer = peer
        self.connection = connection
        self.send_clean = True
        self.receiving = False
        #: The collective whose receive from, or send to, the peer waits in a checkpoint
        #: (parked, between looks of a poll, or blocked in the transport); None otherwise.
        #: A cancellation leaves it set: that is how the communicator names the ranks it
        #: was waiting for.
        self.receive_waiting: OpSpec | None = None
        self.send_waiting: OpSpec | None = None
        #: Bounded poll before a receive parks (see _recv_some); set from the config.
        self.spin_seconds = 0.0
        #: Counts the times this link waited in the event loop (each wait is a checkpoint);
        #: the communicator gives all its links one counter.
        self.waits = WaitCount()
        #: The world's links, watched for abort frames during a long wait on this one (see
        #: _park); set by the communicator.
        self.watch: list[Link] = []
        self._watching = False
        self._send_header = bytearray(HEADER.size)
        self._send_header_view = memoryview(self._send_header)
        self._fast = connection if isinstance(connection, SocketConnection) else None
        self._recv_header = bytearray(HEADER.size)
        self._expected_header = bytearray(HEADER.size)
        self._recv_header_view = memoryview(self._recv_header)
        # Header plus a small payload, received together (see _read_header).
        self._inbox = bytearray(HEADER.size + SMALL_FRAME)
        self._inbox_view = memoryview(self._inbox)
        self._pending = memoryview(b"")
        # Whole frames (and the start of one) that a watch read ahead of the next receive.
        self._ahead = bytearray()

    # -- sending -----------------------------------------------------------------------

    def start_send(self, spec: OpSpec, offset: int, payload: memoryview) -> list[memoryview] | None:
        """Send as much of one DATA frame of ``spec`` (``payload`` at element ``offset``) as
        the connection takes without blocking. Returns None when all of it went out; else
        what is left, which the caller must pass to :meth:`finish_send` before anything else
        is sent on this link."""
        pack_data_header(self._send_header, spec, offset, payload.nbytes)
        views = [self._send_header_view, payload] if payload.nbytes else [self._send_header_view]
        if self._fast is None:
            return views
        try:
            sent = self._fast.send_nowait(views)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return views  # finish_send meets the same error and reports it properly
        if sent == HEADER.size + payload.nbytes:
            return None
        if sent:
            self.send_clean = False
        return advance(views, sent)

    async def finish_send(self, spec: OpSpec, views: list[memoryview]) -> None:
        """Send the rest of a frame that :meth:`start_send` began."""
        # A cancellation that is already pending must not leave the link marked dirty when
        # nothing was sent: then the abort frame can still go out on it.
        await trio.lowlevel.checkpoint_if_cancelled()
        self.send_clean = False
        self.waits.begin(spec.seq)
        self.send_waiting = spec
        fast = self._fast
        try:
            if fast is None:
                self.waits.count += 1
                await self.connection.send_all(*views)
            else:
                self.waits.count += 1
                # One loop in the transport, so that one deadline watches the peer's host for
                # the whole frame (see SocketConnection.send_rest).
                await fast.send_rest(views)
        except trio.BrokenResourceError as exc:
            raise await self.explained(spec, self._broken(spec, "sending", exc)) from exc
        except trio.ClosedResourceError as exc:
            raise self.closed_error(spec) from exc
        self.send_waiting = None
        self.send_clean = True

    async def send(self, spec: OpSpec, offset: int, payload: memoryview) -> None:
        """Send one DATA frame of ``spec`` carrying ``payload`` (bytes) at element ``offset``.
        Not a checkpoint when the connection takes the whole frame at once."""
        rest = self.start_send(spec, offset, payload)
        if rest is not None:
            await self.finish_send(spec, rest)

    async def send_abort(
        self, kind: AbortKind, subject: int, seq: int, reason: str, reporter: int
    ) -> None:
        """Tell the peer why this rank gives up: ``subject`` is the rank the news is about,
        ``reporter`` the rank that first noticed (they differ for a lost connection, and
        when news is relayed). Best effort: transport errors are ignored, since the
        connection is closed right after either way."""
        if not self.send_clean:
            return
        header, data = pack_abort_frame(kind, subject, seq, reason, reporter)
        self.send_clean = False
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            await self.connection.send_all(header, data)

    def send_closing(self, subject: int, seq: int, reason: str) -> None:
        """Tell the peer that this rank closes its communicator (abort kind CLOSED), over
        a socket, if it takes the frame at once: a clean close must not wait on a peer that
        closes too (a frame cut short by a full buffer reads as a close mid-frame)."""
        if not self.send_clean or self._fast is None:
            return
        self.send_clean = False
        header, data = pack_abort_frame(AbortKind.CLOSED, subject, seq, reason, subject)
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            self._fast.send_nowait([memoryview(header), memoryview(data)])

    async def explained(self, spec: OpSpec, error: CollectiveError) -> CollectiveError:
        """What to raise for ``error``, this link's failure noticed without reading from it
        (a send that broke, a cross-memory read of the peer's memory that failed): the
        abort frame the peer left on this link, if it gave up and said why (that frame is
        raised here), else ``error``, marked as a clean close when the look found the
        connection ended between two frames without a word: the peer itself died, so this
        rank may tell the others at once (see ``CommunicatorCore._relayed_cause``).

        The look is shielded (its grace bounds it): the failure of a sibling task (the
        receive beside this send, which saw another peer's connection end) cancels this
        one, and a look cut short in the middle of the abort frame consumed its header, so
        the communicator's own look for the cause found nothing left on this link and the
        rank named the echo instead (the chaos trials, seed 1177: 1 run in 10)."""
        with trio.CancelScope(shield=True):
            ended = await self._raise_pending_abort(spec)
        error._trioring_clean_close = ended is not None
        return error

    async def memory_error(
        self, spec: OpSpec, error: OSError, *, wrote: bool = False
    ) -> CollectiveError:
        """What to raise for a cross-memory read of the peer's memory (``wrote``: a write
        into it) that failed: :meth:`explained` of the link's ``memory_failed``."""
        return await self.explained(spec, self.memory_failed(spec, error, wrote=wrote))

    # -- receiving ---------------------------------------------------------------------

    async def pending_abort(self, spec: OpSpec) -> CollectiveError | None:
        """The abort frame the peer left on this link, if it is the next thing to read and
        arrives within a short grace; else, where the connection ended between two frames
        without a word (the peer died: a live one says why first), the PeerFailedError
        that says so (``_trioring_clean_close`` set, ``_trioring_abort`` None); None
        otherwise. Only for a link that is about to be closed: whatever is read here is
        consumed."""
        try:
            return await self._raise_pending_abort(spec)
        except CollectiveError as exc:
            if exc._trioring_abort is not None:
                return exc
        except TrioringError:
            pass  # the link is closed or broken: nothing to read on it
        return None

    async def _raise_pending_abort(self, spec: OpSpec) -> CollectiveError | None:
        """After a failed send: a peer that gives up sends an abort frame and then closes, so
        its reason may be waiting in our receive buffer. If nobody else is receiving on this
        link, look for it briefly, so that we report the cause (say, "rank 2 failed") rather
        than the broken pipe it left behind. Returns the error of the connection's end
        where the look found it closed between two frames and nothing to explain it."""
        if self.receiving or self._watching:
            return None
        found: list[TrioringError] = []
        ended: CollectiveError | None = None

        async def look() -> None:
            nonlocal ended
            # Frames the peer sent before it gave up (say, the announcement of a step we
            # never reached) may come first: skip a few small ones to find its reason.
            for _ in range(_PENDING_FRAMES_SKIPPED):
                try:
                    await self._recv_exactly(spec, self._recv_header_view, FIRST_HEADER)
                except CollectiveError as exc:
                    if exc._trioring_clean_close:
                        ended = exc
                    return
                except TrioringError:
                    return
                (magic, version, ftype, kind, _, _, root, seq, count, _, nbytes) = HEADER.unpack(
                    self._recv_header
                )
                if magic != MAGIC or version != VERSION:
                    return
                if ftype == FrameType.ABORT:
                    if kind == AbortKind.CLOSED and seq > spec.seq:
                        return  # it finished this call, then closed: not what broke it
                    try:
                        await self._raise_abort(spec, kind, root, seq, nbytes, count)
                    except TrioringError as exc:
                        found.append(exc)  # raised below, by itself rather than in a group
                    return
                if ftype != FrameType.DATA or nbytes > SMALL_FRAME:
                    return
                try:
                    await self._recv_exactly(spec, memoryview(bytearray(nbytes)), "a payload")
                except TrioringError:
                    return

        # Marked as read from, so that no other task reads or watches this link meanwhile.
        self._watching = True
        try:
            await run_with_grace(_PENDING_ABORT_SECONDS, look)
        finally:
            self._watching = False
        if found:
            raise found[0]
        return ended

    async def _recv_some(self, spec: OpSpec, view: memoryview, what: str) -> int:
        """Receive at least one byte into ``view``, or 0 at end of stream. With a socket
        connection, take what is already there without a trip through the scheduler, and
        when nothing is, poll for up to ``spin_seconds`` (yielding the CPU between tries)
        before parking: a peer on another core often answers within microseconds, far
        sooner than a wake-up through the event loop would deliver it. Other tasks of this
        program still run during the poll: from its second try on as soon as Trio has them
        queued, and in any case every ``SPIN_SLICE_SECONDS``."""
        if self._ahead:
            # Read ahead by a watch (see _watch_for_abort); a plain copy, not a checkpoint.
            taken = min(len(self._ahead), view.nbytes)
            view[:taken] = self._ahead[:taken]
            del self._ahead[:taken]
            return taken
        fast = self._fast
        try:
            if fast is None:
                self.waits.count += 1
                self.waits.begin(spec.seq)
                self.receive_waiting = spec
                received = await self.connection.recv_into(view)
                self.receive_waiting = None
                return received
            got = fast.recv_nowait(view)
            # What this receive waits for is noted only right before a checkpoint, the one
            # place a cancellation can reach it, and cleared right after: a receive whose
            # bytes come during the poll's first looks (most of them) pays nothing for it.
            if got is None and self.spin_seconds:
                start = time.perf_counter()
                deadline = start + self.spin_seconds
                slice_end = start + SPIN_SLICE_SECONDS
                # The first try always yields the CPU: most waits end after one, and asking
                # Trio for its statistics costs more than the yield (about 10 % of a 4-byte
                # allreduce at world 4 on 2 cores).
                os.sched_yield()
                got = fast.recv_nowait(view)
                statistics = trio.lowlevel.current_statistics
                while got is None and (now := time.perf_counter()) < deadline:
                    # Trio's queue does not hold the tasks of the batch we run in, so a
                    # slice ends the poll's hold on the thread even when it looks empty.
                    if now >= slice_end or statistics().tasks_runnable:
                        # Other tasks of this program have work: let them run instead of
                        # holding the thread (a checkpoint; no bytes are half-read here).
                        self.waits.count += 1
                        self.waits.begin(spec.seq)
                        self.receive_waiting = spec
                        await trio.lowlevel.checkpoint()
                        self.receive_waiting = None
                        slice_end = time.perf_counter() + SPIN_SLICE_SECONDS
                    else:
                        os.sched_yield()
                    got = fast.recv_nowait(view)
            while got is None:
                # Straight to the event loop: one pass through the scheduler per wake-up,
                # where the socket's own recv_into would add a second one.
                self.waits.count += 1
                self.waits.begin(spec.seq)
                self.receive_waiting = spec
                await self._park(spec, fast)
                self.receive_waiting = None
                got = fast.recv_nowait(view)
            return got
        except trio.BrokenResourceError as exc:
            error = self._broken(spec, f"receiving {what}", exc)
            # A reset is how a close reads when the peer left bytes of ours unread: before the
            # first byte of a frame, as much a close between frames as an end of file.
            cause = exc.__cause__
            reset = isinstance(cause, OSError) and cause.errno == errno.ECONNRESET
            error._trioring_clean_close = reset and what == FIRST_HEADER
            error._trioring_cut_short = reset and what != FIRST_HEADER
            raise error from exc
        except trio.ClosedResourceError as exc:
            raise self.closed_error(spec) from exc

    async def _park(self, spec: OpSpec, fast: SocketConnection) -> None:
        """Wait until this link is readable. A wait that lasts (the peer has not reached
        this step yet) also watches the other links that nobody is reading from, so that an
        abort frame from any peer ends it at once, not when the late peer arrives."""
        if not self.watch or self._watching:
            await fast.wait_readable()
            return
        with trio.move_on_after(_WATCH_AFTER_SECONDS):
            await fast.wait_readable()
            return
        # From here on the wait has lasted: it also watches the peer's host (a deadline per
        # second or so, too dear for every short wait above).
        idle = [link for link in self.watch if link is not self and link.watchable]
        if not idle:
            await fast.wait_readable(check_peer=True)
            return
        # Claimed now, not when the watcher task first runs: another task whose wait times
        # out in the same scheduler batch must not pick the same links.
        for link in idle:
            link._watching = True
        outcome: list[BaseException] = []
        async with trio.open_nursery() as nursery:

            async def wait_own() -> None:
                try:
                    await fast.wait_readable(check_peer=True)
                except (trio.ClosedResourceError, trio.BrokenResourceError) as exc:
                    outcome.append(exc)
                nursery.cancel_scope.cancel()

            async def watch(link: Link) -> None:
                try:
                    error = await link._watch_for_abort(spec)
                finally:
                    link._watching = False
                if error is not None:
                    outcome.append(error)
                    nursery.cancel_scope.cancel()

            nursery.start_soon(wait_own)
            for link in idle:
                nursery.start_soon(watch, link)
        if outcome:
            raise outcome[0]

    @property
    def has_buffered_bytes(self) -> bool:
        """Whether bytes received from the peer wait in this link's buffers (read ahead by
        a watch, or past a header) instead of in the socket."""
        return bool(self._ahead) or self._pending.nbytes > 0

    @property
    def watchable(self) -> bool:
        return self._fast is not None and not self.receiving and not self._watching

    async def watch_idle(self, spec: OpSpec) -> CollectiveError | None:
        """While nobody receives on this link (its collective waits on something else, say
        the connections of a new sub-communicator), watch it for an abort frame: the error
        it means, or None (see :meth:`_watch_for_abort`; at once if it is not watchable)."""
        if not self.watchable:
            return None
        self._watching = True
        try:
            return await self._watch_for_abort(spec)
        finally:
            self._watching = False

    async def _watch_for_abort(self, spec: OpSpec) -> CollectiveError | None:
        """Read ahead on this idle link, frame by frame, until an abort frame arrives: the
        error it means. Small data frames on the way (a peer may well have sent its part of
        this step before it gave up) are kept, whole, in ``_ahead``, where the next receive
        takes them from. None when a large data frame comes, after ``_WATCH_FRAMES`` small
        ones, or when the connection ends or breaks: the next receive on it reports that.
        The caller has marked the link as watched."""
        fast = self._fast
        assert fast is not None
        if self._pending.nbytes:
            return None  # a receive was interrupted mid-frame: its bytes are not ours to parse
        try:
            start = 0  # where the frame being looked at begins in _ahead
            for _ in range(_WATCH_FRAMES):
                await self._read_ahead(fast, start + HEADER.size)
                (magic, version, ftype, kind, _, _, root, seq, count, _, nbytes) = (
                    HEADER.unpack_from(self._ahead, start)
                )
                if magic != MAGIC or version != VERSION:
                    return None
                if ftype == FrameType.ABORT:
                    if seq > spec.seq:
                        # It finished this call, and closed or gave up in a later one: this
                        # call may still complete, as the failure model promises, on the
                        # frames of the peers it waits for (whose own connections say
                        # whether they fail). Left for a receive of the later call, which
                        # raises it. A peer that died in this call after another reported
                        # it in the next (chaos seed 10 over TCP, its frames to this rank
                        # lost with its connection) is then found on its own connection.
                        return None
                    # The link breaks now: the data frames before the abort are not needed.
                    del self._ahead[: start + HEADER.size]
                    await self._raise_abort(spec, kind, root, seq, nbytes, count)
                if ftype != FrameType.DATA or nbytes > SMALL_FRAME:
                    return None
                start += HEADER.size + nbytes
                await self._read_ahead(fast, start)
        except (trio.BrokenResourceError, trio.ClosedResourceError, EOFError):
            return None
        except CollectiveError as exc:
            return exc
        return None

    async def _read_ahead(self, fast: SocketConnection, total: int) -> None:
        """Receive into ``_ahead`` until it holds ``total`` bytes. Every byte received is
        in ``_ahead`` at once, so a cancellation loses nothing. EOFError at end of stream."""
        while len(self._ahead) < total:
            await fast.wait_readable()
            # Allocated per read: watches are rare (waits past _WATCH_AFTER_SECONDS), and a
            # buffer kept per link would cost 64 KiB for every peer of every rank.
            chunk = bytearray(total - len(self._ahead))
            got = fast.recv_nowait(memoryview(chunk))
            if got is None:
                continue
            if not got:
                raise EOFError
            self._ahead += memoryview(chunk)[:got]

    async def _recv_exactly(self, spec: OpSpec, view: memoryview, what: str) -> None:
        total = view.nbytes
        if self._pending.nbytes and total:
            taken = min(self._pending.nbytes, total)
            view[:taken] = self._pending[:taken]
            self._pending = self._pending[taken:]
            view = view[taken:]
        while view.nbytes:
            got = await self._recv_some(spec, view, what)
            if not got:
                raise self._closed_by_peer(spec, total - view.nbytes, total, what)
            view = view[got:]

    async def recv(self, spec: OpSpec, offset: int, into: memoryview) -> None:
        """Receive the DATA frame of ``spec`` at element ``offset`` whose payload fills
        ``into`` exactly. Raises the precise :class:`CollectiveError` on anything else."""
        self.receiving = True
        try:
            if into.nbytes <= SMALL_FRAME and not self._pending.nbytes:
                # The common case in one read and one comparison: the whole frame is there
                # and its header is exactly the one we expect. Anything else (a partial
                # read, another frame) goes on through the general path below, which
                # starts from what was read here.
                want = HEADER.size + into.nbytes
                buffer = self._inbox_view[:want]
                got = await self._recv_some(spec, buffer, FIRST_HEADER)
                pack_data_header(self._expected_header, spec, offset, into.nbytes)
                if got == want and self._inbox[: HEADER.size] == self._expected_header:
                    if into.nbytes:
                        into[:] = buffer[HEADER.size :]
                    return
                self._pending = buffer[:got]
            await self._recv_frame(spec, offset, into)
        finally:
            self.receiving = False

    async def _read_header(self, spec: OpSpec, expected_payload: int) -> None:
        """Receive the next frame header into ``_inbox[:HEADER.size]``. For small frames,
        read the payload we expect along with it (one system call and one checkpoint instead
        of two) and keep it in ``_pending``, where :meth:`_recv_exactly` takes it from. We
        never read past the end of the frame we expect, so if the frame is what we expect
        nothing of the next one is consumed; if it is not, the link is about to break anyway."""
        want = HEADER.size + (expected_payload if expected_payload <= SMALL_FRAME else 0)
        buffer = self._inbox_view[:want]
        have = 0
        if self._pending.nbytes:
            have = min(self._pending.nbytes, want)
            buffer[:have] = self._pending[:have]
            self._pending = self._pending[have:]
        while have < HEADER.size:
            got = await self._recv_some(
                spec, buffer[have:], FIRST_HEADER if not have else "the rest of a frame header"
            )
            if not got:
                raise self._closed_by_peer(spec, have, HEADER.size, FIRST_HEADER)
            have += got
        self._pending = buffer[HEADER.size : have]

    async def _recv_frame(self, spec: OpSpec, offset: int, into: memoryview) -> None:
        await self._read_header(spec, into.nbytes)
        (magic, version, ftype, kind, op, dtype, root, seq, count, r_offset, nbytes) = (
            HEADER.unpack_from(self._inbox)
        )
        if magic != MAGIC or version != VERSION:
            raise self.protocol_error(
                spec, f"bad frame header (magic {magic!r}, version {version}); not a trioring peer?"
            )
        if ftype == FrameType.ABORT:
            await self._raise_abort(spec, kind, root, seq, nbytes, count)
        if ftype != FrameType.DATA:
            raise self.protocol_error(spec, f"unknown frame type {ftype}")
        mismatch = self._mismatch(spec, kind, seq, dtype, count, op, root)
        if mismatch is not None:
            raise mismatch
        if r_offset != offset or nbytes != into.nbytes:
            raise self.protocol_error(
                spec,
                f"expected the chunk at element {offset} of {into.nbytes} bytes, got element "
                f"{r_offset} of {nbytes} bytes",
            )
        if nbytes:
            await self._recv_exactly(spec, into, "a payload")

    async def _raise_abort(
        self, spec: OpSpec, kind: int, subject: int, seq: int, nbytes: int, reporter: int
    ) -> NoReturn:
        if nbytes > MAX_REASON_BYTES:
            raise self.protocol_error(spec, f"abort reason of {nbytes} bytes is too long")
        data = bytearray(nbytes)
        if nbytes:
            await self._recv_exactly(spec, memoryview(data), "an abort reason")
        reason = data.decode("utf-8", "replace")
        raise abort_error(
            self.rank, self.peer, spec, kind, subject, seq, reason, reporter, self.job_id
        )
