"""Ring reduce-scatter: each rank ends with its own block of the reduction, the input left
unchanged.

Cost (Thakur, Rabenseifner and Gropp 2005): (n-1) alpha + ((n-1)/n) m beta
+ ((n-1)/n) m gamma, for n ranks and m bytes: bandwidth-optimal, latency linear in n.

Ring allreduce's first phase (``_ring``) reduces in place in the caller's array, which
allreduce overwrites anyway, each rank finishing the block after its own. Here the input
stays unchanged, every rank finishes its own block, and blocks may differ in size
(reduce_scatterv), so the partial results travel through buffers of one block each; the
steps themselves are the shared ring step (``_ring_steps``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ._ring_steps import RingStep, ring_steps

if TYPE_CHECKING:
    from .._wire import OpSpec
    from ._world import World

__all__ = ["ring_reduce_scatter"]


async def ring_reduce_scatter(
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
    ``out`` on rank ``r``, in n-1 steps around the ring; ``flat`` is only read.

    In step s (0 <= s < n-1) rank r sends to its right-hand neighbour the partial result of
    block (r-s-1) mod n (in step 0 its own input) and receives from its left-hand one the
    partial result of block (r-s-2) mod n, which it reduces as
    ``reduce(own input, incoming)``. So block j is reduced, in this order, by ranks j+1,
    j+2, ..., j (mod n): ``x_j op (x_(j-1) op (... op (x_(j+2) op x_(j+1))))``, the same
    order whatever the timing. A mean is divided by n once, in the last step.

    Scratch: one chunk for the incoming data, and the partial results in two buffers of one
    block, alternating: when every block has the size of ``out``, ``out`` itself is one of
    them, so the scratch is one block (m/n) and one chunk. The steps pipeline chunk by chunk
    (:func:`~trioring._algorithms._ring_steps.ring_steps`), except that a step does not
    overwrite a buffer before the step that sends it has finished.
    """
    n, r = world.size, world.rank
    if n == 1:
        out[:] = flat
        return
    dtype = flat.dtype
    chunk = max(1, world.chunk_bytes // dtype.itemsize)
    sizes = [bounds[j + 1] - bounds[j] for j in range(n)]
    largest = max(sizes)
    # Steps 0..n-3 need the two buffers in turn (n-2 of them: none at n = 2, one at n = 3).
    first = np.empty(largest if n > 2 else 0, dtype)
    uniform = all(size == out.shape[0] for size in sizes)
    second = out if uniform else np.empty(largest if n > 3 else 0, dtype)
    last = n - 2
    steps = []
    for step in range(n - 1):
        # Step s receives block r-s-2's partial result (reduced by ranks r-s-1, ..., r-1),
        # reduces this rank's input into it, and sends it on in step s+1.
        block = (r - step - 2) % n
        target = out if step == last else first if (last - step) % 2 else second
        steps.append(
            RingStep(
                bounds[block],
                bounds[block + 1],
                target,
                bounds[block],
                flat,
                divide and step == last,
            )
        )
    send = (r - 1) % n
    await ring_steps(
        world, spec, chunk, (flat, 0, bounds[send], bounds[send + 1]), steps, reduce, reuse=True
    )
