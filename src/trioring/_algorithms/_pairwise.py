"""Pairwise exchange alltoall(v), for large blocks and for blocks of any sizes.

Cost (Thakur, Rabenseifner and Gropp 2005): (n-1) alpha + ((n-1)/n) m beta, for n ranks
and m bytes sent by each rank: every byte crosses the network once (bandwidth-optimal),
latency linear in n. In step k (1 <= k < n) rank r sends its block for rank r+k to it and
receives rank r-k's block for r, concurrently, so every rank has one send and one receive
in flight at each step and no step waits on another pair. Blocks may differ in size (the
alltoallv), zeros included: an empty block still goes as one empty frame.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._concurrency import run_concurrently
from ._steps import bytes_of, chunks, exchange

if TYPE_CHECKING:
    from collections.abc import Sequence

    import numpy as np

    from .._framing import Link
    from .._wire import OpSpec
    from ._world import World

__all__ = ["pairwise_alltoall"]


async def pairwise_alltoall(
    world: World, spec: OpSpec, sends: Sequence[np.ndarray], recvs: Sequence[np.ndarray]
) -> None:
    """Send ``sends[i]`` (flat) to rank i, and receive rank i's block for this rank into
    ``recvs[i]`` (flat, apart from every ``sends[j]``, which are only read). Rank i must
    send exactly as many elements as ``recvs[i]`` holds (a frame of another size is a
    ProtocolError); the blocks of one rank may differ in size, zeros included.

    Step k sends to rank r+k and receives from rank r-k; step 1 thus sends to r+1 and
    receives from r-1, as Bruck's first round does. Frames carry their element offset
    within their block; blocks longer than ``chunk_bytes`` go in chunks, the send and the
    receive running concurrently.
    """
    n, r = world.size, world.rank
    if recvs[r].shape[0]:
        recvs[r][:] = sends[r]
    if n == 1:
        return
    chunk = max(1, world.chunk_bytes // sends[r].dtype.itemsize)
    for step in range(1, n):
        peer_to, peer_from = (r + step) % n, (r - step) % n
        outgoing, incoming = sends[peer_to], recvs[peer_from]
        to, frm = world.links[peer_to], world.links[peer_from]
        send_count, recv_count = outgoing.shape[0], incoming.shape[0]
        if send_count <= chunk and recv_count <= chunk:
            await exchange(
                spec,
                to,
                0,
                bytes_of(outgoing, 0, send_count),
                frm,
                0,
                bytes_of(incoming, 0, recv_count),
            )
        else:
            await _exchange_chunked(spec, to, outgoing, frm, incoming, chunk)


async def _exchange_chunked(
    spec: OpSpec, to: Link, outgoing: np.ndarray, frm: Link, incoming: np.ndarray, chunk: int
) -> None:
    """One step's blocks in chunks: the send and the receive run concurrently."""

    async def sender() -> None:
        for offset, count in chunks(0, outgoing.shape[0], chunk):
            await to.send(spec, offset, bytes_of(outgoing, offset, count))

    async def receiver() -> None:
        for offset, count in chunks(0, incoming.shape[0], chunk):
            await frm.recv(spec, offset, bytes_of(incoming, offset, count))

    await run_concurrently(sender, receiver)
