"""The collective algorithms: ring allreduce, binomial-tree broadcast, dissemination barrier.

They know peers (:class:`~trioring._framing.Link`) and buffers, never sockets. Each one
sends and receives concurrently (one task per direction), so that no rank ever waits for its
own send to finish before it receives: that would deadlock on unbuffered streams and stall on
full socket buffers. Arrays are processed in chunks of ``chunk_bytes`` so large arrays stream
through the ring or tree instead of being sent whole at every step.
"""

from __future__ import annotations

import math
import os
import struct
import time
from typing import TYPE_CHECKING, final

import attrs
import numpy as np
import trio

from . import _cma
from ._concurrency import run_concurrently
from ._framing import SPIN_SLICE_SECONDS, pack_data_header
from ._shm import BROKEN

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Iterator

    from ._framing import Link, OpSpec
    from ._shm import SharedSlots

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
    shm_plans: dict[tuple[int, np.dtype, int], _ReducePlan] = attrs.field(factory=dict)
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


# -- cross-memory attach ---------------------------------------------------------------------
#
# Ranks on one host read each other's arrays directly (see _cma), so each byte is copied once.
# Frames still carry every step's identity (mismatches raise as with sockets), and they order
# the memory accesses: a rank reads a region of a peer's array only after the peer said the
# region holds what the step needs, and it returns only after every peer said it has finished
# reading its array, so a caller may overwrite the array as soon as the call returns.

#: How long a copy may hold the thread before it lets other tasks run.
_SCHEDULE_EVERY_SECONDS = 0.001

_ANNOUNCE = struct.Struct("<QQ")  # address of the array's data, its size in bytes


def _parse_announce(link: Link, spec: OpSpec, data: bytearray, nbytes: int) -> int:
    address, announced = _ANNOUNCE.unpack(data)
    if announced != nbytes:
        raise link.protocol_error(
            spec, f"announced an array of {announced} bytes, expected {nbytes}"
        )
    return int(address)


async def _read(world: World, spec: OpSpec, peer: int, address: int, into: np.ndarray) -> None:
    """Copy ``into.nbytes`` bytes from ``address`` in ``peer``'s memory into ``into``, chunk by
    chunk. Cancellation is noticed after every chunk; other tasks get to run at least every
    millisecond (a schedule point after each chunk would cost more than the copy itself at a
    few MiB)."""
    assert world.peer_pids is not None
    pid = world.peer_pids[peer]
    local = into.ctypes.data
    done, total = 0, into.nbytes
    since = time.perf_counter()
    while done < total:
        step = min(world.chunk_bytes, total - done)
        try:
            _cma.read_into(pid, address + done, local + done, step)
        except _cma.CmaError as exc:
            raise world.links[peer].memory_failed(spec, exc) from exc
        done += step
        if time.perf_counter() - since >= _SCHEDULE_EVERY_SECONDS:
            await trio.lowlevel.checkpoint()
            since = time.perf_counter()
        else:
            await trio.lowlevel.checkpoint_if_cancelled()


