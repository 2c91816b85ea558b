"""Bruck allgather, for small blocks at any world size.

Cost (Bruck et al. 1997; Thakur, Rabenseifner and Gropp 2005): ceil(log2 n) alpha +
((n-1)/n) m beta, for n ranks and m bytes gathered, plus one local rotation of m bytes:
latency-optimal for every n, not only powers of two. Blocks may differ in size.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from .._concurrency import run_concurrently
from ._steps import bytes_of, chunks, exchange

if TYPE_CHECKING:
    from collections.abc import Sequence

    from .._framing import Link
    from .._wire import OpSpec
    from ._world import World

__all__ = ["bruck_allgather"]


async def bruck_allgather(
    world: World, spec: OpSpec, flat: np.ndarray, bounds: Sequence[int]
) -> None:
    """Gather every rank's block into ``flat``: rank i's block is
    ``flat[bounds[i]:bounds[i + 1]]`` and must already be in place on rank i.

    Rank r works in a buffer whose position j holds rank (r-j) mod n's block. In round k,
    with d = 2^k, it sends its first min(d, n-d) blocks to rank r+d and receives as many
    from rank r-d, which land at positions d.. (rank r-d's first blocks are ranks r-d,
    r-d-1, ...). After ceil(log2 n) rounds the buffer holds every block, and one copy per
    block puts them in rank order. This is Bruck's algorithm mirrored, so that its first
    round, like the ring's first step and the dissemination barrier's first round, sends to
    rank r+1 and receives from rank r-1: a rank that runs one of those instead is then
    found out by the first frame it sends. Each round talks to a different pair of peers, so a
    frame's offset is its element offset within that round's message. Messages longer
    than ``chunk_bytes`` go in chunks, sent while received.
    """
    n, r = world.size, world.rank
    if n == 1:
        return
    # position[j] is where position j starts in the working buffer.
    position = [0]
    for j in range(n):
        index = (r - j) % n
        position.append(position[-1] + bounds[index + 1] - bounds[index])
    total = position[n]
    work = np.empty(total, dtype=flat.dtype)
    work[: position[1]] = flat[bounds[r] : bounds[r + 1]]
    chunk = max(1, world.chunk_bytes // flat.dtype.itemsize)
    distance = 1
    while distance < n:
        blocks = min(distance, n - distance)
        to = world.links[(r + distance) % n]
        frm = world.links[(r - distance) % n]
        send_count = position[blocks]
        recv_at = position[distance]
        recv_count = position[distance + blocks] - recv_at
        if send_count <= chunk and recv_count <= chunk:
            await exchange(
                spec,
                to,
                0,
                bytes_of(work, 0, send_count),
                frm,
                0,
                bytes_of(work, recv_at, recv_count),
            )
        else:
            await _exchange_chunked(spec, work, to, send_count, frm, recv_at, recv_count, chunk)
        distance *= 2
    for j in range(1, n):
        index = (r - j) % n
        flat[bounds[index] : bounds[index + 1]] = work[position[j] : position[j + 1]]


async def _exchange_chunked(
    spec: OpSpec,
    work: np.ndarray,
    to: Link,
    send_count: int,
    frm: Link,
    recv_at: int,
    recv_count: int,
    chunk: int,
) -> None:
    """One round's message in chunks: the send and the receive run concurrently."""

    async def send() -> None:
        for offset, count in chunks(0, send_count, chunk):
            await to.send(spec, offset, bytes_of(work, offset, count))

    async def receive() -> None:
        for offset, count in chunks(0, recv_count, chunk):
            await frm.recv(spec, offset, bytes_of(work, recv_at + offset, count))

    await run_concurrently(send, receive)
