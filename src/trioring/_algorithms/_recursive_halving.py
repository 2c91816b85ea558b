"""Recursive halving reduce-scatter, for arrays of one chunk at most (commutative ops, which
all of trioring's are).

Cost (Thakur, Rabenseifner and Gropp 2005): log2 p alpha + ((p-1)/p) m (beta + gamma), p the
largest power of two <= n, plus two steps of the whole array when n is not a power of two,
plus one alpha for a first round of empty frames around the ring: latency-optimal, where the
ring takes n-1 steps.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from .._util import ignore_fp_errors
from ._steps import exchange

if TYPE_CHECKING:
    from .._wire import OpSpec
    from ._world import World

__all__ = ["recursive_halving_reduce_scatter"]


async def recursive_halving_reduce_scatter(
    world: World,
    spec: OpSpec,
    flat: np.ndarray,
    bounds: list[int],
    out: np.ndarray,
    reduce: np.ufunc,
    *,
    divide: bool,
) -> None:
    """Reduce block ``r`` (``flat[bounds[r]:bounds[r+1]]``) of every rank's ``flat`` into
    ``out`` on rank ``r``; ``flat`` is only read.

    After one round of empty frames around the ring (see below), with p the largest power of two <= n, ranks p..n-1 first hand their whole array to rank
    r - p, which reduces it into a copy of its own as ``reduce(its own, theirs)``. The p
    remaining ranks then work on a copy laid out by *owner*: rank i < p owns blocks i and,
    if i < n - p, i + p, and the copy holds rank 0's blocks first, then rank 1's, and so on.
    In round k (distance d = p/2, p/4, ..., 1) rank i and its partner i ^ d split the range
    of owners they share: each sends the partner's half and receives its own, reducing as
    ``reduce(lower rank's, higher rank's)``, so both halves of a pair are computed from the
    same two operands in the same order. After log2 p rounds rank i holds its blocks
    reduced, keeps block i and sends block i + p back to its owner. A mean is divided once,
    by the rank that finishes the block. The order depends only on n, never on timing.
    """
    n, r = world.size, world.rank
    if n == 1:
        out[:] = flat
        return
    if flat.nbytes > world.scratch.nbytes:
        raise ValueError("recursive halving is only for arrays that fit the scratch buffer")
    dtype = flat.dtype
    p = 1 << (n.bit_length() - 1)
    extra = n - p
    fold_out_step = p.bit_length() + 1
    scratch = world.scratch[: flat.nbytes].view(dtype)
    # First an empty frame to rank r + 1 while one comes from rank r - 1: the ring's first
    # step (and the barrier's first round) go there too. Ranks whose calls differ in size may
    # pick different algorithms (the table's choice depends on the size); this way each one
    # whose left-hand neighbour runs something else finds out by its first frame, instead of
    # the pairs of the two algorithms waiting for each other in a cycle.
    empty = memoryview(b"")
    token = fold_out_step + 1
    await exchange(
        spec, world.links[(r + 1) % n], token, empty, world.links[(r - 1) % n], token, empty
    )
    with ignore_fp_errors():
        if r >= p:
            partner = world.links[r - p]
            await partner.send(spec, 0, flat.view(np.uint8).data)
            await partner.recv(spec, fold_out_step, out.view(np.uint8).data)
            return
        # The copy, by owner: owner i's blocks start at starts[i] and end at starts[i + 1].
        owned = [[i, i + p] if i < extra else [i] for i in range(p)]
        starts = [0]
        for blocks in owned:
            starts.append(starts[-1] + sum(bounds[b + 1] - bounds[b] for b in blocks))
        work = np.empty(flat.shape[0], dtype)
        incoming_all = None
        if r < extra:
            await world.links[r + p].recv(spec, 0, scratch.view(np.uint8).data)
            incoming_all = scratch
        for i, blocks in enumerate(owned):
            at = starts[i]
            for b in blocks:
                lo, hi = bounds[b], bounds[b + 1]
                target = work[at : at + hi - lo]
                if incoming_all is not None:
                    reduce(flat[lo:hi], incoming_all[lo:hi], out=target)  # ours is lower
                else:
                    target[:] = flat[lo:hi]
                at += hi - lo
        lo_owner, hi_owner = 0, p
        distance, step = p // 2, 1
        while distance >= 1:
            partner_rank = r ^ distance
            middle = lo_owner + distance
            if r < partner_rank:
                keep, give = (lo_owner, middle), (middle, hi_owner)
            else:
                keep, give = (middle, hi_owner), (lo_owner, middle)
            kept = work[starts[keep[0]] : starts[keep[1]]]
            given = work[starts[give[0]] : starts[give[1]]]
            incoming = scratch[: kept.shape[0]]
            link = world.links[partner_rank]
            await exchange(
                spec,
                link,
                step,
                given.view(np.uint8).data,
                link,
                step,
                incoming.view(np.uint8).data,
            )
            if r < partner_rank:
                reduce(kept, incoming, out=kept)
            else:
                reduce(incoming, kept, out=kept)
            lo_owner, hi_owner = keep
            distance, step = distance // 2, step + 1
        mine = work[starts[r] : starts[r + 1]]
        if divide:
            np.divide(mine, n, out=mine)
        own = bounds[r + 1] - bounds[r]
        out[:] = mine[:own]
        if r < extra:
            await world.links[r + p].send(spec, fold_out_step, mine[own:].view(np.uint8).data)
