"""Large calls through the shared segment's pipe: the data streams through a ring of chunks
(``_shm.PIPE_CHUNKS`` of ``PIPE_CHUNK_BYTES``) that every rank maps, a writer copying
chunk k in while the readers copy chunk k - 1 out (or reduce it into their result).

Every collective through the pipe is a list of *transfers*, the same on every rank: a
writer, its readers and a size, cut into chunks that take consecutive places in the ring.
Each rank does its part of each chunk (copy in, copy out, reduce, or nothing), its writes
in chunk order and its reads in chunk order, in one task (see :meth:`_Stream.run` for why
that never deadlocks).

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
the call's identity on every rank, as every collective on the segment does), then a
writer's *produced* word holds one more than the last chunk it wrote, a reader's
*consumed* word one more than the last chunk it read. Both hold ``seq << PROGRESS_BITS |
chunk``, so a word left from an earlier call is always behind the current one. A rank
looks at the publications (:func:`shm_wait`) before it reads a chunk or waits for anyone,
so a writer fills the free ring at once while the others arrive, and ranks that disagree
raise instead of waiting for each other. The call ends as every call
on the segment that exposes memory: every rank waits for every rank's done word
(:func:`shm_finish`), so the ring is free when the next call through it starts, and a rank
that gives up or dies makes every rank raise.

Ranks that disagree (about the root, say) may write the same chunk, but every rank checks
every publication before it reads one, so such a call raises everywhere before any wrong
byte reaches an array.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np
import trio

from .._util import ignore_fp_errors
from ._shm import (
    CONSUMED,
    LINE,
    PIPE_CHUNK_BYTES,
    PRODUCED,
    PROGRESS_BITS,
    broadcast_piece_bytes,
)
from ._shm_collectives import (
    shm_claim,
    shm_done,
    shm_finish,
    shm_publish,
    shm_reach,
    shm_wait,
)

if TYPE_CHECKING:
    from collections.abc import Iterable, Sequence

    from .._algorithms import World
    from .._wire import OpSpec

__all__ = [
    "pipe_allgather",
    "pipe_allreduce",
    "pipe_alltoall",
    "pipe_broadcast",
    "pipe_gather",
    "pipe_reduce",
    "pipe_reduce_scatter",
    "pipe_scatter",
]

#: How long a copy may hold the thread before other tasks get to run (as _cma_collectives).
_SCHEDULE_EVERY_SECONDS = 0.001

#: One transfer: (writer, readers, bytes, this rank's array for it or None where it takes
#: no part: the writer's source, a reader's destination, both flat and of the call's dtype).
Transfer = tuple[int, "Sequence[int]", int, "np.ndarray | None"]


class _Stream:
    """One call's walk through the ring: how many chunks it has laid out, who reads each,
    and whether this rank has checked every publication yet."""

    def __init__(
        self,
        world: World,
        spec: OpSpec,
        *,
        agreed: bool = False,
        chunk_bytes: int = PIPE_CHUNK_BYTES,
    ) -> None:
        slots = world.shm
        assert slots is not None
        self.world, self.spec, self.slots = world, spec, slots
        #: The ring as this call cuts it: ``PIPE_CHUNKS * PIPE_CHUNK_BYTES // chunk_bytes``
        #: places of ``chunk_bytes`` (a divisor of the ring's size, the same on every rank).
        self.ring = slots.pipe.reshape(-1, chunk_bytes)
        self.chunk_bytes = chunk_bytes
        self.base = spec.seq << PROGRESS_BITS
        #: The readers of every chunk laid out so far, by chunk index.
        self.readers: list[Sequence[int]] = []
        self.agreed = agreed
        self.since = time.perf_counter()

    async def agree(self) -> None:
        if not self.agreed:
            await shm_wait(self.world, self.spec)
            self.agreed = True

    async def run(self, transfers: Iterable[Transfer], reduce: np.ufunc | None = None) -> None:
        """Do this rank's part of ``transfers``: copy its sources into the ring as their
        writer, copy the ring into its destinations as a reader (or, with ``reduce``,
        reduce the ring into them); return when all are done.

        Its writes go in chunk order, and so do its reads, but each goes on while the other
        waits: were a rank to take its chunks strictly in order, two ranks that exchange
        would take turns, each idle while the other copies. When neither can go on, it
        waits for the lower of the two chunks, which is what keeps a call from deadlocking:
        the lowest chunk that some rank has yet to do always can be done (its writer waits
        only for reads of lower chunks, its readers only for its writer)."""
        world, slots = self.world, self.slots
        rank, readers_of = world.rank, self.readers
        writes: list[tuple[int, np.ndarray]] = []
        reads: list[tuple[int, int, np.ndarray]] = []
        chunk_bytes = self.chunk_bytes
        for writer, readers, nbytes, mine in transfers:
            step = chunk_bytes // mine.itemsize if mine is not None else 0
            for start in range(0, nbytes, chunk_bytes):
                k = len(readers_of)
                readers_of.append(readers)
                if mine is None:
                    continue
                offset = start // chunk_bytes * step
                piece = mine[offset : offset + min(step, (nbytes - start) // mine.itemsize)]
                if rank == writer:
                    writes.append((k, piece))
                else:
                    reads.append((k, writer * LINE // 8 + PRODUCED, piece))
        ring, seqs, base, spec = self.ring, slots.seqs, self.base, self.spec
        places = ring.shape[0]
        own = slots.own_word
        written = read = 0
        while written < len(writes) or read < len(reads):
            late: list[int] = []
            if written < len(writes):
                k, piece = writes[written]
                needed = base + k - places + 1
                if k >= places:
                    late = [q * LINE // 8 + CONSUMED for q in readers_of[k - places]]
                    late = [word for word in late if seqs[word] < needed]
                if not late:
                    ring[k % places, : piece.nbytes].view(piece.dtype)[...] = piece
                    # After the chunk: a reader that sees the word sees the chunk (see _shm).
                    slots.store(own + PRODUCED, base + k + 1)
                    written += 1
                    await self.breathe()
                    continue
            if read < len(reads):
                await self.agree()
                j, produced, into = reads[read]
                if seqs[produced] > base + j:
                    chunk = ring[j % places, : into.nbytes].view(into.dtype)
                    if reduce is None:
                        into[...] = chunk
                    else:
                        with ignore_fp_errors():
                            reduce(into, chunk, out=into)
                    # After the read: the chunk's next writer overwrites it only then.
                    slots.store(own + CONSUMED, base + j + 1)
                    read += 1
                    await self.breathe()
                    continue
                if not late or j < k:
                    await shm_reach(world, spec, [produced], base + j + 1)
                    continue
            await self.agree()
            await shm_reach(world, spec, late, needed)

    async def breathe(self) -> None:
        """A cancellation point after every chunk, and a schedule point once a millisecond
        of copying has passed since the last one."""
        if time.perf_counter() - self.since >= _SCHEDULE_EVERY_SECONDS:
            await trio.lowlevel.checkpoint()
            self.since = time.perf_counter()
        else:
            await trio.lowlevel.checkpoint_if_cancelled()


async def _start(
    world: World, spec: OpSpec, nbytes: int, chunk_bytes: int = PIPE_CHUNK_BYTES
) -> _Stream:
    """Publish ``spec``'s call on the segment (its slot's payload: nothing) and start its
    walk through the ring, in chunks of ``chunk_bytes``."""
    await shm_claim(world, spec)
    shm_publish(world, spec, nbytes)
    return _Stream(world, spec, chunk_bytes=chunk_bytes)


async def _end(stream: _Stream, own: tuple[np.ndarray, np.ndarray] | None = None) -> None:
    """Check every publication if nothing did yet, then wait for every rank's done word:
    the ring is free for the next call, and a rank that gave up makes every rank raise.

    ``own`` (destination, source) is this rank's own block, which goes nowhere through the
    ring: it is copied only after this rank's done word is out, while the peers finish,
    so that no peer waits for it. Copied first, as it was, it held up every rank that
    waits for this one: a gather's other ranks waited for the root's copy of its own block
    before they could return (4 MiB at world 2, against Open MPI in the same ranks,
    bench/paired.py, two rounds of each: 1.55-1.66 of its time before, 1.09-1.16 after)."""
    await stream.agree()
    if own is not None:
        shm_done(stream.world, stream.spec)
        own[0][...] = own[1]
    await shm_finish(stream.world, stream.spec)


def _others(world: World, rank: int) -> tuple[int, ...]:
    return tuple(q for q in range(world.size) if q != rank)


async def pipe_broadcast(world: World, spec: OpSpec, flat: np.ndarray, root: int) -> None:
    """Broadcast root's ``flat`` through the pipe: the root copies it in chunk by chunk,
    every other rank copies each chunk out into its ``flat`` as soon as it is there, in
    chunks of a quarter of it where no rank is crowded (see
    _shm.BROADCAST_PIECE_MIN_BYTES). Every rank returns once every rank has copied all of
    it; a cancellation breaks the communicator, as for any collective (every rank
    raises)."""
    assert world.shm is not None
    chunk_bytes = broadcast_piece_bytes(flat.nbytes, crowded=world.shm.crowded)
    stream = await _start(world, spec, flat.nbytes, chunk_bytes)
    await stream.run([(root, _others(world, root), flat.nbytes, flat)])
    await _end(stream)


def _pieces(lo: int, hi: int, step: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` in pieces of at most ``step`` elements (none if empty)."""
    return [(start, min(hi, start + step)) for start in range(lo, hi, step)]


