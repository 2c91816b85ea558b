"""Large calls through the shared segment's pipe: the data streams through a ring of chunks
(``_shm.PIPE_CHUNKS`` of ``PIPE_CHUNK_BYTES``) that every rank maps, the sender copying
chunk k in while the receivers copy chunk k - 1 out.

Why not cross-memory attach, which copies each byte once: ``process_vm_readv`` copies page
by page through the kernel, at about half the speed of a copy in user space here. Measured
with two and four forked processes on this 2-core VM (median of 10 rounds of 5 calls):
one reader of a 4 MiB array took 346-377 us by ``process_vm_readv`` (in 4 MiB reads; 64
KiB reads took 637) against 147-157 us through a ring of 4 x 1 MiB; 64 MiB took 12.6-14.1
ms against 4.8; three readers of 4 MiB 1143 us against 535, of 64 MiB 25.7 ms against 9.6.
Two copies that run at once on two cores, each from or into a chunk that stays in cache,
beat one copy that runs at kernel speed. Ring shapes, one reader of 4 MiB: 128 KiB x 8
256-267 us, 256 KiB x 4 190, 512 KiB x 4 151, 1 MiB x 4 147, 1 MiB x 2 169; three readers
of 64 MiB: 512 KiB x 4 16.3 ms, 1 MiB x 4 9.6, 1 MiB x 8 10.3 (of 4 MiB: 443 / 535 / 667
us). So 4 chunks of 1 MiB: 4 MiB per communicator.

Control, on the lines of the segment (see _shm): the call's publication first (it checks
the call's identity on every rank, as every collective on the segment does), then the
sender's *produced* word counts the chunks it has written, each receiver's *consumed*
word the chunks it has copied out, and the sender writes chunk k only once every receiver
has consumed chunk k - PIPE_CHUNKS. Both hold ``seq << _CHUNK_BITS | chunks``, so a word
left from an earlier call is always behind the current one. The call ends as every call
on the segment that exposes memory: every rank waits for every rank's done word
(:func:`shm_finish`), so the ring is free when the next call through it starts, and a rank
that gives up or dies makes every rank raise.

Only one rank writes the ring in a call. Ranks that disagree about the root may both write
it, but every receiver checks every rank's publication before it reads a chunk, so such a
call raises everywhere before any wrong byte reaches an array.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np
import trio

from ._shm import CONSUMED, LINE, PIPE_CHUNK_BYTES, PIPE_CHUNKS, PRODUCED
from ._shm_collectives import shm_claim, shm_finish, shm_publish, shm_reach, shm_wait

if TYPE_CHECKING:
    from .._algorithms import World
    from .._wire import OpSpec

__all__ = ["pipe_broadcast"]

#: The progress words hold the call's sequence number above this many bits of chunk count:
#: 2**24 chunks of 1 MiB, 16 TiB in one call, and 2**40 calls.
_CHUNK_BITS = 24
#: How long a copy may hold the thread before other tasks get to run (as _cma_collectives).
_SCHEDULE_EVERY_SECONDS = 0.001


async def pipe_broadcast(world: World, spec: OpSpec, flat: np.ndarray, root: int) -> None:
    """Broadcast root's ``flat`` through the pipe: the root copies it in chunk by chunk,
    every other rank copies each chunk out into its ``flat`` as soon as it is there. The
    root returns once every rank has copied all of it, so it may overwrite its array;
    a cancellation breaks the communicator, as for any collective (every rank raises)."""
    slots = world.shm
    assert slots is not None
    data = flat.view(np.uint8)
    nbytes = data.shape[0]
    count = -(-nbytes // PIPE_CHUNK_BYTES)
    await shm_claim(world, spec)
    shm_publish(world, spec, nbytes)
    if world.rank == root:
        await _send(world, spec, data, count)
    else:
        await shm_wait(world, spec)
        await _receive(world, spec, data, count, root)
    await shm_finish(world, spec)


async def _send(world: World, spec: OpSpec, data: np.ndarray, count: int) -> None:
    """Copy ``data`` into the ring in ``count`` chunks, each once every receiver has
    consumed the chunk that was there."""
    slots = world.shm
    assert slots is not None
    ring, seqs = slots.pipe, slots.seqs
    base = spec.seq << _CHUNK_BITS
    produced = slots.own_word + PRODUCED
    consumed = [word + CONSUMED for word in slots.peer_words]
    agreed = False
    since = time.perf_counter()
    for k in range(count):
        if k >= PIPE_CHUNKS:
            if not agreed:
                # The ring was free for its first chunks (the last call through it ended
                # with every rank's done word); before waiting on the receivers, make sure
                # that they are receiving this call, or a disagreement would wait forever.
                await shm_wait(world, spec)
                agreed = True
            needed = base + k - PIPE_CHUNKS + 1
            if any(seqs[word] < needed for word in consumed):
                await shm_reach(world, spec, consumed, needed)
                since = time.perf_counter()
        start = k * PIPE_CHUNK_BYTES
        piece = data[start : start + PIPE_CHUNK_BYTES]
        ring[k % PIPE_CHUNKS, : piece.shape[0]] = piece
        # After the chunk's bytes: a receiver that sees the count sees the chunk (see _shm).
        seqs[produced] = base + k + 1
        since = await _yield_now_and_then(since)
    if not agreed:
        await shm_wait(world, spec)


async def _receive(world: World, spec: OpSpec, data: np.ndarray, count: int, root: int) -> None:
    """Copy the ``count`` chunks that ``root`` streams through the ring into ``data``, each
    as soon as it is there."""
    slots = world.shm
    assert slots is not None
    ring, seqs = slots.pipe, slots.seqs
    base = spec.seq << _CHUNK_BITS
    produced = [root * LINE // 8 + PRODUCED]
    consumed = slots.own_word + CONSUMED
    since = time.perf_counter()
    for k in range(count):
        target = base + k + 1
        if seqs[produced[0]] < target:
            await shm_reach(world, spec, produced, target)
            since = time.perf_counter()
        start = k * PIPE_CHUNK_BYTES
        piece = data[start : start + PIPE_CHUNK_BYTES]
        piece[...] = ring[k % PIPE_CHUNKS, : piece.shape[0]]
        # After the copy: the sender overwrites the chunk only once it sees this.
        seqs[consumed] = target
        since = await _yield_now_and_then(since)


async def _yield_now_and_then(since: float) -> float:
    """A cancellation point after every chunk, and a schedule point once a millisecond of
    copying has passed since ``since``; returns when the next one is due from."""
    if time.perf_counter() - since >= _SCHEDULE_EVERY_SECONDS:
        await trio.lowlevel.checkpoint()
        return time.perf_counter()
    await trio.lowlevel.checkpoint_if_cancelled()
    return since
