"""The readers of the point-to-point plane (one task per peer connection) and what they
do with each frame: messages arriving, answers to our sends, DATA straight into its target,
the PULL that lets a receive keep what it copied out of the sender's memory, and the LEFT
of a peer that closed a communicator; and that copy, which the receiving task makes
(:meth:`Reading._copy_out`). Readers never write: the frames that answer them go out from
the tasks they wake (see :class:`~trioring._p2p._engine.Engine`)."""

from __future__ import annotations

import errno
from typing import TYPE_CHECKING

import numpy as np
import trio

from .._errors import PeerFailedError, ProtocolError
from .._onehost import _cma
from ._binding import Binding
from ._engine import MAX_PENDING_RTS, MESSAGE_OVERHEAD, bytes_of
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
    from collections.abc import Callable

__all__ = ["Reading"]

#: The most a receive copies out of a sender's memory between two schedule points: as the
#: collectives' cross-memory reads (_cma_collectives._READ_STEP_BYTES), about 350 us here,
#: while a pass through the scheduler costs tens of microseconds.
_PULL_STEP_BYTES = 4 * 1024 * 1024
_NOTHING = memoryview(b"")


def body_bytes(frame: Frame) -> int:
    """What follows ``frame``'s header (for DATA: its payload)."""
    ftype = frame.type
    if ftype is FrameType.EAGER or ftype is FrameType.RTS:
        guard = DIM.size if frame.offset else 0
        return DIM.size * frame.ndim + guard + (frame.nbytes if ftype is FrameType.EAGER else 0)
    if ftype is FrameType.LEFT:
        return frame.nbytes
    return frame.count if ftype is FrameType.DATA else 0


class Reading(Binding):
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
            if peer.draining and peer.error is not None:
                peer.draining = False
                self._fail_waiting(peer, peer.error)
            peer.reader_ended.set()

    def _reading_failed(self, peer: Peer, exc: trio.BrokenResourceError | ProtocolError) -> None:
        if isinstance(exc, ProtocolError):
            self._record_failure(peer, ProtocolError, f"it broke the protocol: {exc}")
        else:
            self._record_failure(peer, PeerFailedError, lost(exc))

    async def _dispatch(self, peer: Peer, reader: FrameReader, frame: Frame) -> None:
        if frame.type is FrameType.DATA:
            await self._data(peer, reader, frame)
            return
        size = body_bytes(frame)
        if frame.type is FrameType.EAGER and size > READ_WHOLE_BYTES:
            # A large payload lands straight in its array (one copy).
            shape = decode_shape(await reader.read(DIM.size * frame.ndim), frame)
            cost = self._eager_cost(peer, frame)
            payload = np.empty(shape, frame.dtype)
            await reader.read_into(payload.reshape(-1).view(np.uint8).data)
            self._message(peer, frame, shape, 0, payload, cost)
            return
        self._handle(peer, frame, await reader.read(size) if size else _NOTHING)

    def _eager(
        self,
        peer: Peer,
        frame: Frame,
        shape: tuple[int, ...],
        read: Callable[[memoryview], object],
    ) -> None:
        """An EAGER ``frame`` arrived whose payload ``read(target)`` puts into ``target`` now,
        synchronously (from the reader's buffer, or off the socket where all of it waits).
        ``target`` is the bytes of the ``out`` of the receive it arrives for where there is
        one (:meth:`_landing`), so that binding copies nothing; else of a new array, queued
        with the message."""
        cost = self._eager_cost(peer, frame)
        message = self._inbound(peer, frame, shape)
        recv = self._landing(message)
        if recv is None:
            payload = np.empty(shape, frame.dtype)
            target = bytes_of(payload)
        else:
            payload, target = self._target(message, recv)
            message.landed = True
        read(target)
        self._message(peer, frame, shape, 0, payload, cost, message)

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

            def copy(target: memoryview) -> None:
                target[:] = body[dims:]

            self._eager(peer, frame, shape, copy)
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
