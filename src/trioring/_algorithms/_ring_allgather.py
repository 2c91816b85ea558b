"""Ring allgather: every block travels once around the ring of ranks, in chunks.

Cost (Thakur, Rabenseifner and Gropp 2005): (n-1) alpha + ((n-1)/n) m beta, for n ranks and
m bytes gathered: bandwidth-optimal, latency linear in n. Blocks may differ in size (the
uneven variant uses the same steps).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._ring_steps import RingStep, ring_steps

if TYPE_CHECKING:
    from collections.abc import Sequence

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
    neighbour, straight into place, and forwards it to its right-hand neighbour in step s+1:
    ring allreduce's all-gather phase, by the same shared ring step
    (:func:`~trioring._algorithms._ring_steps.ring_steps`), so steps pipeline chunk by
    chunk. Frames carry the element offset of their chunk in ``flat``; an empty block still
    sends one empty frame per step, so every step is checked.
    """
    n, r = world.size, world.rank
    if n == 1:
        return
    chunk = max(1, world.chunk_bytes // flat.dtype.itemsize)
    steps = []
    for s in range(n - 1):
        index = (r - s - 1) % n
        steps.append(RingStep(bounds[index], bounds[index + 1], flat, 0))
    await ring_steps(world, spec, chunk, (flat, 0, bounds[r], bounds[r + 1]), steps)
