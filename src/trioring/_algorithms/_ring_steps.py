"""The ring step that ring allreduce, ring allgather and ring reduce-scatter share: send one
block to the right-hand neighbour while receiving the next from the left-hand one, chunk by
chunk, reducing each incoming chunk or taking it straight into place, and forwarding it in
the next step.

One sender task streams chunks to the right (this rank's first block, then each chunk that
the receiver hands over); one receiver task takes chunks from the left, so the steps
pipeline chunk by chunk and neither side ever waits for its own send to finish before it
receives (no deadlock on unbuffered streams). Two tasks for the whole call, whatever the
number of steps: a ring step costs no task of its own.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import trio

from .._concurrency import run_concurrently
from .._util import ignore_fp_errors
from ._steps import bytes_of, chunks

if TYPE_CHECKING:
    from collections.abc import Sequence

    from .._wire import OpSpec
    from ._world import World

__all__ = ["RingStep", "ring_steps"]


class RingStep(NamedTuple):
    """What one step receives from the left: elements ``[lo, hi)`` of the whole array (the
    frames carry those element offsets), landing at ``target[e - base]`` for element ``e``.
    With ``own`` set, each incoming chunk goes through the scratch buffer and is reduced as
    ``reduce(own[e], incoming, out=target[e - base])`` (``own`` indexed by element, like
    the frames); without, it is received straight into ``target``. ``divide`` divides the
    step's result by the world size (a mean, once, where it is finished). Every chunk of a
    step but the last step's is forwarded to the right in the next step, from ``target``."""

    lo: int
    hi: int
    target: np.ndarray
    base: int
    own: np.ndarray | None = None
    divide: bool = False


async def ring_steps(
    world: World,
    spec: OpSpec,
    chunk: int,
    first: tuple[np.ndarray, int, int, int],
    steps: Sequence[RingStep],
    reduce: np.ufunc | None = None,
    *,
    reuse: bool = False,
) -> None:
    """Run ``steps`` around the ring: in step 0 this rank sends ``first`` = ``(source, base,
    lo, hi)`` (elements ``[lo, hi)``, at ``source[e - base]``) to rank r+1; in step s it
    receives ``steps[s]`` from rank r-1 and sends, in step s+1, what it received.

    ``reuse``: step s's ``target`` may be step s-2's (two partial-result buffers used in
    turn), so before step s >= 2 writes anything the receiver waits until the sender has
    sent all of step s-1, which reads that buffer. Without it, a target is never written
    while the sender may still read it (each element is written once, or, as in ring
    allreduce, rewritten only with data that needed this rank's send of it first)."""
    n, r = world.size, world.rank
    left, right = world.links[(r - 1) % n], world.links[(r + 1) % n]
    dtype = first[0].dtype
    scratch = world.scratch[: chunk * dtype.itemsize].view(dtype)
    ready_send, ready_receive = trio.open_memory_channel[tuple[int, memoryview, bool]](math.inf)
    last = len(steps) - 1
    # sent[s]: the sender has sent all of step s (only tracked with reuse).
    sent = [trio.Event() for _ in steps] if reuse else None

    async def sender() -> None:
        # The channel is deliberately not closed from this side: if a send fails, the
        # receiver may hand over one more chunk before it is cancelled, and that must not
        # raise.
        source, base, lo, hi = first
        for offset, count in chunks(lo, hi, chunk):
            await right.send(spec, offset, bytes_of(source, offset - base, count))
        if sent is None:
            async for offset, payload, _ in ready_receive:
                await right.send(spec, offset, payload)
            return
        sent[0].set()
        step = 1
        async for offset, payload, ends_step in ready_receive:
            await right.send(spec, offset, payload)
            if ends_step:
                sent[step].set()
                step += 1

    async def receiver() -> None:
        # Overflow to inf is a valid result, and a warning would appear only on the rank that
        # happened to finish the block; MPI is silent too.
        with ignore_fp_errors(), ready_send:
            for s, (lo, hi, target, base, own, divide) in enumerate(steps):
                if sent is not None and s >= 2:
                    await sent[s - 1].wait()
                forward = s < last
                for offset, count in chunks(lo, hi, chunk):
                    into = target[offset - base : offset - base + count]
                    if own is None:
                        payload = into.view(np.uint8).data
                        await left.recv(spec, offset, payload)
                    else:
                        assert reduce is not None
                        incoming = scratch[:count]
                        await left.recv(spec, offset, incoming.view(np.uint8).data)
                        reduce(own[offset : offset + count], incoming, out=into)
                        if divide:
                            np.divide(into, n, out=into)
                        if not forward:
                            continue
                        payload = into.view(np.uint8).data
                    if forward:
                        ready_send.send_nowait((offset, payload, offset + count >= hi))

    await run_concurrently(sender, receiver)
