"""The engine under :class:`~trioring._p2p.Endpoint`: per-peer and per-communicator state,
frame writing and failure handling (matching is in _binding.py, the readers in _reading.py,
the polling of waits in _polling.py, the sends in _sending.py, one class on the other in
that order). See _endpoint.py for the protocol and the guarantees; these modules keep the
mechanics."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

import numpy as np
import trio

from .._errors import (
    CommunicatorClosedError,
    InvalidArgumentError,
    PeerFailedError,
    ProtocolError,
    TrioringError,
)
from .._util import expected_array
from .._wire import DTYPE_CODES
from ..transports._socket import PeekBuffer, advance
from ._frames import (
    MAX_NDIM,
    TAG_BOUND,
    FrameType,
    Leaving,
    pack_control,
    pack_credit,
)
from ._matching import CommState, Message, Scope, wake
from ._peer import READ_BYTES, Peer, lost

if TYPE_CHECKING:
    from collections.abc import Callable

    from ..transports import Connection

#: Largest payload sent eagerly: the chunk, which a Unix connection's send buffer takes at
#: once. A larger message pays a round trip (RTS, CTS) before its data, and a message costs
#: Python and the scheduler far more than its bytes do: at 64 KiB (Open MPI's TCP eager
#: limit), a message of 64 KiB + 8 bytes took 592 us one way and one of 1 MiB 770 us at
#: world 2 on 2 vCPUs, against 222 and 460 us eagerly, the receiver's extra copy included
#: (bench/p2p.py; Gloo's 1 MiB: 472 us, bench/p2p_compare.py).
EAGER_BYTES = 1024 * 1024
#: The same between ranks that copy rendezvous messages out of each other's memory (cross-
#: memory attach agreed, Peer.pid) where ranks outnumber the CPUs they share (crowded): there
#: one copy straight into the receive's array beats two through the socket. A receive that
#: polls reads an eager message straight into its array too once all of it waits on the
#: socket (Polling._take_large), which pays where each rank has a CPU: ping-pong at world 2
#: on 2 vCPUs, one way, us, eagerly against by cross-memory attach (bench/p2p.py, three
#: alternating launches): 512 KiB 144-148 against 186-195 (two launches), 768 KiB 194-204
#: against 230-242, 1 MiB 281-284 against 297-307. A ring at worlds 3 and 4 on 2 vCPUs, per
#: step, the same two ways (two launches each): 512 KiB
#: 790-972 against 989-1113, 1 MiB 1349-1537 against 1202-1334.
CMA_EAGER_BYTES = 512 * 1024
#: Eager credit per peer and direction: what one peer can make us buffer. 4 MiB holds 4
#: full eager messages (or 16384 tiny ones), enough that a sender of small messages rarely
#: waits for a receive to start, at 4 MiB of memory per peer at most.
WINDOW_BYTES = 4 * 1024 * 1024
#: DATA frame size: as the collectives use (the Unix transport's 1 MiB send buffer takes a
#: whole chunk at once), and small enough that concurrent sends to one peer interleave.
CHUNK_BYTES = 1024 * 1024
#: Credit charged per message on top of its payload, for the header, shape and the objects
#: that hold a queued message: 256 bytes, so that a window of empty messages is bounded too.
MESSAGE_OVERHEAD = 256
#: Credit owed to a peer goes back with the next frame we write to it once this fraction
#: of the window is owed, not with every frame: each CREDIT frame costs the peer a frame to
#: decode and handle in Python (a ping-pong of 8-byte messages, where every message came
#: with one, took 53-57 us one way at world 2 on 2 vCPUs against 48-52, bench/p2p.py). A
#: sender still holds at least the window less its messages not yet received and half the
#: window (the most a receiver owes after a receive, _flush), as before.
PIGGYBACK_FRACTION = 16
#: Unexpected RTS frames one peer may leave pending with us (about 1 KiB of memory each).
MAX_PENDING_RTS = 65536
#: How long the reader of a peer that a write found gone goes on reading what the peer
#: wrote before it closed (see Engine._link_down): on one host the rest of a closed
#: connection is there at once; across hosts a connection that a write found broken is
#: broken for reads too, or its end is already on its way. The bound is for a peer that is
#: only silent (a write that the transport's timeout ended), whose reader would wait on.
_DRAIN_SECONDS = 0.25


class LinkDown(Exception):
    """A write failed; ``base`` is the peer's recorded failure (or the endpoint's close)."""

    def __init__(self, base: TrioringError) -> None:
        super().__init__(str(base))
        self.base = base


def bytes_of(array: np.ndarray) -> memoryview:
    """The bytes of a C-contiguous array, flat, without a copy (a memoryview: a numpy
    ``view(np.uint8)`` cost twice as much, on every message)."""
    if not array.size:  # (a memoryview cannot cast a shape with a zero in it)
        return _EMPTY
    return array.data.cast("B")


_EMPTY = memoryview(bytearray())


def checked_array(array: object, what: str, rank: int) -> np.ndarray:
    if not isinstance(array, np.ndarray):
        refusal = expected_array(array, "a numpy array")
        raise InvalidArgumentError(f"rank {rank}: {what}: {refusal}", rank=rank)
    if array.dtype not in DTYPE_CODES:
        raise InvalidArgumentError(
            f"rank {rank}: {what}: unsupported dtype {array.dtype}", rank=rank
        )
    if array.ndim > MAX_NDIM:
        raise InvalidArgumentError(f"rank {rank}: {what}: {array.ndim} dimensions", rank=rank)
    return array


class Engine:
    """The state and mechanics of an endpoint (the public calls are in Endpoint)."""

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
        crowded: bool = False,
    ) -> None:
        if rank in connections:
            raise InvalidArgumentError(f"rank {rank}: a connection to itself", rank=rank)
        if eager_bytes < 0 or window_bytes <= 0 or chunk_bytes <= 0:
            raise InvalidArgumentError(
                f"rank {rank}: bad sizes (eager {eager_bytes}, window {window_bytes}, "
                f"chunk {chunk_bytes})",
                rank=rank,
            )
        self.rank = rank
        self.job_id = job_id
        self._eager_bytes = eager_bytes
        #: The eager limit towards a peer with a pid (see CMA_EAGER_BYTES).
        self._cma_eager_bytes = min(eager_bytes, CMA_EAGER_BYTES) if crowded else eager_bytes
        self._window = window_bytes
        #: Credit owed goes back with a frame we write anyway once this much is owed (see
        #: PIGGYBACK_FRACTION); a CREDIT frame of its own once half the window is.
        self._piggyback = max(1, window_bytes // PIGGYBACK_FRACTION)
        self._chunk = chunk_bytes
        #: How long a wait polls before it parks (TRIORING_SPIN_US; see Polling._poll).
        self._spin_seconds = spin_seconds
        self._peers = {w: Peer(w, c, window_bytes) for w, c in connections.items()}
        #: Where a polling receive looks at a socket (Polling._take_waiting).
        self._peek_buffer = PeekBuffer(READ_BYTES)
        #: Frames that waiting calls took off the sockets themselves (statistics).
        self.taken_by_waits = 0
        self._comms: dict[int, CommState] = {}
        self._unregistered: dict[int, Callable[[str], TrioringError]] = {}
        #: The world ranks that sent LEFT for a communicator id (they closed it or left it),
        #: with why (None for a plain close).
        self._left: dict[int, dict[int, Leaving | None]] = {}
        #: Communicators that broke here, whose LEFT frames are queued, not yet written.
        self._left_behind: dict[int, CommState] = {}
        self._arrivals = 0
        #: Eager bytes this rank sent to itself and nobody received yet (bounded by the window).
        self._self_buffered = 0
        self._closed = False
        self._running = False
        self._closed_event = trio.Event()
        #: Called once per world rank whose connection ended or broke the protocol.
        self.on_peer_lost: Callable[[int, TrioringError], None] | None = None

    # -- errors ----------------------------------------------------------------------------

    def _where(self, scope: Scope | None, what: str, seq: int | None) -> str:
        rank = self.rank if scope is None else scope.rank
        where = f"rank {rank}: {what}"
        if seq is not None:
            where += f" #{seq}"
        if scope is not None and scope.label:
            where += f" on {scope.label}"
        return where

    def _closed_error(self, scope: Scope | None, what: str) -> CommunicatorClosedError:
        return CommunicatorClosedError(
            f"{self._where(scope, what, None)}: the endpoint was closed",
            rank=self.rank if scope is None else scope.rank,
            job_id=self.job_id,
            collective=what.partition("(")[0],
        )

    def _for_call(
        self, base: TrioringError, scope: Scope, what: str, seq: int | None, world: int
    ) -> TrioringError:
        """The error that the call ``what`` raises because of ``base``, a failure recorded
        for world rank ``world`` (or the endpoint's close)."""
        if self._closed or isinstance(base, CommunicatorClosedError):
            return self._closed_error(scope, what)
        comm_rank = scope.members.index(world) if world in scope.members else None
        name = f"peer rank {comm_rank}" if comm_rank is not None else "a peer"
        if comm_rank != world:
            name += f" (world rank {world})"
        cls = ProtocolError if isinstance(base, ProtocolError) else PeerFailedError
        peer = self._peers.get(world)
        detail = peer.detail if peer is not None else str(base)
        error = cls(
            f"{self._where(scope, what, seq)}: {name}: {detail}",
            rank=scope.rank,
            peer=comm_rank,
            collective=what.partition("(")[0],
            seq=seq,
            job_id=self.job_id,
        )
        error.__cause__ = base
        if scope.label:
            error._trioring_world_ranks = scope.members  # for trioring run: see echoed_ranks
        return error

    def _record_failure(
        self, peer: Peer, cls: type[TrioringError], detail: str, *, drain: bool = False
    ) -> TrioringError:
        """Record that ``peer`` failed (once): later calls involving it raise at once. Its
        reader stops now and everything that waits on it fails; with ``drain`` (a write
        failed), once the reader has read what the peer wrote before its end (within
        ``_DRAIN_SECONDS``), so that a LEFT there fails the calls it concerns with what it
        says (see :meth:`_link_down`)."""
        if peer.error is not None:
            return peer.error
        base = cls(
            f"rank {self.rank}: peer rank {peer.world}: {detail}",
            rank=self.rank,
            peer=peer.world,
            job_id=self.job_id,
        )
        peer.error, peer.detail = base, detail
        # Its reader closes the connection, and a drained one then fails what still waits.
        if drain:
            peer.draining = True
            peer.reader_scope.deadline = min(
                peer.reader_scope.deadline, trio.current_time() + _DRAIN_SECONDS
            )
        else:
            peer.reader_scope.cancel()
            self._fail_waiting(peer, base)
        if self.on_peer_lost is not None:
            self.on_peer_lost(peer.world, base)
        return base

    def _fail_waiting(self, peer: Peer, base: TrioringError) -> None:
        """Fail every call that waits on ``peer``, which failed (``base``)."""
        for send in list(peer.outbound.values()):
            # One failed already (the peer's LEFT, read right before the end) says why.
            if send.error is None:
                send.error = self._for_call(base, send.scope, send.what, send.seq, peer.world)
                wake(send)
        # Its rendezvous messages can never complete; its eager ones stay receivable.
        for message in list(peer.inbound.values()):
            comm = self._comms.get(message.comm_id)
            if comm is not None and message.recv is None:
                comm.remove(message)
            self._forget(peer, message)
        for comm in list(self._comms.values()):
            if comm.scope is None or peer.world not in comm.rank_of:
                continue
            for recv in list(comm.recvs):
                bound = recv.message
                if bound is not None and bound.peer != peer.world:
                    continue
                if bound is None and recv.source not in (None, peer.world):
                    continue
                if recv.done or recv.error is not None:
                    continue
                if (
                    bound is None
                    and recv.source is None
                    and peer.world in self._left.get(comm.scope.comm_id, ())
                    and not self._all_gone(comm.scope)
                ):
                    continue  # it closed this communicator first: it was never coming
                if bound is not None:
                    recv.message = None
                    bound.recv = None
                seq = bound.seq if bound is not None else None
                comm.unpost(recv)
                recv.error = self._for_call(base, recv.scope, recv.what, seq, peer.world)
                wake(recv)

    def _all_gone(self, scope: Scope) -> bool:
        """Whether every other member of ``scope`` closed it or failed: nothing can come."""
        left = self._left.get(scope.comm_id, {})
        for world in scope.members:
            if world == self.rank or world in left:
                continue
            peer = self._peers.get(world)
            if peer is None or peer.error is None:
                return False
        return True

    def _all_left_error(self, scope: Scope, what: str) -> PeerFailedError:
        """The error of a receive from any member once every other member has left: it
        names the one whose leaving says the most (one that left on an error of its own,
        else one that left because another failed, else one that closed), the lowest such
        rank. A server whose workers closed one by one, one of them on an error first,
        learns of the error, not of the last close."""
        left = self._left.get(scope.comm_id, {})
        gone = [w for w in scope.members if w != self.rank and w in left]

        def telling(world: int) -> tuple[int, int]:
            why = left[world]
            return (2 if why is None else 1 if why.culprit is not None else 0), world

        return self._left_error(scope, what, min(gone, key=telling), every=True)

    def _left_error(
        self, scope: Scope, what: str, world: int, *, every: bool = False
    ) -> PeerFailedError:
        """The error of a call that waits for ``world``, which left the communicator (with
        ``every``: as did every other member): it says why, as the LEFT frame did, and
        names the culprit where ``world`` left only because another member failed
        (``peer`` is then the culprit's rank, so that ``trioring run`` blames it; a culprit
        that is no member is not believed, and one that is this live rank leaves the blame
        with ``world``)."""
        rank = scope.members.index(world)
        why = self._left.get(scope.comm_id, {}).get(world)
        blamed = rank
        if why is None:
            told = f"rank {rank} closed this communicator: nothing more comes from it"
        elif why.culprit in scope.members and why.culprit not in (world, self.rank):
            blamed = scope.members.index(why.culprit)
            told = (
                f"rank {rank} left this communicator because of rank {blamed}, {why.text}; "
                f"nothing more comes from rank {rank}"
            )
        else:
            about_us = " because of this rank," if why.culprit == self.rank else ""
            told = f"rank {rank} left this communicator{about_us} {why.text}; nothing more "
            told += "comes from it"
        if every:
            told = f"every other rank has left this communicator; {told}"
        error = PeerFailedError(
            f"{self._where(scope, what, None)}: {told}, and it receives nothing more"
            f"{self._unreceived(scope, world)}",
            rank=scope.rank,
            peer=blamed,
            collective=what.partition("(")[0],
            job_id=self.job_id,
        )
        if scope.label:
            error._trioring_world_ranks = scope.members  # for trioring run: see echoed_ranks
        return error

    def _unreceived(self, scope: Scope, world: int) -> str:
        """What ``world`` sent on ``scope`` that no receive took, as the end of a message:
        a receive that waits in vain for a peer that has left usually names the wrong tag
        (or source), and the messages that did come say which."""
        comm = self._comms.get(scope.comm_id)
        tags = Counter(m.tag for m in comm.queued() if m.peer == world) if comm else Counter()
        total = tags.total()
        if not total:
            return ""
        many = "message" if total == 1 else "messages"
        if len(tags) == 1:
            counted = f"with tag {next(iter(tags))}"
        else:
            counted = "with tags " + ", ".join(f"{tag} ({tags[tag]})" for tag in sorted(tags))
        return f"; of what it sent, this rank has not received {total} {many}, {counted}"

    def _protocol_violation(self, peer: Peer, detail: str) -> None:
        self._record_failure(peer, ProtocolError, detail)

    def _link_down(self, peer: Peer, exc: BaseException) -> LinkDown:
        """A write to ``peer`` failed: the peer's end of the connection is closed (or its
        host gone). A peer that closed it on purpose said why first, in a LEFT frame that
        may still wait unread behind the end: the reader reads on to it (``drain``), so
        that the call whose write failed can say what the LEFT says (:meth:`_explained`)."""
        if self._closed:
            return LinkDown(self._closed_error(None, "write"))
        return LinkDown(self._record_failure(peer, PeerFailedError, lost(exc), drain=True))

    async def _explained(
        self, down: LinkDown, scope: Scope, what: str, seq: int | None, world: int
    ) -> TrioringError:
        """The error of call ``what`` on ``scope``, whose write to ``world`` failed
        (``down``). Where the peer left the communicator first, saying why (its LEFT was
        still unread when the write failed: the peer closed the connection right after),
        that, as every later call to it raises; else the failure, for this call. Waits,
        shielded, for the peer's reader to end, which takes at most ``_DRAIN_SECONDS``
        (:meth:`_link_down`; bounded here too). Call without holding the peer's lock."""
        peer = self._peers[world]
        if not self._closed and peer.error is down.base:
            with trio.move_on_after(2 * _DRAIN_SECONDS, shield=True):
                await peer.reader_ended.wait()
            if world in self._left.get(scope.comm_id, ()):
                return self._left_error(scope, what, world)
        return self._for_call(down.base, scope, what, seq, world)

    # -- writing ---------------------------------------------------------------------------

    async def _write_locked(self, peer: Peer, *buffers: bytes | memoryview) -> bool:
        """Write one frame (with the control frames and credit owed first) while holding
        ``peer.lock``; shielded, so that no frame is ever cut in half. Returns whether it
        passed through the scheduler: not when a socket took the whole frame at once."""
        extra = peer.outbox
        peer.outbox = []
        if peer.owed >= self._piggyback:
            extra.append(pack_credit(peer.owed))
            peer.held -= peer.owed
            peer.owed = 0
        if peer.error is not None:
            raise LinkDown(peer.error)
        fast = peer.fast
        try:
            if fast is None:
                with trio.CancelScope(shield=True):
                    await peer.connection.send_all(*extra, *buffers)
                return True
            # Synchronously first: a small frame goes out at once, without the socket's
            # pass through the scheduler and the shield's cancel scope (together 70 of the
            # 135 us that sending 8 bytes took at world 2 on 2 vCPUs, bench/p2p.py).
            # (The control frames as one buffer: however many a burst of cancelled calls
            # queued, the frame stays a handful of buffers, far below writev's limit.)
            joined = (b"".join(extra),) if extra else ()
            views = [memoryview(b).cast("B") for b in (*joined, *buffers)]
            views = advance(views, fast.send_nowait(views))
            if not views:
                return False
            with trio.CancelScope(shield=True):
                await fast.send_rest(views)
            return True
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            raise self._link_down(peer, exc) from exc

    async def _control(self, peer: Peer, *buffers: bytes) -> bool:
        """Write control frames (and whatever the outbox holds), shielded from the start: the
        lock is held one frame at a time by others, so the wait is short. Returns whether
        it passed through the scheduler (not when the lock was free and the socket took
        the frame at once: a CTS then costs 40 us less, bench/p2p.py's 1 MiB + 8)."""
        passed = await peer.acquire(shielded=True)
        try:
            return await self._write_locked(peer, *buffers) or passed
        finally:
            peer.lock.release()

    async def _flush(self, peer: Peer) -> bool:
        """Write the outbox, and a CREDIT frame if half the window is owed; best effort.
        Returns whether it passed through the scheduler (False if nothing needed writing)."""
        if not peer.outbox and peer.owed < max(1, self._window // 2):
            return False
        if peer.error is not None:
            peer.outbox.clear()
            return False
        try:
            return await self._control(peer)
        except LinkDown:
            return False

    async def _after_consuming(self, world: int) -> None:
        """A receive consumed an eager message: give credit back if enough is owed."""
        peer = self._peers.get(world)
        if peer is None or not await self._flush(peer):
            await trio.lowlevel.cancel_shielded_checkpoint()

    # -- arguments -------------------------------------------------------------------------

    def _comm(self, scope: Scope, what: str) -> CommState:
        if self._closed:
            raise self._closed_error(scope, what)
        error = self._unregistered.get(scope.comm_id)
        if error is not None:
            raise error(what)
        comm = self._comms.get(scope.comm_id)
        if comm is None or comm.scope is None:
            raise InvalidArgumentError(
                f"{self._where(scope, what, None)}: comm id {scope.comm_id:#x} is not registered",
                rank=scope.rank,
            )
        if comm.scope is not scope and comm.scope != scope:
            raise InvalidArgumentError(
                f"{self._where(scope, what, None)}: scope {scope} is not the registered one",
                rank=scope.rank,
            )
        return comm

    def _check_tag(self, scope: Scope, what: str, tag: object) -> None:
        if not isinstance(tag, int) or not 0 <= tag < TAG_BOUND:
            raise InvalidArgumentError(
                f"{self._where(scope, what, None)}: tag must be 0 <= tag < 2**31",
                rank=scope.rank,
            )

    def _check_rank(self, scope: Scope, what: str, rank: object) -> int:
        if not isinstance(rank, int) or not 0 <= rank < len(scope.members):
            raise InvalidArgumentError(
                f"{self._where(scope, what, None)}: rank out of range "
                f"(the communicator has {len(scope.members)} ranks)",
                rank=scope.rank,
            )
        return scope.members[rank]

    # -- failing many calls at once --------------------------------------------------------

    def _fail_comm(self, comm: CommState, error: Callable[[str], TrioringError]) -> None:
        for recv in list(comm.recvs):
            if recv.done or recv.error is not None:
                continue
            message = recv.message
            if message is not None:
                recv.message = None
                message.recv = None
                self._drop(message)
            comm.unpost(recv)
            recv.error = error(recv.what)
            wake(recv)
        for send in list(comm.sends):
            if not send.done and send.error is None:
                send.error = error(send.what)
                wake(send)
        for message in comm.clear_queued():
            self._drop(message)

    def _drop(self, message: Message) -> None:
        """Forget ``message`` (its communicator is gone): give its credit back; a rendezvous
        message whose CTS went out is rejected and forgotten on the sender's RESTART, as is
        one rejected already (its DATA, PULL and RESTART are still on their way)."""
        if message.payload is not None:
            self._consumed(message)
        elif message.self_send is not None:
            message.self_send.error = message.self_send.error or self._closed_error(
                message.self_send.scope, message.self_send.what
            )
            wake(message.self_send)
        elif message.peer in self._peers:
            peer = self._peers[message.peer]
            if (message.cts_sent or message.rejected) and peer.error is None:
                if message.cts_sent:
                    self._reject(peer, message)
                message.dropped = True
            else:
                self._forget(peer, message)

    def _forget(self, peer: Peer, message: Message) -> None:
        peer.inbound.pop(message.msg_id, None)
        message.dropped = True
        message.target = None

    def _reject(self, peer: Peer, message: Message) -> None:
        """The receive of ``message`` ends before all of it landed: REJECT it (queued; the
        task that ends the receive writes it)."""
        message.rejected = True
        message.cts_sent = False
        message.target = None
        message.received = 0
        peer.outbox.append(pack_control(FrameType.REJECT, message.msg_id))

    def _consumed(self, message: Message) -> None:
        """An eager message left the queue (received or dropped): its credit is owed back."""
        if message.peer == self.rank:
            self._self_buffered -= message.cost
            return
        peer = self._peers[message.peer]
        peer.buffered -= message.cost
        if peer.error is None:
            peer.owed += message.cost
