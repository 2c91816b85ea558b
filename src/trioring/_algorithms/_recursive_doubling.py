"""Recursive doubling allreduce, for arrays of one chunk at most.

Cost: ceil(log2 n) alpha + ceil(log2 n) m beta + ceil(log2 n) m gamma (plus two steps when n
is not a power of two): latency-optimal, each step moves the whole array.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from .._util import ignore_fp_errors
from ._steps import exchange

if TYPE_CHECKING:
    from .._wire import OpSpec
    from ._world import World

__all__ = ["recursive_doubling_allreduce"]


async def recursive_doubling_allreduce(
    world: World,
    spec: OpSpec,
    flat: np.ndarray,
    reduce: np.ufunc,
    *,
    divide: bool,
) -> None:
    """Latency-optimal allreduce for small arrays: ceil(log2 n) exchanges of the whole array
    instead of the ring's 2 (n-1) steps.

    With p the largest power of two <= n, ranks p..n-1 first hand their array to rank r - p
    and wait; ranks 0..p-1 then exchange with the partner ``r ^ 2^k`` in round k, and finally
    send the result back to the ranks they folded in. Each partial result is always computed
    as ``reduce(lower ranks' block, higher ranks' block)``, so both partners compute the very
    same expression and the result is bitwise identical on every rank (NaN payloads included).
    A mean is divided on every rank, by the same number, in the same dtype.
    """
    n, r = world.size, world.rank
    if n == 1:
        return
    nbytes = flat.nbytes
    if nbytes > world.scratch.nbytes:
        raise ValueError("recursive doubling is only for arrays that fit the scratch buffer")
    scratch, incoming = world.scratch_as(flat.dtype, nbytes)
    raw = flat.view(np.uint8).data
    p = 1 << (n.bit_length() - 1)
    extra = n - p
    # The offset field tells the steps apart: fold-in, rounds 1.., fold-out.
    fold_out_step = p.bit_length() + 1
    # numpy runs a ufunc whose one-element output is also one of its inputs through a
    # buffered iterator, at about 3x the cost of the operation itself (0.83 against 0.30 us
    # warm; 8-10 % of a 4-byte allreduce at world 4 on 2 cores). So a one-element
    # reduction never works in place: each result goes to the other of ``flat`` and a
    # spare element, and the last one is copied into ``flat`` if it did not end there.
    # Longer arrays are reduced in place, where numpy has no such cost.
    if flat.shape[0] == 1:
        spare, spare_raw = world.spare_as(flat.dtype)
    else:
        spare, spare_raw = flat, raw
    acc, acc_raw = flat, raw  # where the partial result is

    with ignore_fp_errors():
        if r >= p:
            partner = world.links[r - p]
            await partner.send(spec, 0, raw)
            await partner.recv(spec, fold_out_step, raw)
            return
        if r < extra:
            await world.links[r + p].recv(spec, 0, incoming)
            reduce(flat, scratch, out=spare)  # rank r < r + p: ours is the lower block
            acc, acc_raw = spare, spare_raw
        distance, step = 1, 1
        while distance < p:
            partner_rank = r ^ distance
            link = world.links[partner_rank]
            await exchange(spec, link, step, acc_raw, link, step, incoming)
            out, out_raw = (spare, spare_raw) if acc is flat else (flat, raw)
            if r < partner_rank:
                reduce(acc, scratch, out=out)
            else:
                reduce(scratch, acc, out=out)
            acc, acc_raw = out, out_raw
            distance, step = distance * 2, step + 1
        if divide:
            np.divide(acc, n, out=flat)
        elif acc is not flat:
            raw[:] = acc_raw
        if r < extra:
            await world.links[r + p].send(spec, fold_out_step, raw)
