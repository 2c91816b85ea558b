"""The transport contract: bytes between two ranks, nothing about collectives."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar, TypeAlias

import attrs
import trio

__all__ = ["BytesLike", "Connection", "Listener", "Transport", "TransportContext"]

#: What :meth:`Connection.send_all` accepts.
BytesLike: TypeAlias = bytes | bytearray | memoryview

#: Seconds of silence from a peer's host after which its connection fails, unless
#: ``TRIORING_PEER_TIMEOUT`` says otherwise (see :attr:`TransportContext.peer_timeout`).
DEFAULT_PEER_TIMEOUT = 30.0


@attrs.frozen(kw_only=True)
class TransportContext:
    """What a transport is told about the rank it serves.

    Attributes:
        rank: this process's rank.
        world_size: the number of ranks.
        host: the local address at which other ranks can reach this one (for TCP, the
            interface this rank used to reach the rendezvous; ``"127.0.0.1"`` when all ranks
            share one host).
        socket_dir: a directory shared by all ranks of the job for socket files, or ``None``
            when the transport should make a private one.
        peer_timeout: after how many seconds without an answer from a peer's host (it
            crashed, lost its network, or a partition drops its packets) a connection should
            fail, and a connect give up; ``None`` leaves it to the operating system, which
            may wait for ever. A peer that is alive but slow, or stopped, must never count as
            gone. ``TRIORING_PEER_TIMEOUT`` sets it; transports whose kernel reports a dead
            peer at once (Unix sockets, memory) ignore it.
    """

    rank: int
    world_size: int
    host: str = "127.0.0.1"
    socket_dir: str | None = None
    peer_timeout: float | None = DEFAULT_PEER_TIMEOUT


class Connection(trio.abc.AsyncResource):
    """A reliable, ordered, full-duplex byte stream to one peer.

    Contract for implementations:

    * **Ordering:** bytes arrive in the order they were sent, without loss or duplication,
      or the connection fails.
    * **Concurrency:** at most one task sends and at most one task receives at any moment;
      one sending task and one receiving task may run at the same time (full duplex).
      Callers guarantee this; implementations need not detect violations.
    * **Errors:** when the peer or the network breaks the connection, :meth:`send_all` and
      :meth:`recv_into` raise :class:`trio.BrokenResourceError` (with the ``OSError`` as
      ``__cause__``), never a bare ``OSError``. After :meth:`aclose` on this side they raise
      :class:`trio.ClosedResourceError`, and so does a call that was blocked when another task
      closed the connection.
    * **Cancellation:** both methods are checkpoints. If :meth:`send_all` is cancelled, it may
      have sent some, all or none of the data, and the caller must treat the connection as
      unusable for further sends. A cancelled :meth:`recv_into` may have received some bytes
      into the buffer; the count is lost, so the caller must stop receiving too.
    """

    @abstractmethod
    async def send_all(self, *buffers: BytesLike) -> None:
        """Send the concatenation of ``buffers``, returning when all of it has been handed
        to the transport (not necessarily received). Buffers are read, never kept, and may
        be reused once this returns. Zero-length buffers are allowed."""

    @abstractmethod
    async def recv_into(self, buffer: memoryview) -> int:
        """Receive at least one and at most ``len(buffer)`` bytes into ``buffer`` (a writable,
        C-contiguous byte memoryview) and return how many. Returns 0 only at end of file, that
        is when the peer closed its side cleanly. ``buffer`` must not be empty."""

    @abstractmethod
    async def aclose(self) -> None:
        """Close the connection. Idempotent; closes the underlying resource even when
        cancelled, and wakes any task blocked on this connection with
        :class:`trio.ClosedResourceError`."""

    @property
    def local_host(self) -> str | None:
        """The local network address of this connection, if it has one. The rendezvous uses it
        to learn which interface other ranks can reach this rank on."""
        return None


class Listener(trio.abc.AsyncResource):
    """Accepts connections at :attr:`address`."""

    @property
    @abstractmethod
    def address(self) -> str:
        """The address peers pass to :meth:`Transport.connect` to reach this listener. It is
        published to the other ranks during rendezvous, so it must make sense to them."""

    @abstractmethod
    async def accept(self) -> Connection:
        """Wait for the next incoming connection. Raises :class:`trio.ClosedResourceError`
        after :meth:`aclose`. Transient errors (a client that reset before it was accepted)
        are retried, not raised."""

    @abstractmethod
    async def aclose(self) -> None:
        """Stop listening and release the address (remove a socket file, for instance).
        Idempotent. Connections already accepted stay open."""


class Transport(ABC):
    """A way to move bytes between ranks: a :class:`Listener` factory and a connector.

    A transport is instantiated once per communicator with a :class:`TransportContext`.
    It knows bytes and peers, never collectives: framing, sequencing and error reporting are
    the communicator's job.

    To publish a transport from another package, subclass this, set :attr:`name`, and declare
    an entry point in the ``trioring.transports`` group::

        [project.entry-points."trioring.transports"]
        mytransport = "mypackage.transport:MyTransport"

    ``trioring.open_communicator(transport="mytransport")`` (or
    ``TRIORING_TRANSPORT=mytransport``) then finds it. Rendezvous for third-party transports
    goes through TCP at ``MASTER_ADDR:MASTER_PORT``; only data connections use the plugin.
    """

    #: The registered name (``"tcp"``, ``"unix"``, ...).
    name: ClassVar[str]
    #: One line for the capability table.
    description: ClassVar[str] = ""

    def __init__(self, context: TransportContext) -> None:
        self.context = context

    @classmethod
    def unavailable_reason(cls) -> str | None:
        """Return ``None`` when this transport can run on this machine, or a sentence saying
        why not (``"AF_UNIX sockets are not supported on this platform"``). Must be cheap and
        must not do I/O: it is called to build :func:`trioring.capabilities`."""
        return None

    def close(self) -> None:  # noqa: B027 - an optional hook, not an abstract method
        """Release what the transport itself holds (a private socket directory, say). Called
        once when the communicator closes, after every connection and listener is closed.
        The default does nothing."""

    @abstractmethod
    async def listen(self, address: str | None = None) -> Listener:
        """Start listening. ``address=None`` means: pick an address that the other ranks of
        this job can reach (using :attr:`context`). Raises ``OSError`` if the address cannot be
        bound."""

    @abstractmethod
    async def connect(self, address: str) -> Connection:
        """Connect to a listener's :attr:`Listener.address`. Raises ``OSError`` (for example
        ``ConnectionRefusedError`` or ``FileNotFoundError``) when nothing listens there yet, so
        that callers waiting for a peer to start can retry."""
