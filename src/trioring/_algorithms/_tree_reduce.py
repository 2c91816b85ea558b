"""Binomial tree reduce, chunk by chunk, to one root; the other ranks' arrays unchanged.

Cost (Thakur, Rabenseifner and Gropp 2005): ceil(log2 n) (alpha + m beta + m gamma), for n
ranks and m bytes: latency-optimal; the root receives ceil(log2 n) whole arrays.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from .._util import ignore_fp_errors
from ._steps import bytes_of, chunks
from ._tree import tree_neighbours

if TYPE_CHECKING:
    from .._wire import OpSpec
    from ._world import World

__all__ = ["tree_reduce"]


async def tree_reduce(
    world: World,
    spec: OpSpec,
    flat: np.ndarray,
    root: int,
    reduce: np.ufunc,
    *,
    divide: bool,
) -> None:
    """Reduce every rank's ``flat`` into root's ``flat``, in place there; elsewhere ``flat``
    is only read.

    The tree is broadcast's (:func:`~trioring._algorithms.tree_neighbours`), walked the
    other way: for each chunk, a rank receives its children's partial results, smallest
    subtree first, reduces each into its own as ``reduce(partial so far, child's)``, and
    sends the result to its parent. So in virtual ranks v = (rank - root) mod n, every
    element is ``((x_v op P_(v+1)) op P_(v+2)) op P_(v+4) ...``, the same order whatever the
    timing. The root divides a mean by n once, at the end of each chunk.

    Chunks go one at a time, each rank receiving before it sends, in tree order, so this
    cannot deadlock on unbuffered links, and a non-root rank needs two chunks of scratch (its
    partial result and the incoming one), never a copy of the array.
    """
    n = world.size
    if n == 1:
        return
    parent, children = tree_neighbours(world.rank, n, root)
    children.reverse()  # smallest subtree first: those finish first
    dtype = flat.dtype
    chunk = max(1, world.chunk_bytes // dtype.itemsize)
    scratch = world.scratch[: chunk * dtype.itemsize].view(dtype)
    mine = np.empty(chunk if children and parent is not None else 0, dtype)
    parent_link = world.links[parent] if parent is not None else None
    child_links = [world.links[child] for child in children]
    with ignore_fp_errors():
        for offset, count in chunks(0, flat.shape[0], chunk):
            own = flat[offset : offset + count]
            acc = own if parent is None else mine[:count]
            source = own
            for link in child_links:
                incoming = scratch[:count]
                await link.recv(spec, offset, incoming.view(np.uint8).data)
                reduce(source, incoming, out=acc)
                source = acc
            if parent_link is None:
                if divide:
                    np.divide(own, n, out=own)
            else:
                # A leaf sends its own input; anyone else its partial result.
                await parent_link.send(spec, offset, bytes_of(source, 0, count))
