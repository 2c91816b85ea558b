"""Bruck alltoall, for small blocks at any world size.

Cost (Bruck et al. 1997; Thakur, Rabenseifner and Gropp 2005): ceil(log2 n) alpha +
(m/2) ceil(log2 n) beta, for n ranks and m bytes sent by each rank (n blocks of m/n), plus
one local rotation of m bytes and one pack and unpack of about m/2 bytes per round:
latency-optimal for every n, not only powers of two, at the price of sending each byte
about (log2 n)/2 times. Pairwise exchange (``_pairwise``) sends each byte once in n-1
steps, so Bruck only pays for small blocks (see ``SMALL_ALLTOALL_BLOCK_BYTES``).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import numpy as np

from .._concurrency import run_concurrently
from ._steps import bytes_of, chunks, exchange

if TYPE_CHECKING:
    from .._framing import Link
    from .._wire import OpSpec
    from ._world import World

__all__ = ["bruck_alltoall"]


async def bruck_alltoall(
    world: World, spec: OpSpec, send: np.ndarray, recv: np.ndarray, block: int
) -> None:
    """Send block i of ``send`` (``send[i * block:(i + 1) * block]``, flat) to rank i, and
    receive rank i's block for this rank into block i of ``recv`` (flat, apart from
    ``send``, which is only read).

    Rank r works in n positions, position j first holding its block for rank (r+j) mod n.
    In round k, with d = 2^k, it sends the positions j whose bit k is set, packed in order,
    to rank r+d, and receives as many from rank r-d into the same positions. After
    ceil(log2 n) rounds position j holds the block that rank (r-j) mod n sent to r (by
    induction on k: before round k, position j holds the block of rank r - (j mod 2^k) for
    rank r - (j mod 2^k) + j). Position j is block (r-j) mod n of ``recv`` throughout, so
    the blocks end in rank order without a final reordering. The first round
    sends to rank r+1 and receives from rank r-1, as the pairwise exchange's first step
    does, so that ranks that chose differently (different block sizes) meet in their first
    frames. A round's frames carry their element offset within that round's message;
    messages longer than ``chunk_bytes`` go in chunks, sent while received; an empty
    message still sends one empty frame, so every round is checked.
    """
    n, r = world.size, world.rank
    send_blocks = send.reshape(n, block)
    recv_blocks = recv.reshape(n, block)
    if n == 1:
        recv_blocks[:] = send_blocks
        return
    # One gather in, then one gather (pack) and one scatter (unpack) per round; the index
    # arrays are the same for every call at this rank, and kept.
    first, rounds = _plan(n, r)
    np.take(send_blocks, first, axis=0, out=recv_blocks)
    chunk = max(1, world.chunk_bytes // send.dtype.itemsize)
    distance = 1
    for chosen in rounds:
        outgoing = recv_blocks[chosen].reshape(-1)
        incoming = np.empty_like(outgoing)
        to = world.links[(r + distance) % n]
        frm = world.links[(r - distance) % n]
        count = outgoing.shape[0]
        if count <= chunk:
            await exchange(
                spec, to, 0, bytes_of(outgoing, 0, count), frm, 0, bytes_of(incoming, 0, count)
            )
        else:
            await _exchange_chunked(spec, to, outgoing, frm, incoming, chunk)
        recv_blocks[chosen] = incoming.reshape(chosen.shape[0], block)
        distance *= 2


@functools.lru_cache(maxsize=64)
def _plan(n: int, r: int) -> tuple[np.ndarray, tuple[np.ndarray, ...]]:
    """For rank r of n: which send block starts in each recv block (position j, recv
    block (r-j) mod n, holds send block (r+j) mod n), and each round's recv blocks (its
    positions j with bit k set, in order). Read-only: shared by every call."""
    positions = np.arange(n)
    first = (2 * r - positions) % n
    rounds = []
    distance = 1
    while distance < n:
        rounds.append((r - np.flatnonzero(positions & distance)) % n)
        distance *= 2
    for array in (first, *rounds):
        array.setflags(write=False)
    return first, tuple(rounds)


async def _exchange_chunked(
    spec: OpSpec, to: Link, outgoing: np.ndarray, frm: Link, incoming: np.ndarray, chunk: int
) -> None:
    """One round's message in chunks: the send and the receive run concurrently."""

    async def send() -> None:
        for offset, count in chunks(0, outgoing.shape[0], chunk):
            await to.send(spec, offset, bytes_of(outgoing, offset, count))

    async def receive() -> None:
        for offset, count in chunks(0, incoming.shape[0], chunk):
            await frm.recv(spec, offset, bytes_of(incoming, offset, count))

    await run_concurrently(send, receive)
