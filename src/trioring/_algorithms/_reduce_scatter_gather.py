"""Reduce as a reduce-scatter and a gather (Rabenseifner), for large arrays; the other ranks'
arrays unchanged.

Cost (after Thakur, Rabenseifner and Gropp 2005): the reduce-scatter, log2 p alpha +
((n-1)/n) m (beta + gamma) by recursive halving (p the largest power of two <= n, two steps
more otherwise) or (n-1) alpha + ((n-1)/n) m (beta + gamma) by the ring, then the gather,
(n-1) alpha + ((n-1)/n) m beta at the root (direct, every block received at once; MPICH's
binomial gather takes log2 n alpha for the same bytes). The root receives about 2 m, where
the binomial tree reduce sends it ceil(log2 n) whole arrays, and the reductions are spread
over all ranks.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import numpy as np

from .._concurrency import run_concurrently
from ._recursive_halving import recursive_halving_reduce_scatter
from ._ring_reduce_scatter import ring_reduce_scatter
from ._steps import bytes_of, chunks

if TYPE_CHECKING:
    from .._wire import OpSpec
    from ._world import World

__all__ = ["reduce_scatter_gather"]


async def reduce_scatter_gather(
    world: World,
    spec: OpSpec,
    flat: np.ndarray,
    root: int,
    reduce: np.ufunc,
    *,
    divide: bool,
    halving: bool,
) -> None:
    """Reduce every rank's ``flat`` into root's ``flat``, in place there; elsewhere ``flat``
    is only read.

    First a reduce-scatter of ``flat`` in n blocks, ``[i m / n, (i+1) m / n)`` for rank i
    (elements), each rank's block into scratch of its own: by recursive halving when
    ``halving`` (the array fits the scratch buffer), by the ring otherwise, so the order of
    operations is that reduce-scatter's (fixed by n, the same for every root; a mean is
    divided once, by the rank that finishes each block). Then every rank but the root sends
    its block to the root, in chunks, and the root receives them from all ranks at once,
    straight into place (Open MPI's linear gather for large messages), after copying in its
    own. Scratch: one block (m/n) on every rank, plus the reduce-scatter's.
    """
    n, r = world.size, world.rank
    if n == 1:
        return
    total = flat.shape[0]
    bounds = [i * total // n for i in range(n + 1)]
    lo, hi = bounds[r], bounds[r + 1]
    block = np.empty(hi - lo, flat.dtype)
    scatter = recursive_halving_reduce_scatter if halving else ring_reduce_scatter
    await scatter(world, spec, flat, bounds, block, reduce, divide=divide)
    chunk = max(1, world.chunk_bytes // flat.dtype.itemsize)
    if r != root:
        link = world.links[root]
        for offset, count in chunks(lo, hi, chunk):
            await link.send(spec, offset, bytes_of(block, offset - lo, count))
        return
    # Only now: until this rank's reduce-scatter returned, it read its own input here.
    flat[lo:hi] = block

    async def receive(peer: int) -> None:
        link = world.links[peer]
        for offset, count in chunks(bounds[peer], bounds[peer + 1], chunk):
            await link.recv(spec, offset, bytes_of(flat, offset, count))

    await run_concurrently(*(functools.partial(receive, peer) for peer in range(n) if peer != r))