def _rounds(bounds: Sequence[int], step: int) -> list[list[tuple[int, int]]]:
    """The pieces of every block ``[bounds[q], bounds[q + 1])``, one list per piece number
    (an empty piece where a block has fewer): a plan that takes piece c of every block
    before piece c + 1 of any keeps the writers busy together, not one after another."""
    blocks = [_pieces(bounds[q], bounds[q + 1], step) for q in range(len(bounds) - 1)]
    count = max((len(pieces) for pieces in blocks), default=0)
    return [[b[c] if c < len(b) else (0, 0) for b in blocks] for c in range(count)]


def _step(array: np.ndarray) -> int:
    """Elements of ``array``'s dtype in one chunk."""
    return PIPE_CHUNK_BYTES // array.dtype.itemsize


def _to_all(world: World, bounds: Sequence[int], array: np.ndarray) -> list[Transfer]:
    """Block q of ``array`` (``[bounds[q], bounds[q + 1])``, in place on every rank) from
    rank q to every other rank, piece c of every block before piece c + 1 of any."""
    others = [_others(world, q) for q in range(world.size)]
    return [
        (q, others[q], (hi - lo) * array.itemsize, array[lo:hi])
        for pieces in _rounds(bounds, _step(array))
        for q, (lo, hi) in enumerate(pieces)
        if hi > lo
    ]


