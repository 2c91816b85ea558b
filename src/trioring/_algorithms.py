"""The collective algorithms: ring allreduce, binomial-tree broadcast, dissemination barrier.

They know peers (:class:`~trioring._framing.Link`) and buffers, never sockets. Each one
sends and receives concurrently (one task per direction), so that no rank ever waits for its
own send to finish before it receives: that would deadlock on unbuffered streams and stall on
full socket buffers. Arrays are processed in chunks of ``chunk_bytes`` so large arrays stream
through the ring or tree instead of being sent whole at every step.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, final

import attrs
import numpy as np
import trio

from ._concurrency import run_concurrently

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Iterator

    from ._framing import Link
    from ._onehost._shm import SharedSlots
    from ._onehost._shm_collectives import ReducePlan
    from ._wire import OpSpec

__all__ = ["World", "barrier", "broadcast", "ring_allreduce", "tree_neighbours"]


@final
@attrs.define(eq=False)
class World:
    """What an algorithm needs to know about this rank's place in the world."""

    rank: int
    size: int
    links: dict[int, Link]
    chunk_bytes: int
    scratch: np.ndarray[tuple[int], np.dtype[np.uint8]]
    #: Peer pids (from the kernel) when every pair of ranks agreed to use cross-memory
    #: attach at opening; None otherwise.
    peer_pids: dict[int, int] | None = None
    #: The shared segment for small collectives, when every rank agreed at opening to use
    #: one (see _shm); None otherwise.
    shm: SharedSlots | None = None
    #: The views of recent shared-memory allreduces, per (parity, dtype, count).
    shm_plans: dict[tuple[int, np.dtype, int], ReducePlan] = attrs.field(factory=dict)
    #: The collective whose wait on the segment is in a checkpoint, and the sequence words
    #: of the peers that had not published it then; left as they are when a cancellation
    #: ends the wait there, to name those peers (see :func:`awaited_ranks`).
    shm_waiting: OpSpec | None = None
    shm_late: list[int] = attrs.field(factory=list)
    _scratch_view: tuple[np.dtype, int, np.ndarray, memoryview] | None = None
    #: One element of any dtype, for one-element reductions (see recursive doubling).
    _spare: np.ndarray[tuple[int], np.dtype[np.uint8]] = attrs.field(
        factory=lambda: np.zeros(16, dtype=np.uint8)
    )
    _spare_view: tuple[np.dtype, np.ndarray, memoryview] | None = None

    def scratch_as(self, dtype: np.dtype, nbytes: int) -> tuple[np.ndarray, memoryview]:
        """The first ``nbytes`` of the scratch buffer as an array of ``dtype`` and as bytes.
        The last answer is kept: a program calls small collectives of one size over and over,
        and making the two views costs more than the rest of a 4-byte allreduce's arithmetic."""
        cached = self._scratch_view
        if cached is None or cached[0] != dtype or cached[1] != nbytes:
            array = self.scratch[:nbytes].view(dtype)
            cached = self._scratch_view = (dtype, nbytes, array, array.view(np.uint8).data)
        return cached[2], cached[3]

    def spare_as(self, dtype: np.dtype) -> tuple[np.ndarray, memoryview]:
        """A one-element array of ``dtype``, apart from the scratch buffer, and its bytes;
        kept like :meth:`scratch_as`."""
        cached = self._spare_view
        if cached is None or cached[0] != dtype:
            array = self._spare[: dtype.itemsize].view(dtype)
            cached = self._spare_view = (dtype, array, array.view(np.uint8).data)
        return cached[1], cached[2]


def awaited_ranks(world: World, spec: OpSpec) -> list[int]:
    """The peers that ``spec`` was waiting for when a cancellation ended its wait, in
    ascending order: those whose frame it was receiving, those whose connection would not
    take the rest of its send, and, on the shared segment, those that had not published the
    call yet. Read from what the waits left behind (see ``Link.receive_waiting``), so it
    costs nothing until a collective is cancelled."""
    ranks = {
        link.peer
        for link in world.links.values()
        if link.receive_waiting is spec or link.send_waiting is spec
    }
    slots = world.shm
    if slots is not None and world.shm_waiting is spec:
        late = set(world.shm_late)
        ranks.update(
            peer for peer, word in zip(slots.peers, slots.peer_words, strict=True) if word in late
        )
    return sorted(ranks)


