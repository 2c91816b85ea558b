"""A transport plugin: TCP underneath, counting the bytes that each rank sends and receives.
Run it with ``trioring run -n 2 --transport tcp counting_transport.py``."""

from __future__ import annotations

import numpy as np
import trio

import trioring
from trioring.transports import (
    BytesLike,
    Connection,
    Listener,
    TcpTransport,
    Transport,
    TransportContext,
)

#: Bytes this process sent and received on data connections (one rank per process).
TOTALS = {"sent": 0, "received": 0}


class CountingConnection(Connection):
    """Wraps another connection; keeps its contract (ordering, errors, cancellation)."""

    def __init__(self, inner: Connection) -> None:
        self._inner = inner

    async def send_all(self, *buffers: BytesLike) -> None:
        await self._inner.send_all(*buffers)
        TOTALS["sent"] += sum(memoryview(buffer).nbytes for buffer in buffers)

    async def recv_into(self, buffer: memoryview) -> int:
        received = await self._inner.recv_into(buffer)
        TOTALS["received"] += received
        return received

    async def aclose(self) -> None:
        await self._inner.aclose()

    @property
    def local_host(self) -> str | None:
        return self._inner.local_host


class CountingListener(Listener):
    def __init__(self, inner: Listener) -> None:
        self._inner = inner

    @property
    def address(self) -> str:
        return self._inner.address

    async def accept(self) -> Connection:
        return CountingConnection(await self._inner.accept())

    async def aclose(self) -> None:
        await self._inner.aclose()


class CountingTransport(Transport):
    name = "counting-tcp"
    description = "TCP, counting bytes (an example plugin)"

    def __init__(self, context: TransportContext) -> None:
        super().__init__(context)
        self._tcp = TcpTransport(context)

    @classmethod
    def unavailable_reason(cls) -> str | None:
        return TcpTransport.unavailable_reason()

    async def listen(self, address: str | None = None) -> Listener:
        return CountingListener(await self._tcp.listen(address))

    async def connect(self, address: str) -> Connection:
        return CountingConnection(await self._tcp.connect(address))

    def close(self) -> None:
        self._tcp.close()


async def main() -> None:
    trioring.register_transport(CountingTransport)
    assert trioring.is_available("counting-tcp")
    async with trioring.open_communicator(transport="counting-tcp") as comm:
        x = np.ones(1_000_000, dtype=np.float32)  # 4 MB
        await comm.allreduce(x)
        assert (x == comm.world_size).all()
        print(f"rank {comm.rank} over {comm.transport!r}: sent {TOTALS['sent'] / 1e6:.1f} MB")


trio.run(main)