async def cma_allreduce(
    world: World,
    spec: OpSpec,
    flat: np.ndarray,
    reduce: np.ufunc,
    *,
    divide: bool,
) -> None:
    """Allreduce by direct reads: rank r reduces segment r of the array, reading that segment
    of every peer's array chunk by chunk (own values first, then peers in rank order); then
    it copies every other finished segment from the rank that owns it.

    Each segment is computed on one rank only and copied from there, so the result is
    bitwise identical on every rank. Frames: step 0 announces the array's address, step 1
    says "my segment is final" (after which peers read it, and we may overwrite theirs in
    ours), step 2 says "done reading yours". Each rank sends a step to every peer before it
    waits for that step from any, so one task does it all, without deadlock: starting tasks
    and passing frames between them cost more than the copies at a few MiB. An abort frame
    from a peer other than the one being waited for is still seen, by the watch that a long
    wait keeps on the idle links (``Link._park``). Scratch: one chunk.
    """
    n, r = world.size, world.rank
    peers = [q for q in range(n) if q != r]
    itemsize = flat.dtype.itemsize
    total = flat.shape[0]
    bounds = [i * total // n for i in range(n + 1)]
    addresses: dict[int, int] = {}
    empty = memoryview(b"")
    announce = bytearray(_ANNOUNCE.size)
    mine = memoryview(_ANNOUNCE.pack(flat.ctypes.data, flat.nbytes))
    # The waits for the peers' frames poll briefly like any receive (see Link._recv_some).
    # Parking at once looked right, since the peer waited for is copying megabytes, but the
    # poll's first try yields the CPU, often to that very peer, and a wake-up through the
    # event loop costs more: parking made 1 MiB at world 4 on 2 cores 1.8x slower (4 MiB
    # 1.3x, world 2 4 MiB 1.2x; 64 MiB unchanged).
    for peer in peers:
        await world.links[peer].send(spec, 0, mine)
    chunk = max(1, world.chunk_bytes // itemsize)
    scratch = world.scratch[: chunk * itemsize].view(flat.dtype)
    lo, hi = bounds[r], bounds[r + 1]
    # Overflow to inf is a valid result, as in ring_allreduce.
    with np.errstate(all="ignore"):
        for peer in peers:
            link = world.links[peer]
            await link.recv(spec, 0, memoryview(announce))
            addresses[peer] = address = _parse_announce(link, spec, announce, flat.nbytes)
            for offset, count in _chunks(lo, hi, chunk):
                if not count:
                    continue
                incoming = scratch[:count]
                await _read(world, spec, peer, address + offset * itemsize, incoming)
                target = flat[offset : offset + count]
                reduce(target, incoming, out=target)
        if divide:
            np.divide(flat[lo:hi], n, out=flat[lo:hi])
    for peer in peers:
        await world.links[peer].send(spec, 1, empty)
    for peer in peers:
        await world.links[peer].recv(spec, 1, empty)
        start, stop = bounds[peer], bounds[peer + 1]
        if stop > start:
            await _read(world, spec, peer, addresses[peer] + start * itemsize, flat[start:stop])
    for peer in peers:
        await world.links[peer].send(spec, 2, empty)
    # The peers have finished reading our array: only now may we return.
    for peer in peers:
        await world.links[peer].recv(spec, 2, empty)


async def cma_broadcast(world: World, spec: OpSpec, flat: np.ndarray, root: int) -> None:
    """Broadcast by direct reads: the root announces its array's address (step 0), every
    other rank copies it and says so (step 1); the root returns when all have, listening to
    every peer at once. The caller's barrier round has already checked that every rank
    agrees on ``root``."""
    n, r = world.size, world.rank
    empty = memoryview(b"")
    if r == root:
        peers = [q for q in range(n) if q != r]
        mine = memoryview(_ANNOUNCE.pack(flat.ctypes.data, flat.nbytes))
        for peer in peers:
            await world.links[peer].send(spec, 0, mine)

        def listener(peer: int) -> Callable[[], Awaitable[None]]:
            async def listen() -> None:
                await world.links[peer].recv(spec, 1, empty)

            return listen

        await run_concurrently(*(listener(peer) for peer in peers))
        return
    link = world.links[root]
    data = bytearray(_ANNOUNCE.size)
    await link.recv(spec, 0, memoryview(data))
    address = _parse_announce(link, spec, data, flat.nbytes)
    await _read(world, spec, root, address, flat.view(np.uint8))
    await link.send(spec, 1, empty)


# -- shared memory -------------------------------------------------------------------------
#
# Small collectives between ranks on one host go through a shared segment (see _shm): each
# rank writes its payload and the frame header of the call into its slot, then publishes the
# sequence number; every rank waits until all peers have published, checks that each peer's
# header names the same call (a mismatch raises as with sockets), and reads what it needs.
# No frame crosses a socket, so nothing needs a system call, and a wait ends as soon as the
# last peer's store lands. The connections stay open and watched: a peer that gives up sends
# its abort frame there, and one that dies closes them.

#: A wait on the segment polls (yielding the CPU between looks) at least this long before it
#: parks: parked, it only wakes on the event loop's timer, whose resolution is a millisecond.
SHM_SPIN_SECONDS = 0.001
#: How long a parked wait sleeps before it looks at the segment again.
_SHM_PARK_SECONDS = 0.001


def _shm_publish(world: World, spec: OpSpec, nbytes: int) -> None:
    """Publish ``spec``'s call, whose payload (``nbytes``) the caller has already written
    into this rank's slot."""
    slots = world.shm
    assert slots is not None
    pack_data_header(slots.headers[spec.seq & 1][world.rank], spec, 0, nbytes)
    # Last: a peer that sees the sequence number also sees the slot (see _shm).
    slots.seqs[slots.own_word] = spec.seq


async def _shm_wait(world: World, spec: OpSpec) -> None:
    """Return once every peer has published ``spec``'s call; raise the precise error if a
    peer published another call, gave up, or died."""
    slots = world.shm
    assert slots is not None
    seq, seqs = spec.seq, slots.seqs
    for word in slots.peer_words:
        if seqs[word] < seq:
            await _shm_poll(world, spec, [w for w in slots.peer_words if seqs[w] < seq])
            break
    headers = slots.headers[seq & 1]
    mine = headers[world.rank]
    for peer, word in zip(slots.peers, slots.peer_words, strict=True):
        if seqs[word] == BROKEN:
            # It gave up (cancelled, or failed elsewhere) after or instead of publishing:
            # its abort frame says why. Completing with it would hide that until the next
            # call, and a peer that gave up before we arrived may not have published at all.
            link = world.links[peer]
            await link.recv(spec, 0, memoryview(b""))
            raise link.protocol_error(spec, "gave up on the shared segment but sent no reason")
        if headers[peer] != mine:
            raise world.links[peer].header_mismatch(spec, headers[peer])


async def _shm_poll(world: World, spec: OpSpec, late: list[int]) -> None:
    slots = world.shm
    assert slots is not None
    seq, seqs = spec.seq, slots.seqs
    any_link = next(iter(world.links.values()))
    waits = any_link.waits
    start = time.perf_counter()
    deadline = start + max(SHM_SPIN_SECONDS, any_link.spin_seconds)
    slice_end = start + SPIN_SLICE_SECONDS
    statistics = trio.lowlevel.current_statistics
    tries = 0
    while True:
        # The first look after a yield: most waits end here, often because the yield let
        # the very peer we wait for run.
        os.sched_yield()
        late = [word for word in late if seqs[word] < seq]
        if not late:
            return
        now = time.perf_counter()
        if now >= deadline:
            break
        tries += 1
        # Asking Trio for its statistics costs several yields, so only every 4th look.
        if now >= slice_end or (tries % 4 == 0 and statistics().tasks_runnable):
            await _shm_check_links(world, spec, late)
            waits.count += 1
            # Who is late is noted only before a checkpoint, the one place a cancellation
            # can reach this wait: a wait that ends in the first looks pays nothing for it.
            _shm_waiting(world, spec, late)
            await trio.lowlevel.checkpoint()
            world.shm_waiting = None
            _shm_check_open(world, spec)
            slice_end = time.perf_counter() + SPIN_SLICE_SECONDS
    while True:
        await _shm_check_links(world, spec, late)
        waits.count += 1
        _shm_waiting(world, spec, late)
        try:
            with trio.move_on_after(_SHM_PARK_SECONDS):
                await trio.lowlevel.wait_readable(slots.events.fileno())
        except trio.ClosedResourceError:
            pass  # closed by another task: reported just below
        world.shm_waiting = None
        _shm_check_open(world, spec)
        late = [word for word in late if seqs[word] < seq]
        if not late:
            return


def _shm_waiting(world: World, spec: OpSpec, late: list[int]) -> None:
    """Note, for :func:`awaited_ranks`, that ``spec`` waits on the segment for the peers
    whose sequence words are ``late``."""
    next(iter(world.links.values())).waits.begin(spec.seq)
    world.shm_waiting = spec
    world.shm_late = late


def _shm_check_open(world: World, spec: OpSpec) -> None:
    slots = world.shm
    if slots is None or slots.closed:
        raise next(iter(world.links.values())).closed_error(spec)


async def _shm_check_links(world: World, spec: OpSpec, late: list[int]) -> None:
    """Raise the error that a connection holds, if one has something to read while peers
    have still not published. Nothing legitimate can be there: a peer sends the frames of
    its next call only after finishing this one, which needs every rank's publication."""
    slots = world.shm
    assert slots is not None
    _shm_check_open(world, spec)
    events = slots.events.poll(0)
    if not events:
        return
    seqs, seq = slots.seqs, spec.seq
    if all(seqs[word] >= seq for word in late):
        return  # everyone published meanwhile: what arrived belongs to the next call
    link = world.links[slots.link_of_fd[events[0][0]]]
    # Reads the frame: an abort frame, end of stream or another call's frame raises the
    # error it means.
    await link.recv(spec, 0, memoryview(b""))
    raise link.protocol_error(spec, "sent a frame during a shared-memory collective")


async def shm_barrier(world: World, spec: OpSpec) -> None:
    """:func:`barrier` through the shared segment: publish, wait for all."""
    _shm_publish(world, spec, 0)
    await _shm_wait(world, spec)


async def shm_broadcast(world: World, spec: OpSpec, flat: np.ndarray, root: int) -> None:
    """:func:`broadcast` through the shared segment: the root publishes its array, every
    rank publishes the call (so ranks that disagree about ``root`` raise), and the others
    copy the root's slot."""
    slots = world.shm
    assert slots is not None
    rows = slots.rows(spec.seq & 1, flat.dtype, flat.shape[0])
    if world.rank == root:
        rows[root] = flat
    _shm_publish(world, spec, flat.nbytes)
    await _shm_wait(world, spec)
    if world.rank != root:
        flat[...] = rows[root]


@final
@attrs.frozen
class _ReducePlan:
    """The views one shared-memory allreduce of a given slot, dtype and length works with,
    made once (see :func:`shm_allreduce`)."""

    #: (source, destination) of the leaves that are not folded (non-power-of-two worlds).
    fill: tuple[np.ndarray, np.ndarray] | None
    #: (a, b, out) of each level but the last.
    steps: tuple[tuple[np.ndarray, np.ndarray, np.ndarray], ...]
    #: The last level's two operands, reduced into the caller's array.
    last: tuple[np.ndarray, np.ndarray]


def _reduce_plan(world: World, rows: np.ndarray) -> _ReducePlan:
    """Recursive doubling's order of operations over the ``(n, count)`` slot rows: leaf r is
    ``reduce(row r, row r + p)`` for the ranks folded in, then neighbours pair up, lower
    first, level by level. Intermediate levels alternate between two halves of scratch."""
    n, count = rows.shape
    itemsize = rows.dtype.itemsize
    p = 1 << (n.bit_length() - 1)
    extra = n - p
    half = p * count * itemsize

    def scratch(index: int, size: int) -> np.ndarray:
        start = index * half
        return (
            world.scratch[start : start + size * count * itemsize]
            .view(rows.dtype)
            .reshape(size, count)
        )

    fill = None
    steps = []
    level, index = rows, 0
    if extra:
        level = scratch(index, p)
        steps.append((rows[:extra], rows[p:], level[:extra]))
        fill = (rows[extra:p], level[extra:])
        index = 1
    size = p
    while size > 2:
        size //= 2
        out = scratch(index, size)
        steps.append((level[0 : 2 * size : 2], level[1 : 2 * size : 2], out))
        level, index = out, 1 - index
    return _ReducePlan(fill, tuple(steps), (level[0], level[1]))


async def shm_allreduce(
    world: World,
    spec: OpSpec,
    flat: np.ndarray,
    reduce: np.ufunc,
    *,
    divide: bool,
) -> None:
    """Allreduce through the shared segment: every rank publishes its array, then reduces
    all of them in recursive doubling's order (see :func:`_reduce_plan`), so the result is
    bitwise identical on every rank, and to the socket path's. Needs ``2 p`` arrays' worth of
    scratch, ``p`` the largest power of two <= n."""
    slots = world.shm
    assert slots is not None
    parity = spec.seq & 1
    rows = slots.rows(parity, flat.dtype, flat.shape[0])
    rows[world.rank] = flat
    _shm_publish(world, spec, flat.nbytes)
    await _shm_wait(world, spec)
    key = (parity, flat.dtype, flat.shape[0])
    plan = world.shm_plans.get(key)
    if plan is None:
        if len(world.shm_plans) >= 8:
            world.shm_plans.clear()
        plan = world.shm_plans[key] = _reduce_plan(world, rows)
    with np.errstate(all="ignore"):
        if plan.fill is not None:
            plan.fill[1][...] = plan.fill[0]
        for a, b, out in plan.steps:
            reduce(a, b, out=out)
        reduce(*plan.last, out=flat)
        if divide:
            np.divide(flat, world.size, out=flat)
