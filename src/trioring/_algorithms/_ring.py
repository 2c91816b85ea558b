"""Ring allreduce: reduce-scatter, then all-gather, around the ring of ranks.

Cost (Thakur, Rabenseifner and Gropp 2005): 2 (n-1) alpha + 2 ((n-1)/n) m beta
+ ((n-1)/n) m gamma, for n ranks and m bytes: bandwidth-optimal, latency linear in n.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np
import trio

from .._concurrency import run_concurrently
from ._steps import bytes_of, chunks

if TYPE_CHECKING:
    from collections.abc import Iterator

    from .._wire import OpSpec
    from ._world import World

__all__ = ["ring_allreduce"]


async def ring_allreduce(
    world: World,
    spec: OpSpec,
    flat: np.ndarray,
    reduce: np.ufunc,
    *,
    divide: bool,
) -> None:
    """Reduce ``flat`` in place across the ring: n-1 reduce-scatter steps, then n-1
    all-gather steps, each moving one of n segments to the right-hand neighbour.

    After reduce-scatter, rank r owns the finished segment (r+1) mod n; that segment is
    computed on that rank only (and, for a mean, divided by n there, once) and then copied
    to every rank by the all-gather, so the result is bitwise identical everywhere.

    One sender task streams chunks to the right; one receiver task takes chunks from the
    left, reduces them into place and hands each finished chunk to the sender for the next
    step, so steps pipeline chunk by chunk.
    """
    n, r = world.size, world.rank
    if n == 1:
        return  # the sum, min, max, product or mean of one array is itself
    total = flat.shape[0]
    itemsize = flat.dtype.itemsize
    chunk = max(1, world.chunk_bytes // itemsize)
    bounds = [i * total // n for i in range(n + 1)]
    left, right = world.links[(r - 1) % n], world.links[(r + 1) % n]
    scratch = world.scratch[: chunk * itemsize].view(flat.dtype)
    ready_send, ready_receive = trio.open_memory_channel[tuple[int, int]](math.inf)
    steps = 2 * (n - 1)

    def segment(index: int) -> Iterator[tuple[int, int]]:
        index %= n
        return chunks(bounds[index], bounds[index + 1], chunk)

    async def sender() -> None:
        # The channel is deliberately not closed from this side: if a send fails, the receiver
        # may hand over one more chunk before it is cancelled, and that must not raise.
        for offset, count in segment(r):
            await right.send(spec, offset, bytes_of(flat, offset, count))
        async for offset, count in ready_receive:
            await right.send(spec, offset, bytes_of(flat, offset, count))

    async def receiver() -> None:
        # Overflow to inf is a valid result, and a warning would appear only on the rank that
        # happened to own the segment; MPI is silent too.
        with np.errstate(all="ignore"), ready_send:
            for step in range(steps):
                reducing = step < n - 1
                index = r - step - 1 if reducing else r - (step - (n - 1))
                for offset, count in segment(index):
                    target = flat[offset : offset + count]
                    if reducing:
                        incoming = scratch[:count]
                        await left.recv(spec, offset, incoming.view(np.uint8).data)
                        reduce(target, incoming, out=target)
                        if divide and step == n - 2:
                            np.divide(target, n, out=target)
                    else:
                        await left.recv(spec, offset, target.view(np.uint8).data)
                    if step < steps - 1:
                        ready_send.send_nowait((offset, count))

    await run_concurrently(sender, receiver)
