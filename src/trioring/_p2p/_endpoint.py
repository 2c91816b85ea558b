"""The endpoint: one rank's point-to-point plane, shared by every communicator of its world.

Protocol (frames in :mod:`._frames`)
-------------------------------------
A message of at most ``eager_bytes`` goes in one EAGER frame when the sender holds enough
credit for the peer; the receiver queues it if no receive waits for it. Credit is
``window_bytes`` per peer and direction and counts each message's payload plus
``MESSAGE_OVERHEAD``; the receiver gives it back in CREDIT frames as receives consume messages
(once half the window is owed, or with any frame it writes anyway). Any other message goes by
rendezvous: RTS (header and shape) -> once a receive matches it, the receiving task registers
the target buffer and writes CTS -> the sending task writes DATA frames of ``chunk_bytes``
straight from the user's array -> the receiver's reader reads each payload straight into the
target -> the receiving task writes DONE; the send returns on DONE. Where the world agreed on
cross-memory attach (``peer_pids``), the RTS also gives the addresses of the array and of a
guard word in the sender's memory; the receiving task, right after its CTS, copies the
message out of the sender's memory (``process_vm_readv``) into the target, and the sending
task answers the CTS with one PULL frame instead of DATA frames: the copy may be kept. One
copy instead of two, no frame per chunk, and the copy overlaps the PULL's way. The copy
counts only once the PULL came (before it, the send may still be cancelled and its array
reused) and the guard still holds the msg id: a send that gives up (cancelled before its
PULL, its communicator or endpoint closed under it) zeroes its guard before it returns, so
a copy that may be torn is forgotten, as if withdrawn (x86-64 only, whose stores other
processes see in program order).
Between such ranks, where ranks outnumber the CPUs they share (``crowded``), the eager limit
is at most ``CMA_EAGER_BYTES``: above it, that one copy costs less than two through the
socket there.

So what one peer can make us buffer is bounded by ``window_bytes`` plus a header per pending
RTS (at most ``MAX_PENDING_RTS``; beyond that the peer is broken: ProtocolError).

Readers (one task per connection) never write: a reader that waited for a write could
deadlock two ranks that both write. Frames are written by the calling tasks, one frame at a
time under the connection's FIFO lock, each write shielded from cancellation (it ends: the
peer's reader always drains, and a dead peer makes it fail). DATA frames of concurrent sends
to one peer interleave chunk by chunk, told apart by their message id. A receive or a
rendezvous send that waits polls first (``spin_seconds``, at least ``POLL_SECONDS`` where
polling is on): it looks at its peers' sockets itself and takes the whole frames waiting
there, as the reader would, while the reader is between frames (so the reader still reads
from the start of a frame), sparing the passes through the scheduler that wake the reader
and then the waiting task.

Ordering: messages from one (source, dest, tag) of one communicator are non-overtaking; a
receive takes the earliest unmatched message from its source (any member for
``source=None``) with its tag, and an arriving message goes to the earliest posted receive
that matches it. Sends of one task are ordered; concurrent sends have no order between them.

Cancellation ("a cancelled call had no effect", as far as it can be kept):

* A receive cancelled before it matched is withdrawn; nothing is consumed.
* A receive cancelled while its rendezvous DATA arrives (or while it copies from the
  sender's memory, between two steps) writes REJECT; the message goes back to its place in
  the queue, whole, for the next matching receive (the sender writes RESTART and waits for
  a new CTS). ``out`` may have been partly overwritten.
* A send cancelled before all its DATA went writes WITHDRAW: the receiver forgets the
  message, and a receive that had matched it waits again, first in line. ``out`` of that
  receive may have been partly overwritten.
* Once a send's last DATA frame (or its PULL) is written, it ignores cancellation until
  DONE (it returns) or REJECT (it writes RESTART and waits for a CTS again, cancellably); so
  a cancelled send raises Cancelled having delivered nothing, or returns, and a receiver
  never copies from an array whose send has returned.
* An eager send is delivered once its frame is written.

Every public async method is a checkpoint on every path.

Failures: a connection that ends or breaks, or carries garbage, fails its peer for good: every
pending call involving it raises (PeerFailedError or ProtocolError naming this rank, the
peer, the call and the message's sequence number), later ones raise at once (messages that
had already arrived whole stay receivable), and ``on_peer_lost`` is called once.
"""

from __future__ import annotations

import contextlib
import functools
from typing import TYPE_CHECKING, final

import trio

from .._concurrency import run_with_grace
from .._errors import InvalidArgumentError, TrioringError
from .._onehost import _cma
from ._engine import (
    CHUNK_BYTES,
    EAGER_BYTES,
    WINDOW_BYTES,
    LinkDown,
    checked_array,
)
from ._frames import FrameType, Leaving, MessageKind, pack_control
from ._matching import CommState, PostedRecv, Scope
from ._sending import Sending

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping

    import numpy as np

    from ..transports import Connection
    from ._peer import Peer