def interrupted_wait(world: World, spec: OpSpec) -> str:
    """What the cancelled ``spec`` had been doing, as the end of a sentence: `` after 5.0 s
    while waiting for rank 2``. The time counts from the call's first wait; either part is
    left out where nothing was waited for."""
    if not world.links:
        return ""
    elapsed = next(iter(world.links.values())).waits.elapsed(spec.seq)
    text = "" if elapsed is None else f" after {_duration(elapsed)}"
    ranks = awaited_ranks(world, spec)
    if len(ranks) == 1:
        text += f" while waiting for rank {ranks[0]}"
    elif 1 < len(ranks) <= 3:
        text += f" while waiting for ranks {', '.join(map(str, ranks[:-1]))} and {ranks[-1]}"
    elif ranks:
        # A long list would drown the message; the lowest rank is where to look first.
        text += f" while waiting for rank {ranks[0]} and {len(ranks) - 1} others"
    return text


def _duration(seconds: float) -> str:
    # Tenths of seconds, as the rendezvous reports its waits; milliseconds for short scopes,
    # where "0.0 s" would say nothing.
    return f"{seconds:.1f} s" if seconds >= 0.1 else f"{seconds * 1000:.1f} ms"


def _chunks(lo: int, hi: int, chunk: int) -> Iterator[tuple[int, int]]:
    """(offset, count) pieces of [lo, hi). An empty range still yields one empty piece, so
    every link carries at least one frame per step and a mismatch never goes unnoticed."""
    if hi <= lo:
        yield lo, 0
        return
    for start in range(lo, hi, chunk):
        yield start, min(chunk, hi - start)


async def exchange(
    spec: OpSpec,
    to: Link,
    send_offset: int,
    payload: memoryview,
    frm: Link,
    recv_offset: int,
    into: memoryview,
) -> None:
    """Send one frame to ``to`` while receiving one from ``frm``. When the connection takes
    the whole frame at once (small frames nearly always), this starts no tasks at all, which
    is most of the cost of a small collective; otherwise the rest of the send and the
    receive run concurrently, so neither side can wait for the other's send to finish."""
    rest = to.start_send(spec, send_offset, payload)
    if rest is None:
        await frm.recv(spec, recv_offset, into)
        return
    unsent = rest

    async def send() -> None:
        await to.finish_send(spec, unsent)

    async def receive() -> None:
        await frm.recv(spec, recv_offset, into)

    await run_concurrently(send, receive)


