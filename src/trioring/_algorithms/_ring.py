"""Ring allreduce: reduce-scatter, then all-gather, around the ring of ranks.

Cost (Thakur, Rabenseifner and Gropp 2005): 2 (n-1) alpha + 2 ((n-1)/n) m beta
+ ((n-1)/n) m gamma, for n ranks and m bytes: bandwidth-optimal, latency linear in n.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._ring_steps import RingStep, ring_steps

if TYPE_CHECKING:
    import numpy as np

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

    In step s < n-1 rank r receives segment (r-s-1) mod n from its left-hand neighbour and
    reduces it into its own, in place, as ``reduce(own, incoming)``; after the n-1 of them
    rank r owns the finished segment (r+1) mod n, computed on that rank only (and, for a
    mean, divided by n there, once), which the all-gather steps then copy to every rank, so
    the result is bitwise identical everywhere.

    The steps are the shared ring step (:func:`~trioring._algorithms._ring_steps.ring_steps`):
    one sender task, one receiver task that reduces each chunk and hands it to the sender
    for the next step, so steps pipeline chunk by chunk, across both phases.
    """
    n, r = world.size, world.rank
    if n == 1:
        return  # the sum, min, max, product or mean of one array is itself
    total = flat.shape[0]
    chunk = max(1, world.chunk_bytes // flat.dtype.itemsize)
    bounds = [i * total // n for i in range(n + 1)]
    steps = []
    for s in range(2 * (n - 1)):
        reducing = s < n - 1
        index = (r - s - 1 if reducing else r - (s - (n - 1))) % n
        lo, hi = bounds[index], bounds[index + 1]
        if reducing:
            steps.append(RingStep(lo, hi, flat, 0, flat, divide and s == n - 2))
        else:
            steps.append(RingStep(lo, hi, flat, 0))
    await ring_steps(world, spec, chunk, (flat, 0, bounds[r], bounds[r + 1]), steps, reduce)
