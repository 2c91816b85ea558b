"""One peer as the endpoint sees it: its connection, write lock, credit and the messages in
flight both ways; and the buffered reader of its frames."""

from __future__ import annotations

from typing import TYPE_CHECKING, final

import trio

from ..transports._socket import UNREACHABLE_ERRNOS, SocketConnection

if TYPE_CHECKING:
    from .._errors import TrioringError
    from ..transports import Connection
    from ._matching import Message, SendWait

#: Frames with up to this many bytes after their header (64 KiB of payload and the largest
#: shape) are read whole into the reader's buffer, or taken whole by a waiting receive
#: (Polling._take_waiting); larger payloads land straight in their target (see read_into),
#: or a waiting receive reads them there once they wait whole (Polling._take_large).
READ_WHOLE_BYTES = 64 * 1024 + 512
#: What the reader asks the connection for at once (a whole frame of READ_WHOLE_BYTES and
#: more): a header and a small payload usually arrive in one read.
READ_BYTES = 96 * 1024
#: Reads in a row that find bytes waiting, after which the reader passes through the
#: scheduler anyway, so that a peer that keeps the socket full cannot hold the thread: a
#: few MiB at most (each read takes what the socket holds), or dozens of small frames.
_READS_PER_YIELD = 16

_LOST = "its connection ended: the peer exited, crashed or closed its communicator"


def lost(exc: BaseException) -> str:
    """What a broken connection says about its peer. A timeout (the kernel's, or the
    transport's TRIORING_PEER_TIMEOUT) means that the peer's host went silent, not that the
    peer exited: say so, as the collectives do (_link_errors)."""
    cause = exc.__cause__
    if isinstance(cause, OSError) and cause.errno in UNREACHABLE_ERRNOS:
        return (
            f"it became unreachable ({exc}): its host crashed or lost its network, or the "
            "network drops its packets"
        )
    return f"{_LOST} ({exc})" if str(exc) else _LOST


@final
class Peer:
    """The state shared by the tasks that talk to one peer (world rank ``world``)."""

    def __init__(self, world: int, connection: Connection, window: int) -> None:
        self.world = world
        self.connection = connection
        #: The connection when it is a socket, whose synchronous calls write a frame that
        #: fits its buffer without a pass through the scheduler (see Engine._write_locked).
        self.fast = connection if isinstance(connection, SocketConnection) else None
        #: The peer's pid (from the kernel) when every pair of ranks agreed on cross-memory
        #: attach at opening: rendezvous messages between us then go by cross-memory attach
        #: (an RTS with addresses, then PULL), not DATA.
        self.pid: int | None = None
        #: One frame at a time on the connection; FIFO, so that concurrent sends' chunks
        #: interleave fairly.
        self.lock = trio.StrictFIFOLock()
        #: Eager credit we hold: bytes (payload + overhead) we may still send eagerly.
        self.credit = window
        #: Eager bytes received from the peer and not yet credited back; never above the
        #: window (a peer that overruns it is broken).
        self.held = 0
        #: Of those, the bytes of messages still queued (nobody received them yet).
        self.buffered = 0
        #: Consumed and to be given back with the next frame we write, or in a CREDIT frame
        #: once half the window is owed.
        self.owed = 0
        #: Control frames queued by synchronous code (a cancelled call's REJECT, say); the
        #: next task that writes sends them first, and the queuer writes them itself if it
        #: can.
        self.outbox: list[bytes] = []
        self.next_msg_id = 1
        #: Our rendezvous sends to the peer, by message id.
        self.outbound: dict[int, SendWait] = {}
        #: The peer's rendezvous messages to us that are not complete, by message id.
        self.inbound: dict[int, Message] = {}
        #: Set once the connection ended or the peer broke the protocol; every later call
        #: involving the peer raises this (rewritten for the call).
        self.error: TrioringError | None = None
        #: What happened, for the messages of the calls it fails.
        self.detail = ""
        #: The reader's cancel scope: cancelled to stop reading a peer that broke the rules,
        #: or given a deadline once a write to the peer failed (see Engine._link_down).
        self.reader_scope = trio.CancelScope()
        #: Set once the reader has ended and closed the connection.
        self.reader_ended = trio.Event()
        #: A write found the connection gone: the reader reads on to its end, then fails
        #: the calls that still wait on the peer (see Engine._link_down).
        self.draining = False
        #: The bytes that a poll last saw waiting on the socket while a large EAGER frame
        #: streamed in (Polling._take_large); 0 otherwise.
        self.seen_waiting = 0
        #: The connection's reader (the reader task's; see FrameReader.idle).
        self.reader = FrameReader(connection)

    def take_id(self) -> int:
        msg_id = self.next_msg_id
        self.next_msg_id += 1
        return msg_id

    async def acquire(self, *, shielded: bool = False) -> bool:
        """Take :attr:`lock` at once if it is free (as it usually is: Trio's acquire passes
        through the scheduler even then, 22 us of a 135 us eager send at world 2 on 2
        vCPUs), else wait for it. For a frame that the caller's cancellation may still stop,
        raises Cancelled if the task is cancelled and waits cancellably; ``shielded`` (a
        frame that must go out) neither. Returns whether it passed through the scheduler."""
        if not shielded:
            await trio.lowlevel.checkpoint_if_cancelled()
        try:
            self.lock.acquire_nowait()
        except trio.WouldBlock:
            with trio.CancelScope(shield=shielded):
                await self.lock.acquire()
            return True
        return False