def _bytes(flat: np.ndarray, offset: int, count: int) -> memoryview:
    return flat[offset : offset + count].view(np.uint8).data


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

    After reduce-scatter, rank r owns the finished segment (r+1) mod n; that segment is
    computed on that rank only (and, for a mean, divided by n there, once) and then copied
    to every rank by the all-gather, so the result is bitwise identical everywhere.

    One sender task streams chunks to the right; one receiver task takes chunks from the
    left, reduces them into place and hands each finished chunk to the sender for the next
    step, so steps pipeline chunk by chunk.
    """
    n, r = world.size, world.rank
    if n == 1:
        return  # the sum, min, max, product or mean of one array is itself
    total = flat.shape[0]
    itemsize = flat.dtype.itemsize
    chunk = max(1, world.chunk_bytes // itemsize)
    bounds = [i * total // n for i in range(n + 1)]
    left, right = world.links[(r - 1) % n], world.links[(r + 1) % n]
    scratch = world.scratch[: chunk * itemsize].view(flat.dtype)
    ready_send, ready_receive = trio.open_memory_channel[tuple[int, int]](math.inf)
    steps = 2 * (n - 1)

    def segment(index: int) -> Iterator[tuple[int, int]]:
        index %= n
        return _chunks(bounds[index], bounds[index + 1], chunk)

    async def sender() -> None:
        # The channel is deliberately not closed from this side: if a send fails, the receiver
        # may hand over one more chunk before it is cancelled, and that must not raise.
        for offset, count in segment(r):
            await right.send(spec, offset, _bytes(flat, offset, count))
        async for offset, count in ready_receive:
            await right.send(spec, offset, _bytes(flat, offset, count))

    async def receiver() -> None:
        # Overflow to inf is a valid result, and a warning would appear only on the rank that
        # happened to own the segment; MPI is silent too.
        with np.errstate(all="ignore"), ready_send:
            for step in range(steps):
                reducing = step < n - 1
                index = r - step - 1 if reducing else r - (step - (n - 1))
                for offset, count in segment(index):
                    target = flat[offset : offset + count]
                    if reducing:
                        incoming = scratch[:count]
                        await left.recv(spec, offset, incoming.view(np.uint8).data)
                        reduce(target, incoming, out=target)
                        if divide and step == n - 2:
                            np.divide(target, n, out=target)
                    else:
                        await left.recv(spec, offset, target.view(np.uint8).data)
                    if step < steps - 1:
                        ready_send.send_nowait((offset, count))

    await run_concurrently(sender, receiver)


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

    with np.errstate(all="ignore"):
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


def tree_neighbours(rank: int, size: int, root: int) -> tuple[int | None, list[int]]:
    """Parent and children of ``rank`` in the binomial tree rooted at ``root``.

    In "virtual" ranks v = (rank - root) mod n, v's parent is v with its lowest set bit
    cleared and its children are v + 2^k for every 2^k below that bit (largest subtree
    first), so the data reaches everyone in ceil(log2 n) rounds.
    """
    v = (rank - root) % size
    mask = 1
    parent = None
    while mask < size:
        if v & mask:
            parent = (v - mask + root) % size
            break
        mask <<= 1
    children = []
    mask >>= 1
    while mask > 0:
        if v + mask < size:
            children.append((v + mask + root) % size)
        mask >>= 1
    return parent, children


async def broadcast(world: World, spec: OpSpec, flat: np.ndarray, root: int) -> None:
    """Copy root's ``flat`` into every rank's ``flat`` along a binomial tree, chunk by chunk:
    each rank forwards a chunk to its children as soon as it has received it.

    Every non-root rank also sends its parent one empty frame (at offset ``count``) while it
    starts receiving, and every parent reads its children's frames while it sends. So every
    rank, the root included, both sends and receives something in each broadcast, and ranks
    that disagree about the root always find out in this call: two ranks that both believe
    they are the root, or that each believe the other is, see the other's frame and raise
    :class:`~trioring.CollectiveMismatchError` instead of returning different data or
    waiting for each other forever.
    """
    if world.size == 1:
        return
    parent, children = tree_neighbours(world.rank, world.size, root)
    chunk = max(1, world.chunk_bytes // flat.dtype.itemsize)
    pieces = list(_chunks(0, flat.shape[0], chunk))
    channels = [trio.open_memory_channel[tuple[int, int]](math.inf) for _ in children]
    hello_offset = flat.shape[0]
    empty = memoryview(b"")

    def child_sender(child: int, index: int) -> Callable[[], Awaitable[None]]:
        link = world.links[child]
        receive_channel = channels[index][1]

        async def send() -> None:
            # Not closed from this side, as in ring_allreduce's sender.
            async for offset, count in receive_channel:
                await link.send(spec, offset, _bytes(flat, offset, count))

        async def hello() -> None:
            # Read while sending, not after: a child that wrongly believes it is the root is
            # sending to us at the same time, and if neither side read until its own send was
            # done, large arrays would fill both socket buffers and deadlock.
            await link.recv(spec, hello_offset, empty)

        async def send_and_listen() -> None:
            await run_concurrently(send, hello)

        return send_and_listen

    async def receiver() -> None:
        send_channels = [send for send, _ in channels]
        try:
            for offset, count in pieces:
                if parent is not None:
                    await world.links[parent].recv(spec, offset, _bytes(flat, offset, count))
                for channel in send_channels:
                    channel.send_nowait((offset, count))
        finally:
            for channel in send_channels:
                channel.close()

    tasks = [receiver, *(child_sender(c, i) for i, c in enumerate(children))]
    if parent is not None:
        parent_link = world.links[parent]

        async def hello_to_parent() -> None:
            await parent_link.send(spec, hello_offset, empty)

        tasks.append(hello_to_parent)
    await run_concurrently(*tasks)


async def small_broadcast(world: World, spec: OpSpec, flat: np.ndarray, root: int) -> None:
    """:func:`broadcast` for arrays of one chunk at most, without tasks: receive from the
    parent, send to each child, then collect each child's empty frame and send ours to the
    parent. The order follows the tree, so it cannot deadlock even on unbuffered links;
    the caller's barrier round has already checked that every rank agrees on ``root``."""
    if world.size == 1:
        return
    parent, children = tree_neighbours(world.rank, world.size, root)
    raw = _bytes(flat, 0, flat.shape[0])
    hello_offset = flat.shape[0]
    empty = memoryview(b"")
    if parent is not None:
        await world.links[parent].recv(spec, 0, raw)
    for child in children:
        await world.links[child].send(spec, 0, raw)
    for child in children:
        await world.links[child].recv(spec, hello_offset, empty)
    if parent is not None:
        await world.links[parent].send(spec, hello_offset, empty)


async def barrier(world: World, spec: OpSpec) -> None:
    """Dissemination barrier: in round k every rank sends a token to rank + 2^k and waits for
    the token from rank - 2^k, for ceil(log2 n) rounds. No rank leaves before every rank has
    entered. Tokens are frames carrying the barrier's sequence number and the round (as the
    offset), and each is verified, so a token from an earlier barrier can never release a
    later one."""
    n, r = world.size, world.rank
    empty = memoryview(b"")
    distance, round_ = 1, 0
    while distance < n:
        to, frm = world.links[(r + distance) % n], world.links[(r - distance) % n]
        await exchange(spec, to, round_, empty, frm, round_, empty)
        distance, round_ = distance * 2, round_ + 1
