"""Ring allgather: every block travels once around the ring of ranks, in chunks.

Cost (Thakur, Rabenseifner and Gropp 2005): (n-1) alpha + ((n-1)/n) m beta, for n ranks and
m bytes gathered: bandwidth-optimal, latency linear in n. Blocks may differ in size (the
uneven variant uses the same steps).

Ring allreduce's all-gather phase (``_ring``) moves its segments the same way, but it is
pipelined with the reduce-scatter phase in one receiver task that hands chunks to one sender
across both phases; sharing this function there would cost that pipeline, so it stays apart.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import trio

from .._concurrency import run_concurrently
from ._steps import bytes_of, chunks

if TYPE_CHECKING:
    from collections.abc import Iterator, Sequence

    import numpy as np

    from .._wire import OpSpec
    from ._world import World

__all__ = ["ring_allgather"]


async def ring_allgather(
    world: World, spec: OpSpec, flat: np.ndarray, bounds: Sequence[int]
) -> None:
    """Gather every rank's block into ``flat``: rank i's block is
    ``flat[bounds[i]:bounds[i + 1]]`` and must already be in place on rank i.

    In step s (0 <= s < n-1) rank r receives block (r-s-1) mod n from its left-hand
    neighbour, straight into place, and forwards it to its right-hand neighbour in step s+1.
    One sender task streams chunks to the right (its own block first, then each chunk the
    receiver hands over); one receiver task takes chunks from the left, so steps pipeline
    chunk by chunk. Frames carry the element offset of their chunk in ``flat``; an empty
    block still sends one empty frame per step, so every step is checked.
    """
    n, r = world.size, world.rank
    if n == 1:
        return
    chunk = max(1, world.chunk_bytes // flat.dtype.itemsize)
    left, right = world.links[(r - 1) % n], world.links[(r + 1) % n]
    ready_send, ready_receive = trio.open_memory_channel[tuple[int, int]](math.inf)

    def block(index: int) -> Iterator[tuple[int, int]]:
        index %= n
        return chunks(bounds[index], bounds[index + 1], chunk)

    async def sender() -> None:
        # Not closed from this side: if a send fails, the receiver may hand over one more
        # chunk before it is cancelled, and that must not raise (as in ring_allreduce).
        for offset, count in block(r):
            await right.send(spec, offset, bytes_of(flat, offset, count))
        async for offset, count in ready_receive:
            await right.send(spec, offset, bytes_of(flat, offset, count))

    async def receiver() -> None:
        with ready_send:
            for step in range(n - 1):
                for offset, count in block(r - step - 1):
                    await left.recv(spec, offset, bytes_of(flat, offset, count))
                    if step < n - 2:
                        ready_send.send_nowait((offset, count))

    await run_concurrently(sender, receiver)
