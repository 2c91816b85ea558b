"""The readers of the point-to-point plane (one task per peer connection) and what they
do with each frame: messages arriving, answers to our sends, DATA straight into its target,
the PULL that lets a receive keep what it copied out of the sender's memory, and the LEFT
of a peer that closed a communicator; and that copy, which the receiving task makes
(:meth:`Reading._copy_out`). Readers never write: the frames that answer them go out from
the tasks they wake (see :class:`~trioring._p2p._engine.Engine`)."""

from __future__ import annotations

import errno
import math
import os
import time
from typing import TYPE_CHECKING

import numpy as np
import trio

from .._errors import PeerFailedError, ProtocolError
from .._framing import SPIN_SLICE_SECONDS
from .._onehost import _cma
from ._engine import MAX_PENDING_RTS, MESSAGE_OVERHEAD, Engine, bytes_of
from ._frames import (
    DIM,
    HEADER,
    Frame,
    FrameType,
    Leaving,
    MessageKind,
    decode_header,
    decode_leaving,
    decode_shape,
    pack_left,
)
from ._matching import CommState, Message, PostedRecv, wake
from ._peer import _LOST, READ_WHOLE_BYTES, FrameReader, Peer, lost

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from ..transports._socket import SocketConnection

__all__ = ["Reading"]

#: The most a receive copies out of a sender's memory between two schedule points: as the
#: collectives' cross-memory reads (_cma_collectives._READ_STEP_BYTES), about 350 us here,
#: while a pass through the scheduler costs tens of microseconds.
_PULL_STEP_BYTES = 4 * 1024 * 1024
#: Where polling is on (the spin feature), a receive or a rendezvous send polls at least
#: this long before it parks, as a wait on the shared segment does
#: (_shm_collectives.SHM_SPIN_SECONDS): a peer that runs Python between two messages
#: answers later than the 50 us of a collective's poll (DEFAULT_SPIN_US), and a wait that
#: parks is woken through the event loop and the reader. Ping-pong at world 2 on 2 vCPUs,
#: one way, polling this long against 50 us (bench/p2p.py, three launches each): 8 bytes
#: 122-131 us against 181-199, 64 KiB 179-185 against 218-235. The cost where ranks
#: outnumber cores: a ring of 1 MiB eager messages at world 3 took 2479-2634 us per step
#: against 2304-2377 (8 bytes: 395-413 against 428-623); 1 MiB now goes by cross-memory
#: attach there (CMA_EAGER_BYTES), 1.7-1.8 ms.
POLL_SECONDS = 0.001
#: A poll asks Trio whether other tasks wait to run every this many looks, not at each: the
#: question (5.4 us here) costs more than a look (a peek at a socket, 2.9 us, and a yield of
#: the CPU, 0.5 us). After a look that took frames (which may have woken tasks) it asks at
#: once, but passes through the scheduler only if tasks wait: where a CREDIT frame comes
#: just before a large message, a pass after it let the reader, woken by the message's first
#: bytes, read half of the 256 KiB messages of a ping-pong (and chase their writer), 160-170
#: us one way at world 2 on 2 vCPUs against 106-112 with the poll taking them all
#: (bench/p2p.py).
_LOOKS_PER_QUEUE_CHECK = 4
#: What a look at a socket copies first (MSG_PEEK copies): enough for a burst of small
#: frames, where copying the whole buffer each time would cost a waiting receive 10-20 us
#: per look when a large message fills the socket.
_PEEK_FIRST_BYTES = 4096
_NOTHING = memoryview(b"")


def _body_bytes(frame: Frame) -> int:
    """What follows ``frame``'s header (for DATA: its payload)."""
    ftype = frame.type
    if ftype is FrameType.EAGER or ftype is FrameType.RTS:
        guard = DIM.size if frame.offset else 0
        return DIM.size * frame.ndim + guard + (frame.nbytes if ftype is FrameType.EAGER else 0)
    if ftype is FrameType.LEFT:
        return frame.nbytes
    return frame.count if ftype is FrameType.DATA else 0


def _read_exactly(connection: SocketConnection, target: memoryview) -> None:
    """Read ``target``'s size from ``connection``, where that many bytes wait already."""
    position = 0
    while position < target.nbytes:
        got = connection.recv_nowait(target[position:])
        if not got:  # cannot happen: the bytes were there, and only we read them
            raise trio.BrokenResourceError(f"read {position} of {target.nbytes} bytes seen waiting")
        position += got


