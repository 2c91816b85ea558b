"""Collectives through the shared segment's slots between the ranks of one host (see _shm):
each rank writes its payload and the frame header of the call into its slot, then publishes
the sequence number; every rank waits until all peers have published, checks that each
peer's header names the same call (a mismatch raises as with sockets), and reads what it
needs. No frame crosses a socket, so nothing needs a system call, and a wait ends as soon
as the last peer's store lands. The connections stay open and watched: a peer that gives up
sends its abort frame there, and one that dies closes them. Here: the publication and its
waits, which _shm_reductions, _pipe, _copies and _cma_collectives use too; the barrier and
the broadcast."""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING

import trio

from .._framing import SPIN_SLICE_SECONDS
from .._wire import pack_data_header
from ._cpus import cpu_vendor
from ._shm import (
    BROKEN,
    FINISHED,
    LINE,
    PRODUCED,
    PROGRESS_BITS,
    SLOT_PAYLOAD_BYTES,
    broadcast_piece_bytes,
    slot_pieces_from_bytes,
)

if TYPE_CHECKING:
    import numpy as np

    from .._algorithms import World
    from .._wire import OpSpec

__all__ = [
    "SHM_SPIN_SECONDS",
    "shm_barrier",
    "shm_broadcast",
    "shm_claim",
    "shm_done",
    "shm_exchange",
    "shm_finish",
    "shm_point",
    "shm_publish",
    "shm_reach",
    "shm_ready",
    "shm_wait",
    "slot_pieces",
]


#: A wait on the segment polls (yielding the CPU between looks) at least this long before it
#: parks: parked, it sleeps in the event loop until a peer's store wakes it through this
#: rank's eventfd (see SharedSlots.wake_parked), a system call on each side.
SHM_SPIN_SECONDS = 0.001
#: How often a wait that polls asks Trio whether other tasks are runnable (to let them run),
#: where each rank has a core of its own: the question (``current_statistics()``) takes
#: 1.6 us here, where a look takes about 0.3 (``sched_yield`` and a load). Asked every
#: fourth look, as before, it took half of a long wait's time and made the wait end late: a
#: 256 KiB broadcast at world 2, whose other rank waits out the root's copy, took 33.5-34.9
#: us against 30.7-32.5 asking every 10 us (25 us: 30.5-30.6), a 256 KiB reduce 37.2-38.3
#: against 33.6-36.1 (``bench/thresholds.py broadcast shm 64K,256K 7 --each``, seven and
#: five launches alternating with the code before; 64 KiB within the spread). With more
#: ranks than cores a wait asks every fourth look still: asking less often, its looks came
#: faster and each yielded the core to a rank with nothing to do either, and at world 4 on
#: 2 cores a 64 KiB allreduce took 145.6-149.5 us against 128.0-132.7.
_SPIN_ASK_SECONDS = 10e-6
#: How long a parked wait sleeps at most before it looks at the segment again. A store can
#: miss the park: x86 lets each side's load of the other's word pass its own earlier store,
#: so a peer may store its word and read no park while this rank parks and reads the old
#: word. That race is rare, and this bounds what it costs.
_SHM_PARK_SECONDS = 0.001
#: Through the slots, a broadcast of more bytes goes piece by piece where no rank is crowded
#: (on this machine's CPUs: see _shm.slot_pieces_from_bytes): compared first, so that
#: smaller ones pay one comparison.
_PIECES_FROM_BYTES = slot_pieces_from_bytes(cpu_vendor())


def slot_pieces() -> bool:
    """Whether a broadcast through the slots goes in pieces on this machine's CPUs where no
    rank is crowded (see _shm.slot_pieces_from_bytes): the same on every rank."""
    return _PIECES_FROM_BYTES < SLOT_PAYLOAD_BYTES


async def shm_claim(world: World, spec: OpSpec) -> None:
    """Wait until this rank's slot of ``spec``'s parity is free: every peer has finished
    reading the collective that last used it (see _shm). Call before writing the slot."""
    slots = world.shm
    assert slots is not None
    parity = spec.seq & 1
    previous = slots.last_used[parity]
    slots.last_used[parity] = spec.seq
    seqs = slots.seqs
    for word in slots.peer_done:
        if seqs[word] < previous:
            late = [w for w in slots.peer_done if seqs[w] < previous]
            await _shm_poll(world, spec, late, previous)
            return


def shm_done(world: World, spec: OpSpec) -> None:
    """Say that this rank has finished reading the slots of ``spec``'s call."""
    slots = world.shm
    assert slots is not None
    slots.store(slots.own_done, spec.seq)


