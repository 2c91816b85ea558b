"""Matching state of one communicator: messages that arrived before their receive
(unexpected), receives that wait for their message (posted), and the records of both.

Matching follows MPI's rules. Messages are told apart by (source, tag); a receive takes the
earliest unmatched message from its source (any member for ``source=None``) with its tag, by
arrival; an arriving message goes to the earliest posted receive that matches it. Invariant:
no posted receive matches a queued message, so each lookup is a single search.
"""

from __future__ import annotations

import bisect
from collections import deque
from typing import TYPE_CHECKING, final

import attrs
import trio

if TYPE_CHECKING:
    from collections.abc import Iterator

    import numpy as np

    from .._errors import TrioringError
    from ._frames import MessageKind


@final
@attrs.frozen
class Scope:
    """One communicator as the endpoint sees it.

    Attributes:
        comm_id: a 64-bit id, the same on every member, unique within the world.
        rank: this rank in the communicator.
        members: the world rank of each communicator rank.
        label: ``""`` for the world, else a name for messages (``"split #4 of world"``).
    """

    comm_id: int
    rank: int
    members: tuple[int, ...]
    label: str = ""


@final
class Message:
    """One inbound message, from the arrival of its EAGER or RTS frame until a receive has
    all of it (or it is withdrawn or dropped)."""

    __slots__ = (
        "address",
        "arrival",
        "comm_id",
        "committed",
        "cost",
        "cts_sent",
        "dropped",
        "dtype",
        "guard",
        "kind",
        "landed",
        "local",
        "msg_id",
        "nbytes",
        "payload",
        "peer",
        "received",
        "recv",
        "rejected",
        "self_send",
        "seq",
        "shape",
        "tag",
        "target",
        "unreadable",
    )

    def __init__(
        self,
        *,
        peer: int,
        comm_id: int,
        tag: int,
        kind: MessageKind,
        dtype: np.dtype[np.generic],
        shape: tuple[int, ...],
        nbytes: int,
        msg_id: int = 0,
        payload: np.ndarray | None = None,
        cost: int = 0,
        local: np.ndarray | None = None,
        self_send: SendWait | None = None,
    ) -> None:
        self.peer = peer  # world rank of the sender
        self.comm_id = comm_id
        self.tag = tag
        self.kind = kind
        self.dtype = dtype
        self.shape = shape
        self.nbytes = nbytes
        self.msg_id = msg_id
        #: Eager: the whole message, already of its dtype and shape.
        self.payload = payload
        #: Eager: the credit it holds (payload plus the fixed per-message overhead).
        self.cost = cost
        #: Eager: the payload was read straight into the ``out`` of the receive it arrives
        #: for (Reading._eager), so binding copies nothing.
        self.landed = False
        #: A large send to this very rank: the sender's bytes (flat uint8), copied by the
        #: receive that matches it; ``self_send`` is the waiting sender.
        self.local = local
        self.self_send = self_send
        #: Arrival order within the communicator, and sequence number from its source.
        self.arrival = 0
        self.seq = 0
        # Rendezvous from a peer: the receive it is bound to, where its DATA lands (flat
        # uint8), whether that receive's CTS went out, how much landed, whether a REJECT is
        # outstanding (DATA discarded until RESTART), and whether it is dropped for good.
        self.recv: PostedRecv | None = None
        self.target: memoryview | None = None
        self.cts_sent = False
        self.received = 0
        self.rejected = False
        self.dropped = False
        # Offered by cross-memory attach (RTS with addresses): where the message and its
        # guard are in the sender's memory, whether its PULL came (the copy may be kept),
        # and whether the copy failed because the sender's memory was gone.
        self.address = 0
        self.guard = 0
        self.committed = False
        self.unreadable = False


@final
class PostedRecv:
    """One receive call, from its start to its return: posted, or bound to a message."""

    __slots__ = (
        "done",
        "error",
        "kind",
        "message",
        "need_cts",
        "order",
        "out",
        "polled",
        "result",
        "scope",
        "source",
        "tag",
        "task",
        "what",
    )

    def __init__(
        self,
        *,
        scope: Scope,
        source: int | None,
        tag: int,
        kind: MessageKind,
        out: np.ndarray | None,
        order: int,
        what: str,
    ) -> None:
        self.scope = scope
        self.source = source  # world rank, or None for any member
        self.tag = tag
        self.kind = kind
        self.out = out
        self.order = order  # posting order within the communicator
        self.what = what  # "recv(source=0, tag=7)", for messages
        #: The parked task, while it waits in the event loop; None otherwise.
        self.task: trio.lowlevel.Task | None = None
        self.message: Message | None = None
        #: Set by whoever bound a rendezvous message to this receive: its task must send CTS.
        self.need_cts = False
        self.done = False
        #: Whether its task polled already (it does once, before it first parks).
        self.polled = False
        self.result: np.ndarray | None = None
        self.error: TrioringError | None = None