__all__ = ["LEAVE_NOTICE_SECONDS", "Endpoint"]

#: How long :meth:`Endpoint.leave` waits for a connection that another task is writing on,
#: as a breaking communicator gives its abort notices (``_core._ABORT_NOTICE_SECONDS``).
LEAVE_NOTICE_SECONDS = 0.25


@final
class Endpoint(Sending):
    """One rank's point-to-point plane (see the module docstring for the protocol).

    ``connections`` maps each other world rank to its connection; the endpoint owns them and
    closes them in :meth:`aclose`. Start it with ``await nursery.start(endpoint.run)``.
    ``eager_bytes``, ``window_bytes`` and ``chunk_bytes`` are the protocol's sizes (see the
    constants); tests make them small to exercise every path. ``peer_pids`` (world rank ->
    pid, from the kernel) is given where every pair of ranks agreed on cross-memory attach:
    rendezvous messages then go by cross-memory attach (the receiver copies them out of the
    sender's memory), and an RTS with addresses from a peer without a pid is a protocol
    error; ``crowded``: this rank shares its CPUs with more ranks than they number (see
    ``CMA_EAGER_BYTES``).

    Ranks in calls and results are communicator ranks (``scope.members`` maps them to world
    ranks).
    """

    def __init__(
        self,
        *,
        rank: int,
        connections: dict[int, Connection],
        job_id: str | None = None,
        eager_bytes: int = EAGER_BYTES,
        window_bytes: int = WINDOW_BYTES,
        chunk_bytes: int = CHUNK_BYTES,
        spin_seconds: float = 0.0,
        peer_pids: Mapping[int, int] | None = None,
        crowded: bool = False,
    ) -> None:
        super().__init__(
            rank=rank,
            connections=connections,
            job_id=job_id,
            eager_bytes=eager_bytes,
            window_bytes=window_bytes,
            chunk_bytes=chunk_bytes,
            spin_seconds=spin_seconds,
            crowded=crowded,
        )
        if _cma.STORES_IN_ORDER:  # else a guard word cannot be trusted
            for world, pid in (peer_pids or {}).items():
                self._peers[world].pid = pid

    # -- life cycle ------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run the readers (one task per connection) until :meth:`aclose`; start it with
        ``nursery.start(endpoint.run)``. Never raises because of a peer: peer failures are
        recorded and raised to the calls they affect. Returns after :meth:`aclose`; if
        cancelled, closes the endpoint first (pending calls raise CommunicatorClosedError)."""
        if self._running or self._closed:
            raise RuntimeError("Endpoint.run() can be called only once")
        self._running = True
        try:
            async with trio.open_nursery() as nursery:
                for peer in self._peers.values():
                    nursery.start_soon(self._read_peer, peer)
                task_status.started()
                await self._closed_event.wait()
        finally:
            with trio.CancelScope(shield=True):
                await self.aclose()

    async def aclose(self) -> None:
        """Close every connection; pending and later calls raise CommunicatorClosedError.
        Idempotent."""
        if not self._closed:
            self._closed = True
            for comm in list(self._comms.values()):
                self._fail_comm(comm, functools.partial(self._closed_error, comm.scope))
            for peer in self._peers.values():
                peer.reader_scope.cancel()
            self._closed_event.set()
            for peer in self._peers.values():
                await trio.aclose_forcefully(peer.connection)
        await trio.lowlevel.checkpoint()

    def register(self, scope: Scope) -> None:
        """Start matching messages for ``scope.comm_id``; messages that arrived for it before
        are adopted (a peer may create a sub-communicator and send on it first)."""
        members = scope.members
        bad = None
        if not 0 <= scope.comm_id < 2**64:
            bad = f"comm id {scope.comm_id} is not a u64"
        elif not 0 <= scope.rank < len(members) or members[scope.rank] != self.rank:
            bad = f"rank {scope.rank} of {members} is not world rank {self.rank}"
        elif len(set(members)) != len(members) or any(
            m != self.rank and m not in self._peers for m in members
        ):
            bad = f"members {members} are not distinct world ranks"
        elif scope.comm_id in self._unregistered:
            bad = f"comm id {scope.comm_id:#x} was unregistered"
        elif (comm := self._comms.get(scope.comm_id)) is not None and comm.scope is not None:
            bad = f"comm id {scope.comm_id:#x} is already registered"
        if bad is not None:
            raise InvalidArgumentError(f"rank {self.rank}: register: {bad}", rank=self.rank)
        comm = self._comms.get(scope.comm_id)
        if comm is None:
            self._comms[scope.comm_id] = CommState(scope)
            return
        comm.adopt(scope)
        for message in comm.clear_queued():
            if message.peer in comm.rank_of:
                comm.insert(message)
                continue
            self._drop(message)
            peer = self._peers[message.peer]
            self._protocol_violation(
                peer, f"sent a message on comm id {scope.comm_id:#x}, of which it is no member"
            )

    async def leave(
        self, comm_id: int, error: Callable[[str], TrioringError], why: Leaving | None = None
    ) -> None:
        """:meth:`unregister`, then tell the other members (LEFT, saying ``why``: None for a
        plain close), so that their calls that wait for this rank on the communicator
        raise, saying so, instead of waiting for ever. Best effort and shielded: a peer
        that is gone is skipped, and one whose connection is busy with another task's frame
        for longer than ``LEAVE_NOTICE_SECONDS`` (say, a stopped peer that reads nothing)
        gets its LEFT with our next frame to it, or the end of the connection.
        Idempotent."""
        comm = self._comms.get(comm_id) or self._left_behind.pop(comm_id, None)
        self.unregister(comm_id, error)
        if comm is None or comm.scope is None or self._closed:
            return
        with trio.CancelScope(shield=True):
            for peer in self.queue_left(comm_id, comm.scope.members, why):
                await run_with_grace(
                    LEAVE_NOTICE_SECONDS, functools.partial(self._write_left, peer)
                )

    async def _write_left(self, peer: Peer) -> None:
        async with peer.lock:  # the wait for it is what the grace bounds
            with contextlib.suppress(LinkDown):
                await self._write_locked(peer)

    def leave_later(
        self, comm_id: int, error: Callable[[str], TrioringError], why: Leaving
    ) -> None:
        """:meth:`unregister`, and queue the LEFT frames (saying ``why``) without writing
        them: they go out with the next frame to each peer, or at :meth:`leave` when the
        communicator closes. For a communicator that breaks: its abort frames and their
        relays are racing through the world then, and writing LEFT at once made the ranks
        of a mismatch name an echo (a lost connection) instead of the mismatch in 5 of 324
        in-process worlds of 7 to 9 ranks, against none of 648 with the frames queued."""
        comm = self._comms.get(comm_id)
        self.unregister(comm_id, error)
        if comm is not None and comm.scope is not None and not self._closed:
            self.queue_left(comm_id, comm.scope.members, why)
            self._left_behind[comm_id] = comm

    def unregister(self, comm_id: int, error: Callable[[str], TrioringError]) -> None:
        """The communicator is closed or broken: its pending calls raise ``error(what)``
        (``what`` describes the call, e.g. ``"recv(source=0, tag=7)"``), later messages for
        it are dropped (their credit still given back)."""
        self._unregistered[comm_id] = error
        comm = self._comms.pop(comm_id, None)
        if comm is not None:
            self._fail_comm(comm, error)

    def peer_error(self, world_rank: int) -> TrioringError | None:
        """The failure recorded for ``world_rank``'s connection, if any."""
        peer = self._peers.get(world_rank)
        return None if peer is None else peer.error

    # -- receiving -------------------------------------------------------------------------

    async def recv(
        self,
        scope: Scope,
        source: int | None,
        tag: int,
        out: np.ndarray | None = None,
        *,
        kind: MessageKind = MessageKind.ARRAY,
    ) -> tuple[int, np.ndarray]:
        """Receive the earliest unmatched message from communicator rank ``source`` (None:
        from any member) with ``tag``; return (its source rank, the array).

        Without ``out``, the array is new, of the sender's dtype and shape. With ``out`` (a
        writable C-contiguous array of the message's dtype and at least its size), the data
        lands in ``out``; the result is ``out`` when the shapes are equal, else the view
        ``out.reshape(-1)[:n].reshape(shape)``. A message that does not fit (dtype, size, or
        ``kind``) raises InvalidArgumentError before any byte lands and stays queued.
        Cancelled, it consumed nothing (``out`` may be partly overwritten)."""
        await trio.lowlevel.checkpoint_if_cancelled()
        suffix = "_object" if kind == MessageKind.OBJECT else ""
        if source is None:
            what = f"recv_any{suffix}(tag={tag})"
        else:
            what = f"recv{suffix}(source={source}, tag={tag})"
        try:
            comm = self._comm(scope, what)
            self._check_tag(scope, what, tag)
            world = None if source is None else self._check_rank(scope, what, source)
            if out is not None:
                checked_array(out, what, scope.rank)
                if not out.flags.c_contiguous or not out.flags.writeable:
                    raise InvalidArgumentError(
                        f"{self._where(scope, what, None)}: out must be writable and C-contiguous",
                        rank=scope.rank,
                    )
            recv = PostedRecv(
                scope=scope, source=world, tag=tag, kind=MessageKind(kind), out=out,
                order=comm.next_order(), what=what,
            )  # fmt: skip
            message = comm.find(world, tag)
            if message is not None:
                error = self._mismatch(message, recv)
                if error is not None:
                    raise error
            else:
                self._check_sources(comm, recv)
        except TrioringError:
            await trio.lowlevel.cancel_shielded_checkpoint()
            raise
        comm.recvs.add(recv)
        try:
            if message is None:
                comm.post(recv)
            else:
                comm.remove(message)
                self._bind(comm, message, recv)
            await self._wait_recv(comm, recv)
        finally:
            comm.recvs.discard(recv)
        assert recv.message is not None
        assert recv.result is not None
        return comm.rank_of[recv.message.peer], recv.result

    def _check_sources(self, comm: CommState, recv: PostedRecv) -> None:
        """Nothing is queued for ``recv``: if its source closed the communicator or failed,
        nothing will come. A receive from any member raises if one failed (its message may
        have been lost) or once every other member is gone; a member that closed the
        communicator (LEFT) before it failed only counts as gone."""
        scope = recv.scope
        left = self._left.get(scope.comm_id, {})
        if recv.source is not None:
            if recv.source in left:
                raise self._left_error(scope, recv.what, recv.source)
            worlds: tuple[int, ...] = (recv.source,)
        else:
            worlds = tuple(w for w in scope.members if w not in left)
        for world in worlds:
            peer = self._peers.get(world)
            if peer is not None and peer.error is not None:
                raise self._for_call(peer.error, scope, recv.what, None, world)
        if recv.source is None and left and self._all_gone(scope):
            raise self._all_left_error(scope, recv.what)

    async def _wait_recv(self, comm: CommState, recv: PostedRecv) -> None:
        """Drive ``recv`` to its end: write its CTS when it is bound to a rendezvous message,
        wait for the data, write DONE (or give credit back)."""
        passed = False  # through the scheduler: if not, a schedule point at the end
        try:
            while not recv.done:
                if recv.error is not None:
                    raise recv.error
                message = recv.message
                if recv.need_cts and message is not None:
                    recv.need_cts = False
                    recv.result, target = self._target(message, recv)
                    message.target = target
                    message.cts_sent, message.received = True, 0
                    message.committed = message.unreadable = False
                    recv.polled = False  # the PULL comes within a round trip: poll for it
                    with contextlib.suppress(LinkDown):  # the failure set recv.error
                        passed |= await self._control(
                            self._peers[message.peer], pack_control(FrameType.CTS, message.msg_id)
                        )
                    if message.address and recv.message is message:
                        await self._copy_out(comm, recv, message)
                elif (
                    message is not None
                    and message.committed
                    and (message.received == message.nbytes or message.unreadable)
                ):
                    self._kept(recv, message)
                else:
                    passed |= await self._park_recv(comm, recv)
        except BaseException:
            # A REJECT queued by the cancellation (or the failure) goes out now.
            with trio.CancelScope(shield=True):
                for peer in self._peers.values():
                    if peer.outbox:
                        await self._flush(peer)
            raise
        message = recv.message
        assert message is not None
        source = self._peers.get(message.peer)
        if message.payload is None and message.local is None and source is not None:
            # All of it landed: the receive succeeded, whatever the sender hears.
            with contextlib.suppress(LinkDown):
                passed |= await self._control(source, pack_control(FrameType.DONE, message.msg_id))
        elif source is not None:
            passed |= await self._flush(source)
        if not passed:
            await trio.lowlevel.cancel_shielded_checkpoint()

    async def _park_recv(self, comm: CommState, recv: PostedRecv) -> bool:
        """Wait until something happens to ``recv``; return whether the wait passed through
        the scheduler. If cancelled: a posted receive is withdrawn; one bound to a message
        gives it back (REJECTing it if its CTS went)."""
        if not recv.polled:
            # Poll first (see Polling._poll); a cancellation is taken by the wait below,
            # whose abort knows how to give a message back.
            recv.polled = True
            passed = await self._poll(_sources(recv), functools.partial(_moved, recv))
            if _moved(recv):
                return passed
        recv.task = trio.lowlevel.current_task()

        def abort(_: object) -> trio.lowlevel.Abort:
            recv.task = None
            self._give_up(comm, recv)
            return trio.lowlevel.Abort.SUCCEEDED

        await trio.lowlevel.wait_task_rescheduled(abort)
        return True


def _sources(recv: PostedRecv) -> tuple[int, ...]:
    """The world ranks ``recv`` may hear from now."""
    message = recv.message
    if message is not None:
        return (message.peer,)
    return recv.scope.members if recv.source is None else (recv.source,)


def _moved(recv: PostedRecv) -> bool:
    """Whether ``recv`` has something for :meth:`Endpoint._wait_recv` to do."""
    message = recv.message
    return (
        recv.done
        or recv.error is not None
        or recv.need_cts
        or (message is not None and message.committed)
    )