def shm_publish(world: World, spec: OpSpec, nbytes: int) -> None:
    """Publish ``spec``'s call, whose payload (``nbytes``) the caller has already written
    into this rank's slot."""
    slots = world.shm
    assert slots is not None
    pack_data_header(slots.headers[spec.seq & 1][world.rank], spec, 0, nbytes)
    # Last: a peer that sees the sequence number also sees the slot (see _shm).
    slots.store(slots.own_word, spec.seq)


async def shm_wait(world: World, spec: OpSpec, *, pointed: bool = False) -> None:
    """Return once every peer has published ``spec``'s call; raise the precise error if a
    peer published another call, gave up, or died. ``pointed``: the call took its schedule
    point already (:func:`shm_point`), so the wait's first look polls."""
    slots = world.shm
    assert slots is not None
    seq, seqs = spec.seq, slots.seqs
    for word in slots.peer_words:
        if seqs[word] < seq:
            late = [w for w in slots.peer_words if seqs[w] < seq]
            await _shm_poll(world, spec, late, pointed=pointed)
            break
    headers = slots.headers[seq & 1]
    mine = headers[world.rank]
    for peer, word in zip(slots.peers, slots.peer_words, strict=True):
        if seqs[word] == BROKEN and seqs[word + FINISHED] < seq:
            # It gave up (cancelled, or failed elsewhere) in this call or before it: its
            # abort frame says why. One that finished this call and gave up in a later one
            # (we were slow to look) saw it complete, and so do we: its slot stands, and its
            # later call's error reaches us in our next one.
            link = world.links[peer]
            await link.recv(spec, 0, memoryview(b""))
            raise link.protocol_error(spec, "gave up on the shared segment but sent no reason")
        if headers[peer] != mine:
            raise world.links[peer].header_mismatch(spec, headers[peer])


async def shm_ready(world: World, spec: OpSpec) -> None:
    """Say that this rank's part of ``spec``'s call is ready for the peers to read, and
    return once every peer has said so of its own (see READY)."""
    slots = world.shm
    assert slots is not None
    slots.store(slots.own_ready, spec.seq)
    await shm_reach(world, spec, slots.peer_ready)


async def shm_finish(world: World, spec: OpSpec, *, park: bool = False) -> None:
    """:func:`shm_done`, then return once every peer has said the same: no peer is still
    reading what this rank exposed of ``spec``'s call (its slot, or its arrays by
    cross-memory attach), and none gave up in the call (that raises its reason). Every rank
    waits for every rank, so one that returns has seen all done words at ``spec``'s
    sequence number, and a frame of its next call that reaches a peer still waiting here is
    recognised as such (see :func:`_shm_check_links`). ``park``: the wait parks at once
    instead of polling first (a broadcast's root while its readers read in threads, which
    need the CPU it would poll on)."""
    slots = world.shm
    assert slots is not None
    seq, seqs = spec.seq, slots.seqs
    slots.store(slots.own_done, seq)
    await shm_reach(world, spec, slots.peer_done, park=park)
    for peer, word in zip(slots.peers, slots.peer_words, strict=True):
        if seqs[word + 1] == BROKEN and seqs[word + FINISHED] < seq:
            # It gave up before it finished this call: its abort frame says why.
            link = world.links[peer]
            await link.recv(spec, 0, memoryview(b""))
            raise link.protocol_error(spec, "gave up on the shared segment but sent no reason")


async def shm_reach(
    world: World, spec: OpSpec, words: list[int], target: int = 0, *, park: bool = False
) -> None:
    """Return once every word of ``words`` has reached ``target`` (default: ``spec``'s
    sequence number), as :func:`shm_wait` does inline on the small collectives' path. A
    peer that gives up or dies never writes its word, but its abort frame (or closed
    connection) ends the wait with the error it means. ``park``: see :func:`shm_finish`."""
    slots = world.shm
    assert slots is not None
    seq, seqs = target or spec.seq, slots.seqs
    for word in words:
        if seqs[word] < seq:
            late = [w for w in words if seqs[w] < seq]
            await _shm_poll(world, spec, late, seq, park=park)
            return


