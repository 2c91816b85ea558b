"""Recursive doubling scan and exscan (Thakur, Rabenseifner and Gropp 2005; MPICH's
``MPIR_Scan_intra_recursive_doubling`` and ``MPIR_Exscan_intra_recursive_doubling``), run
once per chunk.

Cost: ceil(log2 n) (alpha + m beta + m gamma) for n ranks and m bytes of one chunk at most;
an array of c chunks takes c ceil(log2 n) alpha + ceil(log2 n) m (beta + gamma). Any n, not
only powers of two. Scratch: two chunks (the partial result and the incoming one), never a
copy of the whole array.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from .._util import ignore_fp_errors
from ._steps import bytes_of, chunks, exchange

if TYPE_CHECKING:
    from .._framing import Link
    from .._wire import OpSpec
    from ._world import World

__all__ = ["recursive_doubling_scan"]


async def recursive_doubling_scan(
    world: World,
    spec: OpSpec,
    flat: np.ndarray,
    reduce: np.ufunc,
    *,
    exclusive: bool,
    identity: np.ndarray | None = None,
) -> None:
    """Replace ``flat`` on rank r with the reduction of ranks 0..r's (inclusive) or ranks
    0..r-1's (``exclusive``; rank 0 gets ``identity``, which must then be given).

    For each chunk: rank r keeps a *partial* result, its own chunk to begin with. In round k
    (mask 2^k, k = 0 .. ceil(log2 n) - 1) it exchanges partials with rank r ^ 2^k if that
    rank exists (< n; both partners of a pair see it the same way, so non-powers of two need
    no extra steps), and combines, always with the lower rank's operand on the left: a lower
    partner's partial is folded into both the partial and the result (``incoming op mine``),
    a higher partner's into the partial only (``partial op incoming``). A partial that
    reaches a result (one sent to a higher partner, in round k) always covers the whole
    aligned block of 2^k ranks below that partner: they all exist, being below it.

    The order of operations, fixed by n and never by timing (two runs are bitwise the same):
    with ``T(lo, 1) = x_lo`` and ``T(lo, 2d) = T(lo, d) op T(lo + d, d)`` (a balanced tree
    over ranks lo .. lo + 2d - 1), rank r's inclusive result is
    ``T(b_j, 2^k_j) op (... op (T(b_1, 2^k_1) op x_r))``, where k_1 < k_2 < ... < k_j are
    the set bits of r and ``b_i`` is r with bits 0..k_i cleared (the block below r's, of
    size 2^k_i); the exclusive result drops ``x_r`` (the innermost term is ``T(b_1, 2^k_1)``
    alone). The partial after a rank's last round, which nobody needs, is not computed.

    Every round exchanges one frame each way per chunk (at the chunk's element offset, so
    frames of one call never collide on a link), send and receive concurrently, so this
    cannot deadlock on unbuffered links. Chunks go one after the other.
    """
    n, r = world.size, world.rank
    if n == 1:
        if exclusive:
            flat[...] = identity
        return
    dtype = flat.dtype
    chunk = max(1, world.chunk_bytes // dtype.itemsize)
    total = flat.shape[0]
    incoming_all = world.scratch[: min(total, chunk) * dtype.itemsize].view(dtype)
    partial_all = np.empty(min(total, chunk), dtype)
    # The rounds this rank takes part in: (mask, partner rank, whether the partner is lower).
    rounds: list[tuple[int, Link, bool]] = []
    mask = 1
    while mask < n:
        partner = r ^ mask
        if partner < n:
            rounds.append((mask, world.links[partner], partner < r))
        mask <<= 1
    last_mask = rounds[-1][0]  # the partial after this rank's last round is never sent
    with ignore_fp_errors():
        for offset, count in chunks(0, total, chunk):
            result = flat[offset : offset + count]
            partial = partial_all[:count]
            incoming = incoming_all[:count]
            incoming_raw = bytes_of(incoming, 0, count)
            partial_raw = bytes_of(partial, 0, count)
            partial[...] = result
            have_result = not exclusive  # exclusive: nothing below us folded in yet
            for mask, link, lower in rounds:
                await exchange(spec, link, offset, partial_raw, link, offset, incoming_raw)
                if lower:
                    if have_result:
                        reduce(incoming, result, out=result)
                    else:
                        result[...] = incoming
                        have_result = True
                    if mask != last_mask:
                        reduce(incoming, partial, out=partial)
                elif mask != last_mask:
                    reduce(partial, incoming, out=partial)
            if not have_result:  # rank 0 of an exscan
                result[...] = identity