class Reading(Engine):
    """The reading half of the engine."""

    # -- reading ---------------------------------------------------------------------------

    async def _read_peer(self, peer: Peer) -> None:
        """Read ``peer``'s frames until its connection ends, it breaks the protocol, or the
        endpoint closes; then close the connection. Never writes, never raises for the peer."""
        reader = peer.reader
        try:
            with peer.reader_scope:
                while True:
                    frame = decode_header(await reader.read_header(HEADER.size))
                    await self._dispatch(peer, reader, frame)
        except EOFError:
            self._record_failure(peer, PeerFailedError, _LOST)
        except trio.ClosedResourceError:
            if not self._closed:
                self._record_failure(peer, PeerFailedError, _LOST)
        except (trio.BrokenResourceError, ProtocolError) as exc:
            self._reading_failed(peer, exc)
        finally:
            with trio.CancelScope(shield=True):
                await trio.aclose_forcefully(peer.connection)

    def _reading_failed(self, peer: Peer, exc: trio.BrokenResourceError | ProtocolError) -> None:
        if isinstance(exc, ProtocolError):
            self._record_failure(peer, ProtocolError, f"it broke the protocol: {exc}")
        else:
            self._record_failure(peer, PeerFailedError, lost(exc))

    async def _dispatch(self, peer: Peer, reader: FrameReader, frame: Frame) -> None:
        if frame.type is FrameType.DATA:
            await self._data(peer, reader, frame)
            return
        size = _body_bytes(frame)
        if frame.type is FrameType.EAGER and size > READ_WHOLE_BYTES:
            # A large payload lands straight in its array (one copy).
            shape = decode_shape(await reader.read(DIM.size * frame.ndim), frame)
            cost = self._eager_cost(peer, frame)
            payload = np.empty(shape, frame.dtype)
            await reader.read_into(payload.reshape(-1).view(np.uint8).data)
            self._message(peer, frame, shape, 0, payload, cost)
            return
        self._handle(peer, frame, await reader.read(size) if size else _NOTHING)

    async def _poll(self, worlds: Sequence[int], moved: Callable[[], bool]) -> bool:
        """Before a receive or a send parks: look for frames from the peers ``worlds``
        (world ranks) until ``moved()``: as a collective's receive does, for a peer on
        another core often answers within microseconds, where parking would add the
        operating system's wake-up of an idle process and passes through the scheduler for
        the reader and then the waiting task. Each look takes the frames waiting on the
        sockets itself (:meth:`_take_waiting`) and yields the CPU; the first pass through the
        scheduler (the schedule point the call owes) comes right after the first look, while
        the peer is still busy, and the reader and the other tasks of this program run at the
        next ones, as soon as one has work and at least every ``SPIN_SLICE_SECONDS``. Polls
        for ``spin_seconds`` (at least ``POLL_SECONDS``); looks once where polling is off;
        stops at once where a peer's reader must go on (inside a frame, at a DATA frame,
        at a large EAGER frame that stopped coming before it was whole), or where no peer
        can answer (a send to ourselves). The passes are shielded; a cancellation ends the poll at the next
        one, and the caller's wait takes it. Returns whether it passed through the
        scheduler."""
        peers = [peer for world in worlds if (peer := self._peers.get(world)) is not None]
        passed = False
        start = time.perf_counter()
        deadline = start + (self._spin_seconds and max(self._spin_seconds, POLL_SECONDS))
        slice_end = start + SPIN_SLICE_SECONDS
        statistics = trio.lowlevel.current_statistics
        looks = 0
        while True:
            # None: someone else must run (a reader; with no peer, a task of ours sending
            # to us); True: frames were taken.
            took: bool | None = False if peers else None
            for peer in peers:
                taken = self._take_waiting(peer)
                if taken is None:
                    took = None
                elif taken and took is False:
                    took = True
            if moved() or took is None:
                return passed
            now = time.perf_counter()
            if now >= deadline:
                return passed
            looks += 1
            if (
                not passed
                or now >= slice_end
                or ((took or not looks % _LOOKS_PER_QUEUE_CHECK) and statistics().tasks_runnable)
            ):
                await trio.lowlevel.cancel_shielded_checkpoint()
                passed = True
                if moved() or trio.current_effective_deadline() == -math.inf:
                    return True
                slice_end = time.perf_counter() + SPIN_SLICE_SECONDS
            else:
                os.sched_yield()

    def _take_waiting(self, peer: Peer) -> bool | None:
        """Take the whole frames that wait on ``peer``'s socket and handle them here, in the
        calling task, as the reader would have. For a call that polls: its message (or
        answer) is then handled without waking the reader and then the call, two passes
        through the scheduler of 10-20 us each here (with the poll of POLL_SECONDS, an
        8-byte message one way at world 2 on 2 vCPUs went from 174-198 us to 116-126,
        bench/p2p.py). Only while the reader is
        :attr:`~._peer.FrameReader.idle`, by a look at the socket that takes nothing
        (MSG_PEEK), then a read of exactly the whole frames seen, so that what the reader
        reads next is still the start of a frame; a large EAGER frame first in line goes to
        :meth:`_take_large`. Returns whether it took any; None when only the reader can go
        on (it is inside a frame, the next frame is DATA, the connection ended or failed),
        so the caller should let it run."""
        fast = peer.fast
        if fast is None or not fast.can_peek or not peer.reader.idle or peer.error is not None:
            return None
        window = self._peek_buffer.view
        limit = _PEEK_FIRST_BYTES
        try:
            while True:
                got = fast.peek_nowait(self._peek_buffer, limit)
                if not got:
                    return None if got == 0 else False  # 0: the end; the reader says so
                taken = 0
                frames: list[tuple[Frame, int, int]] = []
                short = False  # whether the last frame seen is cut off
                while got - taken >= HEADER.size:
                    frame = decode_header(window[taken : taken + HEADER.size])
                    size = _body_bytes(frame)
                    if frame.type is FrameType.DATA or size > READ_WHOLE_BYTES:
                        if frames:
                            break  # taken at the next look
                        if frame.type is FrameType.EAGER:
                            return self._take_large(peer, frame, size)
                        return None
                    if got - taken - HEADER.size < size:
                        short = True  # the rest is on its way, or beyond this look
                        break
                    frames.append((frame, taken + HEADER.size, size))
                    taken += HEADER.size + size
                else:
                    short = got > taken
                if not short or got < limit or limit == len(window):
                    break
                limit = len(window)  # the rest may be there already: look at all of it
            if not frames:
                return False
            _read_exactly(fast, window[:taken])
            self.taken_by_waits += len(frames)
            for frame, at, size in frames:
                self._handle(peer, frame, window[at : at + size])
        except trio.ClosedResourceError:
            return None
        except (trio.BrokenResourceError, ProtocolError) as exc:
            self._reading_failed(peer, exc)  # which stops the reader (Engine._record_failure)
            return None
        return True

    def _take_large(self, peer: Peer, frame: Frame, size: int) -> bool | None:
        """For :meth:`_take_waiting`: take the large EAGER ``frame`` (``size`` bytes after
        its header) at the start of ``peer``'s socket once all of it waits there, its
        payload read straight into the ``out`` of the receive it arrives for where there is
        one (:meth:`_landing`): one copy, no wake-up of the reader and then the receive.
        Ping-pong at world 2 on 2 vCPUs, one way (bench/p2p.py): 128 KiB 89-99 us against
        138-142 read by the reader, 256 KiB 97-112 against 160-170 (Gloo: 146-168). False while
        the frame still streams in (the caller looks again); None when only the reader can
        go on: the socket stopped filling before the frame was whole (a TCP receive window
        smaller than the frame, a writer that waits for us)."""
        fast = peer.fast
        assert fast is not None
        waiting = fast.waiting_nowait()
        if waiting < HEADER.size + size:
            if waiting > peer.seen_waiting:
                peer.seen_waiting = waiting
                return False
            peer.seen_waiting = 0
            return None
        peer.seen_waiting = 0
        head = HEADER.size + DIM.size * frame.ndim
        window = self._peek_buffer.view
        _read_exactly(fast, window[:head])
        shape = decode_shape(window[HEADER.size : head], frame)
        cost = self._eager_cost(peer, frame)
        message, payload, target = self._eager_target(peer, frame, shape)
        _read_exactly(fast, target)
        self.taken_by_waits += 1
        self._message(peer, frame, shape, 0, payload, cost, message)
        return True

    def _eager_target(
        self, peer: Peer, frame: Frame, shape: tuple[int, ...]
    ) -> tuple[Message, np.ndarray, memoryview]:
        """For an EAGER ``frame`` whose payload is read now, synchronously: its message, the
        array the payload lands in, and that array's bytes. The array is the
        ``out`` of the receive it arrives for where there is one (:meth:`_landing`), so that
        binding copies nothing; else a new one, queued with the message."""
        message = self._inbound(peer, frame, shape)
        recv = self._landing(message)
        if recv is None:
            payload = np.empty(shape, frame.dtype)
            return message, payload, bytes_of(payload)
        payload, target = self._target(message, recv)
        message.landed = True
        return message, payload, target

    def _eager_cost(self, peer: Peer, frame: Frame) -> int:
        cost = frame.nbytes + MESSAGE_OVERHEAD
        if peer.held + cost > self._window:
            raise ProtocolError(f"an eager message of {frame.nbytes} bytes overran its credit")
        return cost

    def _handle(self, peer: Peer, frame: Frame, body: memoryview) -> None:
        """Handle a frame that is not DATA, its ``body`` (what follows the header) at hand."""
        ftype = frame.type
        if ftype is FrameType.EAGER or ftype is FrameType.RTS:
            dims = DIM.size * frame.ndim
            shape = decode_shape(body[:dims], frame)
            if ftype is FrameType.RTS:
                guard = DIM.unpack(body[dims:])[0] if frame.offset else 0
                self._message(peer, frame, shape, guard, None, 0)
                return
            cost = self._eager_cost(peer, frame)
            message, payload, target = self._eager_target(peer, frame, shape)
            if frame.nbytes:
                target[:] = body[dims:]
            self._message(peer, frame, shape, 0, payload, cost, message)
        elif ftype is FrameType.PULL:
            self._committed(peer, frame)
        elif ftype is FrameType.CREDIT:
            peer.credit += frame.count
            if peer.credit > self._window:
                raise ProtocolError(f"credit beyond the window ({peer.credit} bytes)")
        elif ftype in (FrameType.CTS, FrameType.DONE, FrameType.REJECT):
            self._answer(peer, frame)
        elif ftype is FrameType.RESTART:
            restarted = peer.inbound.get(frame.msg_id)
            if restarted is None or not restarted.rejected:
                raise ProtocolError(f"RESTART of message id {frame.msg_id}, never rejected")
            restarted.rejected = False
            if restarted.dropped:
                peer.inbound.pop(frame.msg_id)
            elif restarted.recv is not None:
                restarted.recv.need_cts = True
                wake(restarted.recv)
        elif ftype is FrameType.LEFT:
            self._peer_left(peer, frame.comm_id, decode_leaving(body, frame))
        else:
            assert ftype is FrameType.WITHDRAW
            self._withdrawn(peer, frame.msg_id)

    def _message(
        self,
        peer: Peer,
        frame: Frame,
        shape: tuple[int, ...],
        guard: int,
        payload: np.ndarray | None,
        cost: int,
        message: Message | None = None,
    ) -> None:
        """An EAGER message (``payload``, costing ``cost`` of credit) or an RTS arrived;
        ``message``: its :meth:`_inbound`, where the caller made it already."""
        if frame.type is FrameType.RTS:
            if frame.offset:
                if peer.pid is None:
                    raise ProtocolError(
                        "an RTS with addresses, but the ranks did not agree on cross-memory attach"
                    )
                if not guard:
                    raise ProtocolError(f"an RTS with addresses but no guard ({frame.msg_id})")
            if len(peer.inbound) >= MAX_PENDING_RTS:
                raise ProtocolError(f"more than {MAX_PENDING_RTS} pending RTS")
            if frame.msg_id in peer.inbound:
                raise ProtocolError(f"a second RTS for message id {frame.msg_id}")
        if message is None:
            message = self._inbound(peer, frame, shape)
        if payload is not None:
            peer.held += cost
            message.payload, message.cost = payload, cost
        else:
            message.address, message.guard = frame.offset, guard
            peer.inbound[frame.msg_id] = message
        self._arrive(message)

    @staticmethod
    def _inbound(peer: Peer, frame: Frame, shape: tuple[int, ...]) -> Message:
        return Message(
            peer=peer.world,
            comm_id=frame.comm_id,
            tag=frame.tag,
            kind=MessageKind(frame.kind),
            dtype=frame.dtype,
            shape=shape,
            nbytes=frame.nbytes,
            msg_id=frame.msg_id,
        )

    def _peer_left(self, peer: Peer, comm_id: int, why: Leaving | None) -> None:
        """LEFT from ``peer``: its calls on the communicator are over. Every message it sent
        on it came before this frame, so a receive still waiting for it never gets one."""
        self._left.setdefault(comm_id, {})[peer.world] = why
        comm = self._comms.get(comm_id)
        if comm is None or comm.scope is None:
            return
        scope = comm.scope
        gone = self._all_gone(scope)
        for recv in list(comm.recvs):
            if recv.done or recv.error is not None:
                continue
            bound = recv.message
            if bound is not None:
                if bound.peer != peer.world:
                    continue
                recv.message = None
                bound.recv = None
                self._forget(peer, bound)
            elif recv.source != peer.world and not (recv.source is None and gone):
                continue
            comm.unpost(recv)
            if bound is None and recv.source is None:
                recv.error = self._all_left_error(scope, recv.what)
            else:
                recv.error = self._left_error(scope, recv.what, peer.world)
            wake(recv)
        for send in list(comm.sends):
            if send.peer == peer.world and not send.done and send.error is None:
                send.error = self._left_error(scope, send.what, peer.world)
                wake(send)

    def queue_left(self, comm_id: int, members: tuple[int, ...], why: Leaving | None) -> list[Peer]:
        """Queue LEFT for ``comm_id``, saying ``why``, to every live peer among ``members``;
        the peers whose outbox must be written."""
        peers = []
        for world in members:
            peer = self._peers.get(world)
            if peer is not None and peer.error is None:
                peer.outbox.append(pack_left(comm_id, why))
                peers.append(peer)
        return peers

    def _withdrawn(self, peer: Peer, msg_id: int) -> None:
        message = peer.inbound.pop(msg_id, None)
        if message is None:
            return  # dropped here already (its communicator is gone)
        message.dropped = True
        message.target = None
        comm = self._comms.get(message.comm_id)
        recv = message.recv
        if recv is not None:
            # The receive that had matched it waits again, in its place among the posted.
            message.recv = None
            recv.message = None
            recv.need_cts = False
            if comm is not None and comm.scope is not None:
                self._rematch(comm, recv)
        elif comm is not None:
            comm.remove(message)

    def _answer(self, peer: Peer, frame: Frame) -> None:
        """A CTS, DONE or REJECT for one of our rendezvous sends."""
        send = peer.outbound.get(frame.msg_id)
        if send is None:
            if frame.msg_id < peer.next_msg_id:
                return  # about a send that gave up: it crossed our WITHDRAW
            raise ProtocolError(f"{frame.type.name} for message id {frame.msg_id}, never sent")
        if frame.type is FrameType.CTS:
            if send.cts:
                raise ProtocolError(f"a second CTS for message id {frame.msg_id}")
            send.cts = True
        elif not send.cts:
            raise ProtocolError(f"{frame.type.name} for message id {frame.msg_id} before its CTS")
        elif frame.type is FrameType.DONE:
            send.done = True
        else:
            send.rejected = True
        wake(send)

    def _transfer(self, peer: Peer, frame: Frame) -> tuple[Message, memoryview | None]:
        """The message that a DATA or PULL frame is about, and its target (None: the
        receive was cancelled after its CTS, and the frame came before our REJECT)."""
        message = peer.inbound.get(frame.msg_id)
        name = frame.type.name
        if message is None:
            raise ProtocolError(f"{name} for message id {frame.msg_id}, which it never announced")
        if message.rejected or message.dropped:
            return message, None
        target = message.target
        if not message.cts_sent or target is None:
            raise ProtocolError(f"{name} for message id {frame.msg_id} before its CTS")
        if (frame.type is FrameType.PULL) != bool(message.address):
            raise ProtocolError(f"{name} for message id {frame.msg_id}, offered otherwise")
        return message, target

    def _landed(self, peer: Peer, message: Message) -> None:
        """All of a rendezvous message is in its target: its receive is done."""
        peer.inbound.pop(message.msg_id)
        recv = message.recv
        assert recv is not None
        message.recv = None
        recv.done = True
        wake(recv)

    def _committed(self, peer: Peer, frame: Frame) -> None:
        """PULL: the sender holds its bytes until DONE or REJECT, so what the receiving
        task copies out of its memory (see :meth:`_copy_out`) may be kept."""
        message, target = self._transfer(peer, frame)
        if target is None:
            return  # written before it saw our REJECT: it writes RESTART next
        message.committed = True
        if message.recv is not None:
            wake(message.recv)

    async def _copy_out(self, comm: CommState, recv: PostedRecv, message: Message) -> None:
        """Copy a message offered by cross-memory attach out of the sender's memory into
        its target, right after its CTS (before its PULL: the copy overlaps the PULL's way
        here), in reads of ``_PULL_STEP_BYTES`` with a schedule point between them. Stops
        where the message is no longer the receive's (withdrawn, dropped, failed); a
        cancellation between two reads REJECTs it, and it goes back, whole, for the next
        receive (the receive may hold another message by then, or be posted again, if the
        sender withdrew this one meanwhile). :meth:`_kept` decides whether the copy counts."""
        peer = self._peers[message.peer]
        assert peer.pid is not None
        assert message.target is not None
        local = _cma.data_address(np.frombuffer(message.target, np.uint8))
        done = 0
        try:
            while done < message.nbytes:
                step = min(_PULL_STEP_BYTES, message.nbytes - done)
                if not self._read_from(peer, message, message.address + done, local + done, step):
                    return
                done += step
                if done < message.nbytes:
                    await trio.lowlevel.checkpoint()
                    if recv.message is not message or message.target is None:
                        return
        except BaseException:
            self._give_up(comm, recv)  # whichever message it holds now, or its place
            raise
        message.received = done

    def _give_up(self, comm: CommState, recv: PostedRecv) -> None:
        """``recv`` ends (cancelled): a posted receive is withdrawn; one bound to a message
        gives it back (REJECTing it if its CTS went), whole, to its place in the queue or to
        the next receive."""
        message = recv.message
        if message is None:
            comm.unpost(recv)
            return
        recv.message = None
        message.recv = None
        if message.cts_sent:
            self._reject(self._peers[message.peer], message)
        self._offer(comm, message)

    def _kept(self, recv: PostedRecv, message: Message) -> None:
        """The PULL came and the copy is complete (or failed): if the guard still holds the
        msg id, every read of the copy came before the sender could give the send up, so
        the receive is done. Else the sender gave up during the copy (its communicator or
        endpoint closed under it) and the copy may be torn: forget the message, as if
        withdrawn; its LEFT, or the end of its connection, follows."""
        peer = self._peers[message.peer]
        if message.unreadable:
            self._protocol_violation(peer, f"its PULL of message id {message.msg_id} came, "
                                     "but its memory could not be read")  # fmt: skip
            return
        guard = np.zeros(1, np.uint64)
        if not self._read_from(peer, message, message.guard, _cma.data_address(guard), 8):
            return
        if int(guard[0]) != message.msg_id:
            self._withdrawn(peer, message.msg_id)
            return
        peer.inbound.pop(message.msg_id)
        message.recv = None
        recv.done = True

    def _read_from(self, peer: Peer, message: Message, remote: int, local: int, n: int) -> bool:
        """Copy ``n`` bytes at ``remote`` in the peer's memory to ``local``. False where it
        failed: the peer exited (its failure is recorded), or its memory is gone (it gave
        the send up, and its WITHDRAW follows; or it broke the protocol, and its PULL)."""
        assert peer.pid is not None
        try:
            _cma.read_into(peer.pid, remote, local, n)
        except _cma.CmaError as exc:
            if exc.errno == errno.ESRCH:
                self._record_failure(
                    peer,
                    PeerFailedError,
                    f"{_LOST} (reading message id {message.msg_id} from its memory: "
                    f"{exc.strerror})",
                )
            else:
                message.unreadable = True
            return False
        return True

    async def _data(self, peer: Peer, reader: FrameReader, frame: Frame) -> None:
        message, target = self._transfer(peer, frame)
        if target is None:
            await reader.skip(frame.count)  # sent before it saw our REJECT: discarded
            return
        if frame.nbytes != message.nbytes or frame.offset != message.received:
            raise ProtocolError(
                f"DATA at {frame.offset} of {frame.nbytes} bytes for message id {frame.msg_id}, "
                f"expected at {message.received} of {message.nbytes}"
            )
        if frame.count:
            await reader.read_into(target[frame.offset : frame.offset + frame.count])
        if message.target is not target:
            return  # the receive ended meanwhile (cancelled): these bytes do not count
        message.received += frame.count
        if message.received == message.nbytes:
            self._landed(peer, message)