async def _shm_poll(
    world: World,
    spec: OpSpec,
    late: list[int],
    target: int = 0,
    *,
    pointed: bool = False,
    park: bool = False,
) -> None:
    """Wait until every word of ``late`` reaches ``target`` (default: ``spec``'s seq);
    ``park``: after one look, without polling."""
    slots = world.shm
    assert slots is not None
    seq, seqs = target or spec.seq, slots.seqs
    any_link = next(iter(world.links.values()))
    waits = any_link.waits
    if not slots.oversubscribed and not pointed:
        # The first look is the call's schedule point (which it owes anyway: _run skips its
        # own once a wait has counted), taken now, while the peers catch up, instead of
        # after the collective; unless the call took it already (shm_point). With more
        # ranks than cores the peer we wait for may need this very core, so there the
        # first look yields it instead (see SharedSlots).
        waits.count += 1
        _shm_waiting(world, spec, late)
        await trio.lowlevel.checkpoint()
        world.shm_waiting = None
        _shm_check_open(world, spec)
        late = [word for word in late if seqs[word] < seq]
        if not late:
            return
    start = time.perf_counter()
    deadline = start if park else start + max(SHM_SPIN_SECONDS, any_link.spin_seconds)
    slice_end = start + SPIN_SLICE_SECONDS
    statistics = trio.lowlevel.current_statistics
    ask_every = 0.0 if slots.oversubscribed else _SPIN_ASK_SECONDS
    ask_at = start + ask_every
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
        # Asking Trio for its statistics costs several looks: see _SPIN_ASK_SECONDS.
        tries += 1
        if ask_every:
            others = now >= ask_at
            if others:
                ask_at = now + ask_every
                others = statistics().tasks_runnable > 0
        else:
            others = tries % 4 == 0 and statistics().tasks_runnable > 0
        if now >= slice_end or others:
            await _shm_check_links(world, spec, late, seq)
            waits.count += 1
            # Who is late is noted only before a checkpoint, the one place a cancellation
            # can reach this wait: a wait that ends in the first looks pays nothing for it.
            _shm_waiting(world, spec, late)
            await trio.lowlevel.checkpoint()
            world.shm_waiting = None
            _shm_check_open(world, spec)
            slice_end = time.perf_counter() + SPIN_SLICE_SECONDS
    while True:
        await _shm_check_links(world, spec, late, seq)
        waits.count += 1
        _shm_waiting(world, spec, late)
        # Parked, a peer's store wakes this wait through the epoll set; a look after saying
        # so catches a store made before the peer could see it.
        slots.park()
        try:
            if any(seqs[word] < seq for word in late):
                with trio.move_on_after(_SHM_PARK_SECONDS):
                    await trio.lowlevel.wait_readable(slots.events.fileno())
        except trio.ClosedResourceError:
            pass  # closed by another task: reported just below
        finally:
            if not slots.closed:
                slots.unpark()
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


async def _shm_check_links(world: World, spec: OpSpec, late: list[int], target: int) -> None:
    """Raise the error that a connection holds, if one has something to read while peers
    have still not published. Nothing legitimate can be there: a peer sends the frames of
    its next call only after finishing this one, which needs every rank's publication."""
    slots = world.shm
    assert slots is not None
    _shm_check_open(world, spec)
    link_of_fd = slots.link_of_fd
    events = [event for event in slots.events.poll(0) if event[0] in link_of_fd]
    if not events:
        return
    seqs = slots.seqs
    if all(seqs[word] >= target for word in late):
        return  # everyone published meanwhile: what arrived belongs to the next call
    link = world.links[link_of_fd[events[0][0]]]
    # Reads the frame: an abort frame, end of stream or another call's frame raises the
    # error it means.
    await link.recv(spec, 0, memoryview(b""))
    raise link.protocol_error(spec, "sent a frame during a shared-memory collective")


async def shm_exchange(
    world: World,
    spec: OpSpec,
    flat: np.ndarray,
    *,
    write: bool = True,
    unread: tuple[int, int] | None = None,
    point: bool = False,
) -> tuple[int, np.ndarray]:
    """Publish ``flat`` (at most a slot) as this rank's part of ``spec``'s call and wait for
    every peer's: the first half of every collective in which ranks write their slot.
    Returns the slot parity and every rank's payload as ``(n, flat.size)`` rows; the caller
    reads what it needs, then calls :func:`shm_done`. What no peer reads stays out of this
    rank's slot: all of ``flat`` with ``write`` False (a gather's or a reduce's root), its
    elements ``[lo, hi)`` with ``unread`` (a reduce_scatter's own block). The publication
    still carries the call, and its size. ``point``: this rank waits for its peers' copies
    whatever happens (a reduce's root, which writes nothing), so it takes the call's
    schedule point right after its publication (:func:`shm_point`)."""
    slots = world.shm
    assert slots is not None
    parity = spec.seq & 1
    rows = slots.rows(parity, flat.dtype, flat.shape[0])
    await shm_claim(world, spec)
    if unread is not None:
        lo, hi = unread
        if lo:
            rows[world.rank, :lo] = flat[:lo]
        if hi < flat.shape[0]:
            rows[world.rank, hi:] = flat[hi:]
    elif write:
        rows[world.rank] = flat
    shm_publish(world, spec, flat.nbytes)
    if point:
        await shm_point(world, spec)
    await shm_wait(world, spec, pointed=point)
    return parity, rows


async def shm_barrier(world: World, spec: OpSpec) -> None:
    """:func:`barrier` through the shared segment: publish, wait for all."""
    await shm_claim(world, spec)
    shm_publish(world, spec, 0)
    await shm_wait(world, spec)
    shm_done(world, spec)