@final
class FrameReader:
    """Reads one connection: whole frame parts on demand, payloads straight into targets.

    Never reads past what it is asked for by more than its buffer, so that bytes of a large
    DATA payload go to their target with one copy (kernel to user)."""

    def __init__(self, connection: Connection) -> None:
        self._connection = connection
        self._fast = connection if isinstance(connection, SocketConnection) else None
        self._buffer = bytearray(READ_BYTES)
        self._view = memoryview(self._buffer)
        self._start = 0
        self._end = 0
        #: True while the reader waits for the next frame with nothing of it read: only
        #: then may a waiting receive take whole frames off the socket itself (see
        #: Polling._take_waiting); at any other time the socket's next bytes continue a
        #: frame that the reader has begun.
        self.idle = False
        #: Reads that found bytes waiting since the last pass through the scheduler.
        self._unyielded = 0

    async def _receive(self, into: memoryview, *, idle: bool = False) -> int:
        fast = self._fast
        got: int | None
        if fast is None:
            got = await self._connection.recv_into(into)
        else:
            # What is there already is taken without a pass through the scheduler, and the
            # reader parks only when nothing is: the socket's own recv_into passes through
            # it on every read (with the writer's passes, see Engine._write_locked, they
            # made an 8-byte message take 235-250 us one way at world 2 on 2 vCPUs; 165-185
            # without, bench/p2p.py).
            got = fast.recv_nowait(into)
            if got is None:
                self._unyielded = 0
                self.idle = idle
                try:
                    while got is None:
                        await fast.wait_readable(check_peer=True)
                        got = fast.recv_nowait(into)
                finally:
                    self.idle = False
            else:
                self._unyielded += 1
                if self._unyielded >= _READS_PER_YIELD:
                    # A peer that keeps the socket full must not keep this task from
                    # letting the others run (the receives it wakes among them).
                    self._unyielded = 0
                    await trio.lowlevel.checkpoint()
        if not got:
            raise EOFError
        return got

    async def read_header(self, nbytes: int) -> memoryview:
        """:meth:`read` the ``nbytes`` of the next frame's header, :attr:`idle` while nothing
        of it has come."""
        return await self.read(nbytes, idle=True)

    async def read(self, nbytes: int, *, idle: bool = False) -> memoryview:
        """The next ``nbytes`` (at most the buffer's size); valid until the next read."""
        if self._end - self._start < nbytes:
            if self._start + nbytes > len(self._buffer):
                have = self._end - self._start
                self._view[:have] = self._view[self._start : self._end]
                self._start, self._end = 0, have
            while self._end - self._start < nbytes:
                self._end += await self._receive(
                    self._view[self._end :], idle=idle and self._end == self._start
                )
        view = self._view[self._start : self._start + nbytes]
        self._start += nbytes
        if self._start == self._end:
            self._start = self._end = 0
        return view

    async def read_into(self, target: memoryview) -> None:
        """Fill ``target`` with the next bytes: first what is buffered, then straight from
        the connection."""
        have = min(self._end - self._start, target.nbytes)
        if have:
            target[:have] = self._view[self._start : self._start + have]
            self._start += have
            if self._start == self._end:
                self._start = self._end = 0
        position = have
        while position < target.nbytes:
            position += await self._receive(target[position:])

    async def skip(self, nbytes: int) -> None:
        """Read and discard ``nbytes``."""
        while nbytes:
            step = min(nbytes, len(self._buffer))
            await self.read(step)
            nbytes -= step
