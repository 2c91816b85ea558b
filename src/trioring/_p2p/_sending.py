"""The sending half of the endpoint: eager sends, rendezvous sends and sends to oneself (the
protocol and its guarantees: :mod:`._endpoint`)."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import numpy as np
import trio

from .._errors import InvalidArgumentError, TrioringError
from .._onehost._cma import data_address
from .._wire import DTYPE_CODES
from ._engine import MESSAGE_OVERHEAD, LinkDown, bytes_of, checked_array
from ._frames import FrameType, MessageKind, pack_control, pack_data, pack_message
from ._matching import CommState, Message, Scope, SendWait
from ._polling import Polling

if TYPE_CHECKING:
    from collections.abc import Callable

    from ._peer import Peer

__all__ = ["Sending"]


class Sending(Polling):
    """The sending half of the endpoint (the public calls are in Endpoint)."""

    # -- sending ---------------------------------------------------------------------------

    async def send(
        self,
        scope: Scope,
        dest: int,
        tag: int,
        array: np.ndarray,
        *,
        kind: MessageKind = MessageKind.ARRAY,
    ) -> None:
        """Send ``array`` (any shape and supported dtype; its dtype and shape travel with it)
        to communicator rank ``dest`` with ``tag``. Returns once the message was written whole
        (eager) or the receiver has all of it (rendezvous); do not modify ``array`` before.
        ``kind=OBJECT`` marks uint8 bytes of the object codec. Raises InvalidArgumentError
        before any I/O for a bad argument; PeerFailedError or ProtocolError if ``dest``
        failed (a send that raised it may still have been delivered)."""
        await trio.lowlevel.checkpoint_if_cancelled()
        name = "send_object" if kind == MessageKind.OBJECT else "send"
        what = f"{name}(dest={dest}, tag={tag})"
        try:
            comm = self._comm(scope, what)
            self._check_tag(scope, what, tag)
            world = self._check_rank(scope, what, dest)
            data = checked_array(array, what, scope.rank)
            if not data.flags.c_contiguous:
                data = data.copy(order="C")  # (np.ascontiguousarray would make 0-d arrays 1-d)
            kind = MessageKind(kind)
            if kind is MessageKind.OBJECT and data.dtype != np.uint8:
                raise InvalidArgumentError(
                    f"{self._where(scope, what, None)}: an object payload must be uint8",
                    rank=scope.rank,
                )
            peer = self._peers.get(world)
            if world in self._left.get(scope.comm_id, ()):
                raise self._left_error(scope, what, world)
            if peer is not None and peer.error is not None:
                raise self._for_call(peer.error, scope, what, None, world)
        except TrioringError:
            await trio.lowlevel.cancel_shielded_checkpoint()
            raise
        if peer is None:
            await self._send_self(comm, scope, tag, data, kind, what)
            return
        cost = data.nbytes + MESSAGE_OVERHEAD
        eager = self._eager_bytes if peer.pid is None else self._cma_eager_bytes
        if data.nbytes <= eager and peer.credit >= cost:
            header = pack_message(
                FrameType.EAGER, kind, DTYPE_CODES[data.dtype], data.shape, tag,
                scope.comm_id, peer.take_id(), data.nbytes, data.size,
            )  # fmt: skip
            passed = await peer.acquire()  # cancellable: nothing is sent yet
            sent = False
            down: LinkDown | None = None
            try:
                if peer.credit >= cost:  # still, after waiting for the lock
                    peer.credit -= cost
                    seq = comm.seq_out(world)
                    try:
                        passed |= await self._write_locked(peer, header, bytes_of(data))
                    except LinkDown as exc:
                        down = exc
                    sent = down is None
            finally:
                peer.lock.release()
            if down is not None:
                raise await self._explained(down, scope, what, seq, world) from None
            if sent:
                if not passed:
                    # The message is out: a schedule point, but no Cancelled after it.
                    await trio.lowlevel.cancel_shielded_checkpoint()
                return
        await self._send_rendezvous(comm, peer, scope, tag, data, kind, what)

    async def _send_rendezvous(
        self,
        comm: CommState,
        peer: Peer,
        scope: Scope,
        tag: int,
        data: np.ndarray,
        kind: MessageKind,
        what: str,
    ) -> None:
        send = SendWait(scope=scope, peer=peer.world, msg_id=peer.take_id(), what=what)
        nbytes = data.nbytes
        flat = bytes_of(data)
        # On one host with cross-memory attach agreed, the RTS gives our array's address
        # and the receiver copies the message out of our memory itself, once, from its CTS
        # on, instead of DATA frames through the socket (two copies and a frame per chunk);
        # our PULL, after the CTS, tells it that it may keep the copy. Empty messages have
        # no address to give. The guard holds the msg id while our array is the message's:
        # a send that gives up (cancelled before its PULL, its communicator or endpoint
        # closed, a failure) zeroes it before it returns, and the receiver reads it after
        # its copy, so a copy that may overlap the caller's next writes to the array is
        # never delivered (stores reach other processes in program order:
        # _cma.STORES_IN_ORDER).
        guard = np.array([send.msg_id], np.uint64) if peer.pid is not None and nbytes else None
        header = pack_message(
            FrameType.RTS, kind, DTYPE_CODES[data.dtype], data.shape, tag, scope.comm_id,
            send.msg_id, nbytes, data.size,
            address=0 if guard is None else data_address(data),
            guard=0 if guard is None else data_address(guard),
        )  # fmt: skip
        await peer.acquire()  # cancellable: nothing is sent yet
        down: LinkDown | None = None
        try:
            send.seq = comm.seq_out(peer.world)
            # Registered before the RTS goes out: the receiver's CTS can come back (and our
            # reader handle it) while the write below is still in its checkpoint.
            peer.outbound[send.msg_id] = send
            comm.sends.add(send)
            try:
                await self._write_locked(peer, header)
            except LinkDown as exc:
                peer.outbound.pop(send.msg_id, None)
                comm.sends.discard(send)
                down = exc
        finally:
            peer.lock.release()
        if down is not None:
            raise await self._explained(down, scope, what, send.seq, peer.world) from None
        passed = False  # through the scheduler: if not, a schedule point at the end
        try:
            while True:
                send.abortable = True
                while not send.cts:
                    passed |= await self._park_send(send)
                offset = 0
                while True:
                    count = nbytes if guard is not None else min(self._chunk, nbytes - offset)
                    await peer.acquire()  # cancellable, between chunks: WITHDRAW
                    try:
                        if send.error is not None:
                            raise send.error
                        rejected = send.rejected
                        if not rejected and guard is not None:
                            await self._write_locked(
                                peer, pack_control(FrameType.PULL, send.msg_id)
                            )
                        elif not rejected:
                            frame = pack_data(send.msg_id, nbytes, offset, count)
                            await self._write_locked(peer, frame, flat[offset : offset + count])
                    finally:
                        peer.lock.release()
                    if rejected:
                        break
                    offset += count
                    if offset >= nbytes:
                        # All of it is written (or PULL is out: the receiver may be reading
                        # our memory now): from here the send completes (DONE) or delivers
                        # nothing (REJECT), so a cancellation waits for which.
                        send.abortable = False
                        while not (send.done or send.rejected):
                            passed |= await self._park_send(send)
                        if send.done:
                            if not passed:
                                await trio.lowlevel.cancel_shielded_checkpoint()
                            return
                        break
                # REJECT: the receiver discards what came; begin again on its next CTS.
                send.rejected = send.cts = False
                await self._control(peer, pack_control(FrameType.RESTART, send.msg_id))
        except LinkDown as exc:
            raise await self._explained(exc, scope, what, send.seq, peer.world) from None
        except BaseException:
            if not send.done and peer.error is None and not self._closed:
                peer.outbox.append(pack_control(FrameType.WITHDRAW, send.msg_id))
                await self._flush(peer)
            raise
        finally:
            if guard is not None and not send.done:
                guard[0] = 0
            peer.outbound.pop(send.msg_id, None)
            comm.sends.discard(send)

    async def _park_send(
        self, send: SendWait, on_abort: Callable[[], object] | None = None
    ) -> bool:
        """Wait until the reader (or a failure) wakes ``send``; raise its error if it has one.
        Cancellation is refused while ``send.abortable`` is false. Polls first, as a
        receive does (Polling._poll): the CTS, and the DONE or REJECT, come within a round
        trip and a copy when the receive is waiting. Returns whether it passed through the
        scheduler."""
        before = _state(send)
        passed = False
        if send.error is None and send.peer != self.rank:
            passed = await self._poll((send.peer,), lambda: _state(send) != before)
        if _state(send) == before and send.error is None:
            send.task = trio.lowlevel.current_task()

            def abort(_: object) -> trio.lowlevel.Abort:
                if not send.abortable:
                    return trio.lowlevel.Abort.FAILED
                send.task = None
                if on_abort is not None:
                    on_abort()
                return trio.lowlevel.Abort.SUCCEEDED

            await trio.lowlevel.wait_task_rescheduled(abort)
            passed = True
        if send.error is not None and not send.done:
            raise send.error
        return passed

    async def _send_self(
        self,
        comm: CommState,
        scope: Scope,
        tag: int,
        data: np.ndarray,
        kind: MessageKind,
        what: str,
    ) -> None:
        """A send to this very rank: buffered like an eager message while small (within its
        own window), else it waits for the matching receive, which copies it once."""
        common = {"comm_id": scope.comm_id, "tag": tag, "kind": kind, "dtype": data.dtype}
        cost = data.nbytes + MESSAGE_OVERHEAD
        if data.nbytes <= self._eager_bytes and self._self_buffered + cost <= self._window:
            message = Message(
                peer=self.rank,
                shape=data.shape,
                nbytes=data.nbytes,
                **common,  # type: ignore[arg-type]
            )
            message.payload, message.cost = data.copy(), cost
            self._arrive(message)
            await trio.lowlevel.cancel_shielded_checkpoint()
            return
        send = SendWait(scope=scope, peer=self.rank, msg_id=0, what=what)
        message = Message(
            peer=self.rank,
            shape=data.shape,
            nbytes=data.nbytes,
            **common,  # type: ignore[arg-type]
        )
        message.local, message.self_send = data.reshape(-1).view(np.uint8), send
        comm.sends.add(send)
        try:
            self._arrive(message)
            send.seq = message.seq
            if send.done:
                await trio.lowlevel.cancel_shielded_checkpoint()
                return
            while not send.done:
                await self._park_send(send, on_abort=functools.partial(comm.remove, message))
        finally:
            comm.sends.discard(send)


def _state(send: SendWait) -> tuple[bool, bool, bool, bool]:
    return send.cts, send.done, send.rejected, send.error is not None