async def shm_point(world: World, spec: OpSpec) -> None:
    """Take ``spec``'s schedule point right after this rank's publication, on a rank that
    then waits on the segment for a peer whatever happens (a broadcast's other ranks wait
    for the root's copy); the wait (``shm_wait(pointed=True)``) then polls at its first
    look instead of taking it. The point overlaps the peer's work either way, but as a
    wait's first look it came after the wait's bookkeeping (the late peers, the wait's
    start time for a cancellation's message) and ended after the root had published: in a
    64 KiB broadcast at world 2 the other rank's checkpoint began 3.5-4.0 us after its
    publication, against 1.3 here, and the call ended 1.3-2.6 us sooner
    (``bench/critical_path.py``, runs alternating with the code before;
    ``bench/paired.py``: 4 KiB 6.6-6.8 times Open MPI's time against 7.7-8.2, 256 KiB
    1.10-1.12 against 1.15). That bookkeeping is done here only if the point is cancelled,
    and the wait's start is noted at its first later checkpoint. Not with more ranks than
    cores, where the point would take the core from the peer it waits for (see
    :func:`_shm_poll`)."""
    slots = world.shm
    assert slots is not None
    if slots.oversubscribed:
        return
    next(iter(world.links.values())).waits.count += 1  # _run then owes no point after
    try:
        await trio.lowlevel.checkpoint()
    except BaseException:
        # Cancelled here: name the peers this call was waiting for, as a wait does.
        seq, seqs = spec.seq, slots.seqs
        _shm_waiting(world, spec, [word for word in slots.peer_words if seqs[word] < seq])
        raise
    _shm_check_open(world, spec)


async def shm_broadcast(world: World, spec: OpSpec, flat: np.ndarray, root: int) -> None:
    """:func:`broadcast` through the shared segment: the root publishes its array, every
    rank publishes the call (so ranks that disagree about ``root`` raise), and the others
    copy the root's slot, taking their schedule point first (:func:`shm_point`); more than
    three pieces, where no rank is ``crowded`` and the CPU takes pieces
    (:func:`~._shm.slot_pieces_from_bytes`), piece by piece (:func:`_broadcast_pieces`)."""
    slots = world.shm
    assert slots is not None
    rows = slots.rows(spec.seq & 1, flat.dtype, flat.shape[0])
    await shm_claim(world, spec)
    if flat.nbytes > _PIECES_FROM_BYTES and not slots.crowded:
        piece = broadcast_piece_bytes(flat.nbytes, crowded=False)
        await _broadcast_pieces(world, spec, flat, root, rows[root], piece // flat.itemsize)
        return
    if world.rank == root:
        rows[root] = flat
    shm_publish(world, spec, flat.nbytes)
    if world.rank != root:
        await shm_point(world, spec)
    await shm_wait(world, spec, pointed=world.rank != root)
    if world.rank != root:
        flat[...] = rows[root]
    shm_done(world, spec)


async def _broadcast_pieces(
    world: World, spec: OpSpec, flat: np.ndarray, root: int, slot: np.ndarray, step: int
) -> None:
    """:func:`shm_broadcast` of ``flat`` in pieces of ``step`` elements through the root's
    ``slot`` (see _shm.BROADCAST_PIECE_MIN_BYTES): the root publishes the call first, then
    copies piece after piece in, its *produced* word holding ``seq << PROGRESS_BITS |
    pieces copied in`` as the pipe's does (a word left by an earlier call is always
    behind), while the others copy each piece out as it comes. The others check every
    publication before they read a piece, as always, the root after its copies; a root
    that gives up mid-copy ends the others' wait for a piece by its abort frame or closed
    connection, as any wait on the segment."""
    slots = world.shm
    assert slots is not None
    shm_publish(world, spec, flat.nbytes)
    base = spec.seq << PROGRESS_BITS
    if world.rank == root:
        produced = slots.own_word + PRODUCED
        for k, lo in enumerate(range(0, flat.shape[0], step), start=1):
            slot[lo : lo + step] = flat[lo : lo + step]
            slots.store(produced, base + k)
        await shm_wait(world, spec)
        shm_done(world, spec)
        return
    await shm_point(world, spec)
    await shm_wait(world, spec, pointed=True)
    seqs, word = slots.seqs, root * LINE // 8 + PRODUCED
    for k, lo in enumerate(range(0, flat.shape[0], step), start=1):
        if seqs[word] < base + k:
            # The call's schedule point is behind it (shm_point), so this polls at once.
            await _shm_poll(world, spec, [word], base + k, pointed=True)
        flat[lo : lo + step] = slot[lo : lo + step]
    shm_done(world, spec)
