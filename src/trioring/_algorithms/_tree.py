"""Binomial tree broadcast, streamed chunk by chunk (and without tasks for one chunk).

Cost (Thakur, Rabenseifner and Gropp 2005): ceil(log2 n) (alpha + m beta), for n ranks and
m bytes. Chunks let a rank forward what it has received while the rest arrives, so the hops
overlap.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import trio

from .._concurrency import run_concurrently
from ._steps import bytes_of, chunks

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    import numpy as np

    from .._wire import OpSpec
    from ._world import World

__all__ = ["broadcast", "small_broadcast", "tree_neighbours"]


def tree_neighbours(rank: int, size: int, root: int) -> tuple[int | None, list[int]]:
    """Parent and children of ``rank`` in the binomial tree rooted at ``root``.

    In "virtual" ranks v = (rank - root) mod n, v's parent is v with its lowest set bit
    cleared and its children are v + 2^k for every 2^k below that bit (largest subtree
    first), so the data reaches everyone in ceil(log2 n) rounds.
    """
    v = (rank - root) % size
    mask = 1
    parent = None
    while mask < size:
        if v & mask:
            parent = (v - mask + root) % size
            break
        mask <<= 1
    children = []
    mask >>= 1
    while mask > 0:
        if v + mask < size:
            children.append((v + mask + root) % size)
        mask >>= 1
    return parent, children


async def broadcast(world: World, spec: OpSpec, flat: np.ndarray, root: int) -> None:
    """Copy root's ``flat`` into every rank's ``flat`` along a binomial tree, chunk by chunk:
    each rank forwards a chunk to its children as soon as it has received it.

    Every non-root rank also sends its parent one empty frame (at offset ``count``) while it
    starts receiving, and every parent reads its children's frames while it sends. So every
    rank, the root included, both sends and receives something in each broadcast, and ranks
    that disagree about the root always find out in this call: two ranks that both believe
    they are the root, or that each believe the other is, see the other's frame and raise
    :class:`~trioring.CollectiveMismatchError` instead of returning different data or
    waiting for each other forever.
    """
    if world.size == 1:
        return
    parent, children = tree_neighbours(world.rank, world.size, root)
    chunk = max(1, world.chunk_bytes // flat.dtype.itemsize)
    pieces = list(chunks(0, flat.shape[0], chunk))
    channels = [trio.open_memory_channel[tuple[int, int]](math.inf) for _ in children]
    hello_offset = flat.shape[0]
    empty = memoryview(b"")

    def child_sender(child: int, index: int) -> Callable[[], Awaitable[None]]:
        link = world.links[child]
        receive_channel = channels[index][1]

        async def send() -> None:
            # Not closed from this side, as in ring_allreduce's sender.
            async for offset, count in receive_channel:
                await link.send(spec, offset, bytes_of(flat, offset, count))

        async def hello() -> None:
            # Read while sending, not after: a child that wrongly believes it is the root is
            # sending to us at the same time, and if neither side read until its own send was
            # done, large arrays would fill both socket buffers and deadlock.
            await link.recv(spec, hello_offset, empty)

        async def send_and_listen() -> None:
            await run_concurrently(send, hello)

        return send_and_listen

    async def receiver() -> None:
        send_channels = [send for send, _ in channels]
        try:
            for offset, count in pieces:
                if parent is not None:
                    await world.links[parent].recv(spec, offset, bytes_of(flat, offset, count))
                for channel in send_channels:
                    channel.send_nowait((offset, count))
        finally:
            for channel in send_channels:
                channel.close()

    tasks = [receiver, *(child_sender(c, i) for i, c in enumerate(children))]
    if parent is not None:
        parent_link = world.links[parent]

        async def hello_to_parent() -> None:
            await parent_link.send(spec, hello_offset, empty)

        tasks.append(hello_to_parent)
    await run_concurrently(*tasks)


async def small_broadcast(world: World, spec: OpSpec, flat: np.ndarray, root: int) -> None:
    """:func:`broadcast` for arrays of one chunk at most, without tasks: receive from the
    parent, send to each child, then collect each child's empty frame and send ours to the
    parent. The order follows the tree, so it cannot deadlock even on unbuffered links;
    the caller's barrier round has already checked that every rank agrees on ``root``."""
    if world.size == 1:
        return
    parent, children = tree_neighbours(world.rank, world.size, root)
    raw = bytes_of(flat, 0, flat.shape[0])
    hello_offset = flat.shape[0]
    empty = memoryview(b"")
    if parent is not None:
        await world.links[parent].recv(spec, 0, raw)
    for child in children:
        await world.links[child].send(spec, 0, raw)
    for child in children:
        await world.links[child].recv(spec, hello_offset, empty)
    if parent is not None:
        await world.links[parent].send(spec, hello_offset, empty)