def _rooted(
    world: World,
    root: int,
    bounds: Sequence[int],
    at_root: np.ndarray | None,
    own: np.ndarray,
    *,
    to_root: bool,
) -> list[Transfer]:
    """Block q (``[bounds[q], bounds[q + 1])`` of root's ``at_root``) between the root and
    rank q's ``own`` (that block alone), for every q but the root: from q to the root with
    ``to_root`` (gather), from the root to q without (scatter)."""
    r = world.rank
    transfers: list[Transfer] = []
    for pieces in _rounds(bounds, _step(own)):
        for q, (lo, hi) in enumerate(pieces):
            if hi <= lo or q == root:
                continue
            if r == root:
                assert at_root is not None
                piece: np.ndarray | None = at_root[lo:hi]
            else:
                piece = own[lo - bounds[q] : hi - bounds[q]] if r == q else None
            writer, readers = (q, (root,)) if to_root else (root, (q,))
            transfers.append((writer, readers, (hi - lo) * own.itemsize, piece))
    return transfers


async def pipe_allgather(
    world: World,
    spec: OpSpec,
    gathered: np.ndarray,
    bounds: Sequence[int],
    *,
    agreed: bool = False,
) -> None:
    """Every rank's block into ``gathered`` (rank i's at ``[bounds[i], bounds[i + 1])``, any
    sizes; this rank's already in place): each rank streams its block to all the others.
    ``agreed``: the call was published and checked on the segment already (allgatherv's
    counts), so the stream starts without a publication of its own."""
    stream = (
        _Stream(world, spec, agreed=True) if agreed else await _start(world, spec, gathered.nbytes)
    )
    await stream.run(_to_all(world, bounds, gathered))
    await _end(stream)


async def pipe_gather(
    world: World,
    spec: OpSpec,
    flat: np.ndarray,
    gathered: np.ndarray | None,
    root: int,
    *,
    in_place: bool,
) -> None:
    """Every rank's ``flat`` into root's ``gathered`` (``in_place``: the root's ``flat`` is
    its block of it already): each rank streams its block to the root, which copies its
    own block directly at the end (see :func:`_end`)."""
    n, r, count = world.size, world.rank, flat.shape[0]
    stream = await _start(world, spec, flat.nbytes)
    bounds = [q * count for q in range(n + 1)]
    await stream.run(_rooted(world, root, bounds, gathered, flat, to_root=True))
    own = None
    if r == root and not in_place:
        assert gathered is not None
        own = (gathered[r * count : (r + 1) * count], flat)
    await _end(stream, own)


async def pipe_scatter(
    world: World, spec: OpSpec, blocks: np.ndarray | None, out: np.ndarray, root: int
) -> None:
    """Root's ``blocks`` (``n * out.size`` elements), block i streamed to rank i's ``out``;
    the root copies its own block directly at the end (see :func:`_end`). The call was
    published already (the scatter's header round, which also agreed on it), so this only
    streams, then waits for every rank's done word."""
    n, r, count = world.size, world.rank, out.shape[0]
    stream = _Stream(world, spec, agreed=True)
    bounds = [q * count for q in range(n + 1)]
    await stream.run(_rooted(world, root, bounds, blocks, out, to_root=False))
    own = None
    if r == root:
        assert blocks is not None
        own = (out, blocks[r * count : (r + 1) * count])
    await _end(stream, own)


