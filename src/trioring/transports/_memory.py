"""In-memory transport: ranks are tasks inside one ``trio.run`` (used by trioring.testing)."""

from __future__ import annotations

import itertools
import math
from typing import TYPE_CHECKING, final

import trio

from ._abc import BytesLike, Connection, Listener, Transport, TransportContext

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = ["MemoryTransport", "StreamConnection"]

#: Buffers of one send_all up to this size in all are joined into one send (see send_all).
_JOIN_BYTES = 64 * 1024


@final
class StreamConnection(Connection):
    """Adapts any :class:`trio.abc.Stream` to :class:`Connection` (copies on receive)."""

    def __init__(self, stream: trio.abc.Stream) -> None:
        self._stream = stream

    async def send_all(self, *buffers: BytesLike) -> None:
        views = [memoryview(b).cast("B") for b in buffers]
        views = [view for view in views if view.nbytes]
        if not views:
            await trio.lowlevel.checkpoint()
            return
        if len(views) > 1 and sum(view.nbytes for view in views) <= _JOIN_BYTES:
            # One send, as a socket's sendmsg does with a small frame: a cancellation then
            # leaves all of it or none of it sent, never a header without its payload. (Sent
            # piece by piece, a cancelled sender left its peer a header without payload, so
            # the peer saw a lost connection where the sender's abort frame would have
            # named the real cause: 1 world in 300 of the 9-rank mismatch tests.)
            views = [memoryview(b"".join(views))]
        for view in views:
            await self._stream.send_all(view)

    async def recv_into(self, buffer: memoryview) -> int:
        data = await self._stream.receive_some(buffer.nbytes)
        buffer[: len(data)] = data
        return len(data)

    async def aclose(self) -> None:
        await trio.aclose_forcefully(self._stream)


@final
class _MemoryListener(Listener):
    def __init__(self, network: dict[str, _MemoryListener], address: str) -> None:
        self._network = network
        self._address = address
        self._send, self._receive = trio.open_memory_channel[Connection](math.inf)

    @property
    def address(self) -> str:
        return self._address

    def deliver(self, connection: Connection) -> None:
        try:
            self._send.send_nowait(connection)
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            raise ConnectionRefusedError(f"nothing listens at {self._address!r}") from None

    async def accept(self) -> Connection:
        try:
            return await self._receive.receive()
        except trio.EndOfChannel:  # pragma: no cover - we close the receiving side only
            raise trio.ClosedResourceError("listener was closed") from None

    async def aclose(self) -> None:
        if self._network.get(self._address) is self:
            del self._network[self._address]
        self._send.close()
        self._receive.close()
        await trio.lowlevel.checkpoint()


# One address space per trio.run, so tests running in parallel runs never see each other.
_NETWORK: trio.lowlevel.RunVar[dict[str, _MemoryListener]] = trio.lowlevel.RunVar(
    "trioring_memory_network"
)
_COUNTER = itertools.count()


def _network() -> dict[str, _MemoryListener]:
    try:
        return _NETWORK.get()
    except LookupError:
        network: dict[str, _MemoryListener] = {}
        _NETWORK.set(network)
        return network


@final
class MemoryTransport(Transport):
    """Connects tasks of one ``trio.run`` through in-memory streams.

    Addresses are plain names, private to the current ``trio.run``. By default the streams
    buffer without limit (:func:`trio.testing.memory_stream_pair`); pass
    ``stream_pair=trio.testing.lockstep_stream_pair`` for streams with no buffer at all, where
    every send waits for a matching receive, so that any algorithm that sends before it
    receives deadlocks at once instead of only under load.
    """

    name = "memory"
    description = "in-process streams for tests and examples (one trio.run)"

    def __init__(
        self,
        context: TransportContext,
        *,
        stream_pair: Callable[[], tuple[trio.abc.Stream, trio.abc.Stream]] | None = None,
    ) -> None:
        super().__init__(context)
        if stream_pair is None:
            # Here, not at the top: trio.testing imports pytest where it is installed, which
            # made `import trioring` take 0.13 s longer (of 0.5) in every process.
            import trio.testing

            stream_pair = trio.testing.memory_stream_pair
        self._stream_pair = stream_pair

    async def listen(self, address: str | None = None) -> Listener:
        network = _network()
        if address is None:
            address = f"memory-{self.context.rank}-{next(_COUNTER)}"
        if address in network:
            raise OSError(f"address {address!r} is already in use")
        listener = _MemoryListener(network, address)
        network[address] = listener
        await trio.lowlevel.checkpoint()
        return listener

    async def connect(self, address: str) -> Connection:
        await trio.lowlevel.checkpoint()
        listener = _network().get(address)
        if listener is None:
            raise ConnectionRefusedError(f"nothing listens at {address!r}")
        ours, theirs = self._stream_pair()
        listener.deliver(StreamConnection(theirs))
        return StreamConnection(ours)