@final
class SendWait:
    """A send that waits for its receiver (a rendezvous, or a large send to oneself)."""

    __slots__ = (
        "abortable",
        "cts",
        "done",
        "error",
        "msg_id",
        "peer",
        "rejected",
        "scope",
        "seq",
        "task",
        "what",
    )

    def __init__(self, *, scope: Scope, peer: int, msg_id: int, what: str) -> None:
        self.scope = scope
        self.peer = peer
        self.msg_id = msg_id
        self.what = what
        self.seq: int | None = None
        self.task: trio.lowlevel.Task | None = None
        #: Whether a cancellation may interrupt the current wait (not while waiting for DONE).
        self.abortable = True
        self.cts = False
        self.done = False
        self.rejected = False
        self.error: TrioringError | None = None


def wake(waiter: PostedRecv | SendWait) -> None:
    """Reschedule ``waiter``'s task if it is parked; it then looks at its flags."""
    task = waiter.task
    if task is not None:
        waiter.task = None
        trio.lowlevel.reschedule(task)


@final
class CommState:
    """The matching state of one communicator id (``scope`` is None until registered)."""

    def __init__(self, scope: Scope | None) -> None:
        self.scope: Scope | None = None
        self.rank_of: dict[int, int] = {}
        # tag -> source world rank -> messages in arrival order.
        self._queued: dict[int, dict[int, deque[Message]]] = {}
        # tag -> posted receives in posting order.
        self._posted: dict[int, list[PostedRecv]] = {}
        #: Every receive and send of this communicator that has not returned.
        self.recvs: set[PostedRecv] = set()
        self.sends: set[SendWait] = set()
        self._seq_in: dict[int, int] = {}
        self._seq_out: dict[int, int] = {}
        self._order = 0
        if scope is not None:
            self.adopt(scope)

    def adopt(self, scope: Scope) -> None:
        self.scope = scope
        self.rank_of = {world: rank for rank, world in enumerate(scope.members)}

    def next_order(self) -> int:
        self._order += 1
        return self._order

    def seq_in(self, peer: int) -> int:
        """The sequence number of the next message from world rank ``peer`` (from 1)."""
        seq = self._seq_in.get(peer, 0) + 1
        self._seq_in[peer] = seq
        return seq

    def seq_out(self, peer: int) -> int:
        """The sequence number of the next message to world rank ``peer`` (from 1)."""
        seq = self._seq_out.get(peer, 0) + 1
        self._seq_out[peer] = seq
        return seq

    # -- unexpected messages ---------------------------------------------------------------

    def find(self, source: int | None, tag: int) -> Message | None:
        """The earliest queued message from ``source`` (None: any) with ``tag``."""
        by_source = self._queued.get(tag)
        if not by_source:
            return None
        if source is not None:
            queue = by_source.get(source)
            return queue[0] if queue else None
        heads = [queue[0] for queue in by_source.values() if queue]
        return min(heads, key=lambda m: m.arrival) if heads else None

    def insert(self, message: Message) -> None:
        """Queue ``message`` at its arrival position (the tail, except for one put back)."""
        queue = self._queued.setdefault(message.tag, {}).setdefault(message.peer, deque())
        if not queue or queue[-1].arrival < message.arrival:
            queue.append(message)
        else:
            index = bisect.bisect([m.arrival for m in queue], message.arrival)
            queue.insert(index, message)

    def remove(self, message: Message) -> bool:
        """Take ``message`` out of the queue; False if it was not queued."""
        by_source = self._queued.get(message.tag)
        queue = by_source.get(message.peer) if by_source else None
        if not queue:
            return False
        if queue[0] is message:
            queue.popleft()
        else:
            try:
                queue.remove(message)
            except ValueError:
                return False
        return True

    def queued(self) -> Iterator[Message]:
        for by_source in self._queued.values():
            for queue in by_source.values():
                yield from queue

    def clear_queued(self) -> list[Message]:
        messages = list(self.queued())
        self._queued.clear()
        return messages

    # -- posted receives -------------------------------------------------------------------

    def post(self, recv: PostedRecv) -> None:
        """Post ``recv`` at its posting position (the tail, except for one put back)."""
        posted = self._posted.setdefault(recv.tag, [])
        if not posted or posted[-1].order < recv.order:
            posted.append(recv)
        else:
            posted.insert(bisect.bisect([r.order for r in posted], recv.order), recv)

    def unpost(self, recv: PostedRecv) -> bool:
        posted = self._posted.get(recv.tag)
        if posted and recv in posted:
            posted.remove(recv)
            return True
        return False

    def posted_for(self, message: Message) -> list[PostedRecv]:
        """The posted receives that match ``message``, earliest first."""
        posted = self._posted.get(message.tag, ())
        return [r for r in posted if r.source is None or r.source == message.peer]
