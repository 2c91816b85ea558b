"""Matching under :class:`~trioring._p2p.Endpoint`: what an arriving message is offered to
(the earliest posted receive that matches it, else its communicator's queue), whether it
fits, and binding it to its receive. Synchronous throughout: a reader or a polling call
runs it whole between two schedule points."""

from __future__ import annotations

import numpy as np

from .._errors import InvalidArgumentError, ProtocolError
from ._engine import Engine, bytes_of
from ._matching import CommState, Message, PostedRecv, wake

__all__ = ["Binding"]


class Binding(Engine):
    """The matching half of the engine's state (the readers, in _reading.py, build on it)."""

    # -- matching --------------------------------------------------------------------------

    def _mismatch(self, message: Message, recv: PostedRecv) -> InvalidArgumentError | None:
        """Why ``message`` cannot land in ``recv`` (it then stays queued); None if it can."""
        problem = None
        if message.kind != recv.kind:
            problem = (
                f"a receive of kind {recv.kind.name.lower()} matched a message of kind "
                f"{message.kind.name.lower()}"
            )
        elif recv.out is not None and recv.out.dtype != message.dtype:
            problem = f"out is {recv.out.dtype}, the message is {message.dtype}"
        elif recv.out is not None and message.nbytes > recv.out.nbytes:
            problem = (
                f"the message of shape {message.shape} does not fit out of shape "
                f"{recv.out.shape} (truncation)"
            )
        if problem is None:
            return None
        source = recv.scope.members.index(message.peer)
        return InvalidArgumentError(
            f"{self._where(recv.scope, recv.what, message.seq)}: {problem} from rank {source}; "
            "the message stays queued",
            rank=recv.scope.rank,
            peer=source,
            collective=recv.what.partition("(")[0],
            seq=message.seq,
            job_id=self.job_id,
        )

    @staticmethod
    def _target(message: Message, recv: PostedRecv) -> tuple[np.ndarray, memoryview]:
        """The result array of ``recv`` for ``message``, and its bytes."""
        out = recv.out
        if out is None:
            result = np.empty(message.shape, message.dtype)
            return result, bytes_of(result)
        if out.shape == message.shape:
            return out, bytes_of(out)
        result = out.reshape(-1)[: message.nbytes // max(1, message.dtype.itemsize)]
        result = result.reshape(message.shape)
        return result, bytes_of(result)

    def _bind(self, comm: CommState, message: Message, recv: PostedRecv) -> None:
        """``recv`` takes ``message`` (checked already; out of every queue)."""
        recv.message = message
        if message.payload is not None:
            self._consumed(message)
            if recv.out is None or message.landed:
                recv.result = message.payload
            else:
                recv.result, target = self._target(message, recv)
                target[:] = bytes_of(message.payload)
            recv.done = True
            comm.recvs.discard(recv)
        elif message.local is not None:
            recv.result, target = self._target(message, recv)
            target[:] = message.local.data
            recv.done = True
            comm.recvs.discard(recv)
            assert message.self_send is not None
            message.self_send.done = True
            wake(message.self_send)
        else:
            message.recv = recv
            recv.need_cts = not message.rejected
        wake(recv)

    def _offer(self, comm: CommState, message: Message) -> None:
        """Give ``message`` (new, or put back) to the earliest posted receive that can take
        it; receives it does not fit raise; else queue it."""
        for recv in comm.posted_for(message):
            comm.unpost(recv)
            error = self._mismatch(message, recv)
            if error is None:
                self._bind(comm, message, recv)
                return
            comm.recvs.discard(recv)
            recv.error = error
            wake(recv)
        assert not message.landed, "a message read into a receive's out went unbound"
        comm.insert(message)

    def _rematch(self, comm: CommState, recv: PostedRecv) -> None:
        """``recv`` lost its message (withdrawn): match it again, or post it in its place."""
        message = comm.find(recv.source, recv.tag)
        if message is None:
            comm.post(recv)
            return
        error = self._mismatch(message, recv)
        if error is not None:
            comm.recvs.discard(recv)
            recv.error = error
            wake(recv)
            return
        comm.remove(message)
        self._bind(comm, message, recv)

    def _landing(self, message: Message) -> PostedRecv | None:
        """The receive with an ``out`` that ``message`` (an EAGER from a peer, not arrived
        yet) is bound to if it arrives now, where its payload may be read straight into;
        None if there is none (or it would raise: the message then arrives as usual)."""
        comm = self._comms.get(message.comm_id)
        if comm is None or comm.scope is None or message.peer not in comm.rank_of:
            return None
        posted = comm.posted_for(message)
        if not posted:
            return None
        recv = posted[0]  # the one _offer binds it to, if it fits
        return recv if recv.out is not None and self._mismatch(message, recv) is None else None

    def _arrive(self, message: Message) -> None:
        """A new message: adopt it into its communicator (made on the fly if unknown)."""
        if message.payload is not None:  # counted until received or dropped (_consumed)
            if message.peer == self.rank:
                self._self_buffered += message.cost
            else:
                self._peers[message.peer].buffered += message.cost
        comm = self._comms.get(message.comm_id)
        if comm is None:
            if message.comm_id in self._unregistered:
                self._drop(message)
                return
            comm = self._comms[message.comm_id] = CommState(None)
        elif comm.scope is not None and message.peer not in comm.rank_of:
            self._drop(message)
            raise ProtocolError(
                f"a message on comm id {message.comm_id:#x}, of which it is no member"
            )
        self._arrivals += 1
        message.arrival = self._arrivals
        message.seq = comm.seq_in(message.peer)
        if comm.scope is None:
            comm.insert(message)
        else:
            self._offer(comm, message)
