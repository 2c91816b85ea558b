"""Recursive doubling allgather, for power-of-two worlds.

Cost (Thakur, Rabenseifner and Gropp 2005): log2 n alpha + ((n-1)/n) m beta, for n ranks and
m bytes gathered: latency-optimal like Bruck's algorithm, and with no local rotation (every
block lands in place), but only for n a power of two. Blocks may differ in size.
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

__all__ = ["is_power_of_two", "recursive_doubling_allgather"]


def is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


async def recursive_doubling_allgather(
    world: World, spec: OpSpec, flat: np.ndarray, bounds: Sequence[int]
) -> None:
    """Gather every rank's block into ``flat``: rank i's block is
    ``flat[bounds[i]:bounds[i + 1]]`` and must already be in place on rank i. The world size
    must be a power of two (the collectives refuse a forced call otherwise, before any I/O).

    In round k (distance d = 1, 2, 4, ..., n/2) rank r and its partner r ^ d each hold the
    blocks of their group of d ranks, ``r & ~(d-1)`` and up, which are contiguous in
    ``flat`` since blocks lie in rank order: each sends its group's blocks and receives the
    partner's straight into place, so after log2 n rounds every rank holds every block. The
    first round pairs rank 2i with 2i + 1, so an even rank's first frame goes to rank r+1,
    where the ring's, Bruck's and the barrier's go: a rank that runs one of those instead
    (a call of another size) is found out by a frame it receives. Frames carry the element
    offset of their chunk in ``flat`` (each round talks to another peer); a range longer
    than ``chunk_bytes`` goes in chunks, sent while received; an empty range still sends one
    empty frame, so every round is checked.
    """
    n, r = world.size, world.rank
    if n == 1:
        return
    if not is_power_of_two(n):
        raise ValueError(f"recursive doubling allgather needs a power-of-two world, not {n}")
    chunk = max(1, world.chunk_bytes // flat.dtype.itemsize)
    distance = 1
    while distance < n:
        mine = r & ~(distance - 1)
        theirs = mine ^ distance
        send_lo, send_hi = bounds[mine], bounds[mine + distance]
        recv_lo, recv_hi = bounds[theirs], bounds[theirs + distance]
        link = world.links[r ^ distance]
        if send_hi - send_lo <= chunk and recv_hi - recv_lo <= chunk:
            await exchange(
                spec,
                link,
                send_lo,
                bytes_of(flat, send_lo, send_hi - send_lo),
                link,
                recv_lo,
                bytes_of(flat, recv_lo, recv_hi - recv_lo),
            )
        else:
            await _exchange_chunked(spec, flat, link, send_lo, send_hi, recv_lo, recv_hi, chunk)
        distance *= 2


async def _exchange_chunked(
    spec: OpSpec,
    flat: np.ndarray,
    link: Link,
    send_lo: int,
    send_hi: int,
    recv_lo: int,
    recv_hi: int,
    chunk: int,
) -> None:
    """One round's ranges in chunks, both ways on one link: the send and the receive run
    concurrently."""

    async def send() -> None:
        for offset, count in chunks(send_lo, send_hi, chunk):
            await link.send(spec, offset, bytes_of(flat, offset, count))

    async def receive() -> None:
        for offset, count in chunks(recv_lo, recv_hi, chunk):
            await link.recv(spec, offset, bytes_of(flat, offset, count))

    await run_concurrently(send, receive)