async def pipe_alltoall(world: World, spec: OpSpec, flat: np.ndarray, out: np.ndarray) -> None:
    """Block j of every rank's ``flat`` (``n`` blocks) to rank j, streamed into block i of
    its ``out`` for rank i's; each rank copies its own block directly at the end (see
    :func:`_end`)."""
    n, r = world.size, world.rank
    count = flat.shape[0] // n
    stream = await _start(world, spec, flat.nbytes)
    step = _step(flat)

    def mine(writer: int, reader: int, start: int, stop: int) -> np.ndarray | None:
        if r == writer:
            return flat[reader * count + start : reader * count + stop]
        if r == reader:
            return out[writer * count + start : writer * count + stop]
        return None

    await stream.run(
        (writer, (reader,), (stop - start) * flat.itemsize, mine(writer, reader, start, stop))
        for start, stop in _pieces(0, count, step)
        for shift in range(1, n)
        for writer in range(n)
        for reader in [(writer + shift) % n]
    )
    await _end(stream, (out[r * count : (r + 1) * count], flat[r * count : (r + 1) * count]))


def _reductions(
    world: World, flat: np.ndarray, bounds: Sequence[int], result: np.ndarray
) -> list[Transfer]:
    """The first half of every reduction through the pipe: piece c of block r of every
    rank's ``flat``, from the ranks r - 1, r - 2, ... in turn, to rank r, which reduces it
    into ``result`` (its block r, which holds its own values already). Each element is
    reduced on one rank only, in an order fixed by the world size, so it ends up bitwise
    identical wherever it is copied to."""
    n, r, itemsize, step = world.size, world.rank, flat.itemsize, _step(flat)
    lo_r = bounds[r]
    transfers: list[Transfer] = []
    for pieces in _rounds(bounds, step):
        for shift in range(1, n):
            for reader, (lo, hi) in enumerate(pieces):
                if hi <= lo:
                    continue
                writer = (reader - shift) % n
                mine = (
                    flat[lo:hi]
                    if r == writer
                    else result[lo - lo_r : hi - lo_r]
                    if r == reader
                    else None
                )
                transfers.append((writer, (reader,), (hi - lo) * itemsize, mine))
    return transfers


async def pipe_allreduce(
    world: World, spec: OpSpec, flat: np.ndarray, reduce: np.ufunc, *, divide: bool
) -> None:
    """Allreduce through the pipe: rank r reduces block r (``1/n`` of the array) of every
    rank's array, streamed to it piece by piece, into its own (see :func:`_reductions`),
    then streams the finished block to every other rank. The result is bitwise identical
    on every rank. Scratch: none beyond the ring."""
    n, r = world.size, world.rank
    total = flat.shape[0]
    bounds = [i * total // n for i in range(n + 1)]
    lo, hi = bounds[r], bounds[r + 1]
    stream = await _start(world, spec, flat.nbytes)
    await stream.run(_reductions(world, flat, bounds, flat[lo:hi]), reduce)
    if divide:
        np.divide(flat[lo:hi], n, out=flat[lo:hi])
    await stream.run(_to_all(world, bounds, flat))
    await _end(stream)


async def pipe_reduce_scatter(
    world: World,
    spec: OpSpec,
    flat: np.ndarray,
    bounds: list[int],
    out: np.ndarray,
    reduce: np.ufunc,
    *,
    divide: bool,
) -> None:
    """Reduce-scatter through the pipe: the first half of :func:`pipe_allreduce`, into
    ``out`` (this rank's block of ``flat``, copied there first). Blocks may differ in size
    (reduce_scatterv)."""
    r = world.rank
    stream = await _start(world, spec, flat.nbytes)
    out[...] = flat[bounds[r] : bounds[r + 1]]
    await stream.run(_reductions(world, flat, bounds, out), reduce)
    if divide:
        np.divide(out, world.size, out=out)
    await _end(stream)


async def pipe_reduce(
    world: World, spec: OpSpec, flat: np.ndarray, root: int, reduce: np.ufunc, *, divide: bool
) -> None:
    """Reduce through the pipe: as :func:`pipe_allreduce`, but a rank other than ``root``
    reduces its block into a new array (its input is only read), and only the root
    receives the finished blocks, into its ``flat``. Scratch: on a non-root, its block."""
    n, r = world.size, world.rank
    total = flat.shape[0]
    bounds = [i * total // n for i in range(n + 1)]
    lo, hi = bounds[r], bounds[r + 1]
    mine = flat[lo:hi] if r == root else flat[lo:hi].copy()
    stream = await _start(world, spec, flat.nbytes)
    await stream.run(_reductions(world, flat, bounds, mine), reduce)
    if divide:
        np.divide(mine, n, out=mine)
    await stream.run(_rooted(world, root, bounds, flat, mine, to_root=True))
    await _end(stream)
