"""Point-to-point messages: send, recv, recv_any, sendrecv, send_object and recv_object. The
protocol (eager and rendezvous, flow control, cancellation) is :mod:`trioring._p2p`'s; this
layer checks the arguments, names the calls and keeps the communicator's state rules."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from .. import _objects
from .._concurrency import run_concurrently
from .._core import CommunicatorCore, State
from .._errors import InvalidArgumentError, ProtocolError
from .._p2p import TAG_BOUND, MessageKind

__all__ = ["PointToPointMethods"]

if TYPE_CHECKING:
    from .._p2p import Endpoint


class PointToPointMethods(CommunicatorCore):
    """Mixed into :class:`trioring.Communicator`.

    **Point-to-point semantics** (all six methods). Any number of tasks may send and receive
    at once on one communicator, also while a collective runs on it in another task: messages
    and collectives travel on different connections and never wait for each other (nor does
    the busy rule of collectives apply). Messages from one rank to another with one tag are
    *non-overtaking*: a receive matches the earliest message of its source and tag that no
    other receive took (sends of one task are ordered; concurrent sends from different tasks
    are not ordered with each other). A receive may be posted before or after the send.
    ``dtype`` and shape travel with the message. Tags are ints with ``0 <= tag < 2**31``
    (``trioring.TAG_BOUND``); sending to oneself works.

    *Small messages* (up to 1 MiB) are sent eagerly and buffered by the receiver if no
    receive is waiting, within a window of credit per pair of ranks (4 MiB); *large ones*, or
    small ones beyond the window, wait for the matching receive (rendezvous) and then go
    straight from the sender's array into the receiver's, never buffered in between. So the
    memory a receiver spends on messages it has not asked for is bounded, whatever senders do.
    On one host (x86-64), where the world's ranks agreed on cross-memory attach (``"cma"``
    in :attr:`features` of the world communicator), the receiver copies a large message out
    of the sender's memory itself, once, instead of through the socket; the sender's array
    must stay unchanged until ``send`` returns, as always.

    *Cancellation* leaves no half-delivered message: a cancelled receive consumed nothing (a
    message it had begun to receive goes back to the head of its queue, whole, for the next
    receive; ``out`` may have been partly overwritten); a cancelled send either delivered
    its message whole or not at all (a small one is delivered once it is written; a large
    one is withdrawn unless all of it has arrived). Neither breaks the communicator.

    *Failure*: a peer that dies makes every pending and later send to it and receive from
    it raise :class:`~trioring.PeerFailedError` naming it, on every communicator, and so does
    a pending ``recv_any`` of a communicator it belongs to. A peer that closes this
    communicator (or whose copy of it broke) tells the others first: sends to it and
    receives from it on this communicator raise :class:`~trioring.PeerFailedError`, and a
    ``recv_any`` raises only once every other member has gone. Messages that had arrived
    whole before can still be received. Closing the communicator here makes pending calls
    raise :class:`~trioring.CommunicatorClosedError`; a broken communicator (a collective
    failed) refuses them with :class:`~trioring.CommunicatorBrokenError`.
    """

    @property
    def _endpoint(self) -> Endpoint:
        return self._family.endpoint

    def _p2p_invalid(self, what: str, message: str) -> InvalidArgumentError:
        return InvalidArgumentError(
            f"rank {self._rank}: {what}: {message}",
            rank=self._rank,
            job_id=self._job_id,
            collective=what.partition("(")[0],
        )

    def _checked_rank(self, what: str, name: str, value: object) -> int:
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise self._p2p_invalid(what, f"{name} must be an int, got {type(value).__name__}")
        value = int(value)
        if not 0 <= value < self._world_size:
            raise self._p2p_invalid(
                what,
                f"{name}={value} is not a rank of this communicator (0..{self._world_size - 1})",
            )
        return value

    def _usual(self, rank: object, tag: object) -> bool:
        """Whether a call to ``rank`` (or from it) with ``tag`` needs no closer look: the
        communicator is open and both are plain ints in range. Then the call's text, which
        only an error shows, is not made: with it and the full checks, the way from
        :meth:`send` into the endpoint took 14 us of the 76 that sending 8 bytes took at
        world 2 on 2 vCPUs (bench/p2p.py's loop, timed in place)."""
        return (
            self._state is State.OPEN
            and type(rank) is int
            and 0 <= rank < self._world_size
            and type(tag) is int
            and 0 <= tag < TAG_BOUND
        )

    def _checked_tag(self, what: str, tag: object) -> int:
        if isinstance(tag, bool) or not isinstance(tag, (int, np.integer)):
            raise self._p2p_invalid(what, f"tag must be an int, got {type(tag).__name__}")
        tag = int(tag)
        if not 0 <= tag < TAG_BOUND:
            raise self._p2p_invalid(what, f"tag={tag} is outside 0 <= tag < 2**31")
        return tag

    async def send(self, array: np.ndarray[Any, Any], *, dest: int, tag: int = 0) -> None:
        """Send ``array`` (any shape, a supported dtype, C-contiguous; only read) to rank
        ``dest``, with ``tag``. Returns once the message is on its way: a small one written
        to the connection, a large one received whole by ``dest`` (which must post a
        matching receive). The caller may reuse ``array`` at once. See the class
        docstring for ordering, flow control, cancellation and failure.

        Raises:
            InvalidArgumentError: bad array, ``dest`` or ``tag`` (before any I/O).
            PeerFailedError: ``dest`` died or closed its communicator.
            CommunicatorClosedError, CommunicatorBrokenError: see the class docstring.
        """
        if not self._usual(dest, tag):
            what = f"send(dest={dest}, tag={tag})"
            self._check_open_for_messages(what)
            dest = self._checked_rank(what, "dest", dest)
            tag = self._checked_tag(what, tag)
        await self._endpoint.send(self._scope, dest, tag, array)

    async def recv(
        self, *, source: int, tag: int = 0, out: np.ndarray[Any, Any] | None = None
    ) -> np.ndarray[Any, Any]:
        """Receive the next message from rank ``source`` with ``tag``.

        Returns a new array of the sender's dtype and shape; or, with ``out`` (C-contiguous,
        writable, of the message's dtype and at least its element count), ``out`` itself when
        the shapes agree, else the view of its first elements in the sender's shape. A
        message that does not fit ``out`` (more elements, or another dtype) raises
        :class:`~trioring.InvalidArgumentError` before any byte lands and **stays queued**:
        receive it again with a suitable buffer.

        Raises:
            InvalidArgumentError: bad ``source``, ``tag`` or ``out``, or a message that does
                not fit ``out``, or a message sent by :meth:`send_object`.
            PeerFailedError: ``source`` died or closed its communicator.
            CommunicatorClosedError, CommunicatorBrokenError: see the class docstring.
        """
        if not self._usual(source, tag):
            what = f"recv(source={source}, tag={tag})"
            self._check_open_for_messages(what)
            source = self._checked_rank(what, "source", source)
            tag = self._checked_tag(what, tag)
        _, array = await self._endpoint.recv(self._scope, source, tag, out)
        return array

    async def recv_any(
        self, *, tag: int = 0, out: np.ndarray[Any, Any] | None = None
    ) -> tuple[int, np.ndarray[Any, Any]]:
        """Receive the next message with ``tag`` from whichever rank's arrives first (MPI's
        ``MPI_ANY_SOURCE``); returns ``(source, array)``. ``out`` as in :meth:`recv`. A
        member's death makes a pending ``recv_any`` raise :class:`~trioring.PeerFailedError`
        (its message might have been the one to come); a member that closed the
        communicator only counts once every other member has too."""
        what = f"recv_any(tag={tag})"
        self._check_open_for_messages(what)
        tag = self._checked_tag(what, tag)
        return await self._endpoint.recv(self._scope, None, tag, out)

    async def sendrecv(
        self,
        array: np.ndarray[Any, Any],
        *,
        dest: int,
        source: int,
        sendtag: int = 0,
        recvtag: int | None = None,
        out: np.ndarray[Any, Any] | None = None,
    ) -> np.ndarray[Any, Any]:
        """Send ``array`` to ``dest`` and receive from ``source`` at the same time (two
        tasks), returning what was received (as :meth:`recv`). Since both directions run at
        once, a ring or any pattern of pairwise exchanges never deadlocks, however large the
        arrays and however little the connections buffer. ``recvtag`` defaults to
        ``sendtag``. If either half fails the other is cancelled and the error raised."""
        what = f"sendrecv(dest={dest}, source={source})"
        self._check_open_for_messages(what)
        dest = self._checked_rank(what, "dest", dest)
        source = self._checked_rank(what, "source", source)
        sendtag = self._checked_tag(what, sendtag)
        recvtag = sendtag if recvtag is None else self._checked_tag(what, recvtag)
        received: list[np.ndarray[Any, Any]] = []

        async def send() -> None:
            await self._endpoint.send(self._scope, dest, sendtag, array)

        async def receive() -> None:
            _, got = await self._endpoint.recv(self._scope, source, recvtag, out)
            received.append(got)

        await run_concurrently(send, receive)
        return received[0]

    async def send_object(self, obj: object, *, dest: int, tag: int = 0) -> None:
        """Send a Python object to ``dest``, encoded by the same safe codec as
        :meth:`broadcast_object` (no pickle: plain data and numpy arrays only; anything else
        raises :class:`~trioring.InvalidArgumentError` naming the value's type and where it
        is in ``obj``, before any I/O). Otherwise as :meth:`send`; a receive by
        :meth:`recv` (arrays) does not match it but raises, leaving it queued."""
        what = f"send_object(dest={dest}, tag={tag})"
        self._check_open_for_messages(what)
        dest = self._checked_rank(what, "dest", dest)
        tag = self._checked_tag(what, tag)
        try:
            encoded = _objects.encode_array(obj)
        except InvalidArgumentError as exc:
            raise self._p2p_invalid(what, str(exc)) from None
        await self._endpoint.send(self._scope, dest, tag, encoded, kind=MessageKind.OBJECT)

    async def recv_object(self, *, source: int, tag: int = 0) -> Any:
        """Receive an object that ``source`` sent by :meth:`send_object` with ``tag``.
        Decoding is bounded (depth, element count, size; see the objects how-to) and never
        runs code: bytes that are not a valid encoding raise :class:`~trioring.ProtocolError`
        naming ``source`` (the message is consumed; the communicator stays usable)."""
        what = f"recv_object(source={source}, tag={tag})"
        self._check_open_for_messages(what)
        source = self._checked_rank(what, "source", source)
        tag = self._checked_tag(what, tag)
        _, encoded = await self._endpoint.recv(
            self._scope, source, tag, None, kind=MessageKind.OBJECT
        )
        return self._decoded_message("recv_object", what, source, encoded)

    async def recv_any_object(self, *, tag: int = 0) -> tuple[int, Any]:
        """Receive the next object sent by :meth:`send_object` with ``tag`` from whichever
        rank's arrives first; returns ``(source, obj)``. mpi4py's ``recv(source=ANY_SOURCE)``
        without pickle: what a coordinator that hands out work to whichever worker reports
        first needs. Ordered per source, a member's death and closes as for
        :meth:`recv_any`; decoding as for :meth:`recv_object`. An array message (sent by
        :meth:`send`) that comes first with ``tag`` raises
        :class:`~trioring.InvalidArgumentError` and stays queued, as for :meth:`recv`."""
        what = f"recv_any_object(tag={tag})"
        self._check_open_for_messages(what)
        tag = self._checked_tag(what, tag)
        source, encoded = await self._endpoint.recv(
            self._scope, None, tag, None, kind=MessageKind.OBJECT
        )
        return source, self._decoded_message("recv_any_object", what, source, encoded)

    def _decoded_message(
        self, method: str, what: str, source: int, encoded: np.ndarray[Any, Any]
    ) -> Any:
        """The object in a message from ``source`` that ``method`` (called as ``what``)
        received; ProtocolError naming ``source`` if its bytes are not an encoding (the
        message is consumed; the communicator stays usable)."""
        try:
            return _objects.decode(encoded)
        except ProtocolError as exc:
            raise ProtocolError(
                f"rank {self._rank}: {what}: the message from rank {source} is not an object "
                f"encoding: {exc}",
                rank=self._rank,
                peer=source,
                collective=method,
                job_id=self._job_id,
            ) from None
