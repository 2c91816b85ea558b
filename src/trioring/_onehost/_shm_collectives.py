"""Barrier, allreduce and broadcast through the shared segment between the ranks of one
host."""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, final

import attrs
import numpy as np
import trio

from .._framing import SPIN_SLICE_SECONDS
from .._wire import pack_data_header
from ._shm import BROKEN

if TYPE_CHECKING:
    from .._algorithms import World
    from .._wire import OpSpec

__all__ = [
    "SHM_SPIN_SECONDS",
    "shm_allreduce",
    "shm_barrier",
    "shm_broadcast",
    "shm_claim",
    "shm_done",
    "shm_publish",
    "shm_wait",
]


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
    slots.seqs[slots.own_done] = spec.seq


def shm_publish(world: World, spec: OpSpec, nbytes: int) -> None:
    """Publish ``spec``'s call, whose payload (``nbytes``) the caller has already written
    into this rank's slot."""
    slots = world.shm
    assert slots is not None
    pack_data_header(slots.headers[spec.seq & 1][world.rank], spec, 0, nbytes)
    # Last: a peer that sees the sequence number also sees the slot (see _shm).
    slots.seqs[slots.own_word] = spec.seq


async def shm_wait(world: World, spec: OpSpec) -> None:
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


async def _shm_poll(world: World, spec: OpSpec, late: list[int], target: int = 0) -> None:
    """Wait until every word of ``late`` reaches ``target`` (default: ``spec``'s seq)."""
    slots = world.shm
    assert slots is not None
    seq, seqs = target or spec.seq, slots.seqs
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


async def _shm_check_links(world: World, spec: OpSpec, late: list[int], target: int) -> None:
    """Raise the error that a connection holds, if one has something to read while peers
    have still not published. Nothing legitimate can be there: a peer sends the frames of
    its next call only after finishing this one, which needs every rank's publication."""
    slots = world.shm
    assert slots is not None
    _shm_check_open(world, spec)
    events = slots.events.poll(0)
    if not events:
        return
    seqs = slots.seqs
    if all(seqs[word] >= target for word in late):
        return  # everyone published meanwhile: what arrived belongs to the next call
    link = world.links[slots.link_of_fd[events[0][0]]]
    # Reads the frame: an abort frame, end of stream or another call's frame raises the
    # error it means.
    await link.recv(spec, 0, memoryview(b""))
    raise link.protocol_error(spec, "sent a frame during a shared-memory collective")


async def shm_barrier(world: World, spec: OpSpec) -> None:
    """:func:`barrier` through the shared segment: publish, wait for all."""
    await shm_claim(world, spec)
    shm_publish(world, spec, 0)
    await shm_wait(world, spec)
    shm_done(world, spec)


async def shm_broadcast(world: World, spec: OpSpec, flat: np.ndarray, root: int) -> None:
    """:func:`broadcast` through the shared segment: the root publishes its array, every
    rank publishes the call (so ranks that disagree about ``root`` raise), and the others
    copy the root's slot."""
    slots = world.shm
    assert slots is not None
    rows = slots.rows(spec.seq & 1, flat.dtype, flat.shape[0])
    await shm_claim(world, spec)
    if world.rank == root:
        rows[root] = flat
    shm_publish(world, spec, flat.nbytes)
    await shm_wait(world, spec)
    if world.rank != root:
        flat[...] = rows[root]
    shm_done(world, spec)


@final
@attrs.frozen
class ReducePlan:
    """The views one shared-memory allreduce of a given slot, dtype and length works with,
    made once (see :func:`shm_allreduce`)."""

    #: (source, destination) of the leaves that are not folded (non-power-of-two worlds).
    fill: tuple[np.ndarray, np.ndarray] | None
    #: (a, b, out) of each level but the last.
    steps: tuple[tuple[np.ndarray, np.ndarray, np.ndarray], ...]
    #: The last level's two operands, reduced into the caller's array.
    last: tuple[np.ndarray, np.ndarray]


def _reduce_plan(world: World, rows: np.ndarray) -> ReducePlan:
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
    return ReducePlan(fill, tuple(steps), (level[0], level[1]))


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
    await shm_claim(world, spec)
    rows[world.rank] = flat
    shm_publish(world, spec, flat.nbytes)
    await shm_wait(world, spec)
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
    shm_done(world, spec)
