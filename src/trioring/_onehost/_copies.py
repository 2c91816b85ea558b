"""The collectives that only copy (allgather, gather, scatter, alltoall) between the ranks of
one host: through the shared segment for small calls, by cross-memory attach for large ones.
Each byte is copied once, from where it is to where it goes, which is the whole cost of
these collectives.

Shared segment (see ``_shm_collectives`` for the publication protocol): every rank writes
what its peers read from it into its slot (its block for allgather and gather, all its
blocks for alltoall), publishes the call, waits until every rank has published it (so a
mismatch of any kind, the root included, raises on every rank), and copies what it needs
out of the peers' slots. The slot holds ``SHM_MAX_BYTES``, which bounds what a rank writes
there. A scatter's non-roots learn the dtype and size only from the root's header, so its
header round goes through the segment (:func:`shm_post`), and when the blocks of the
other ranks fit the root's slot beside the header they travel with it: one publication in
all. The root's own block stays out of the slot: at world 2 that halves what the root
copies in, and lets a scatter of twice the slot's size take the segment.

Cross-memory attach (see ``_cma_collectives``): every rank exposes the address of what its
peers read (through the segment, or frame step 0 to each reader), each rank reads what it
needs from each peer that exposed to it, and once all its reads are done says "done reading
yours"; a rank returns only once every reader has said so, so the caller may overwrite its
arrays as soon as the call returns. All frames are small and sent before anything waits on
them, so one task does it all. Without a segment, the rooted collectives (gather, scatter)
are preceded by the caller's agreement round, which makes ranks that disagree about the
root raise instead of waiting; with one, the publication agrees (a scatter's header round
carries the root's address).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ._cma import data_address
from ._cma_collectives import address_of, expose, finish, read_peer
from ._shm import SHM_MAX_BYTES
from ._shm_collectives import shm_claim, shm_done, shm_exchange, shm_publish, shm_wait

if TYPE_CHECKING:
    from collections.abc import Sequence

    from .._algorithms import World
    from .._wire import OpSpec

__all__ = [
    "cma_allgather",
    "cma_alltoall",
    "cma_gather",
    "cma_scatter",
    "posted_states",
    "scatter_address",
    "scatter_words",
    "shm_allgather",
    "shm_alltoall",
    "shm_gather",
    "shm_post",
    "slot_bytes",
]


# -- shared segment -------------------------------------------------------------------------

_BYTES, _INT64 = np.dtype(np.uint8), np.dtype(np.int64)


async def shm_allgather(
    world: World, spec: OpSpec, gathered: np.ndarray, bounds: Sequence[int], flat: np.ndarray
) -> None:
    """Every rank's block into ``gathered``, rank i's at ``[bounds[i], bounds[i + 1])``
    (blocks of one size, at most ``SHM_MAX_BYTES``), this rank's from ``flat`` (which may
    be its block of ``gathered`` already). ``flat`` goes straight into this rank's slot
    and comes back into ``gathered`` with the other rows: placing it in ``gathered`` first,
    as the other algorithms start, would copy it once more. At world 2 (bench/paired.py,
    three runs alternating with the code before) a 64 KiB allgather took 24.3-24.9 us
    instead of 26.2-28.1, a 256 KiB one 37.5-38.4 instead of 41.5-42.2, and 8 bytes
    16.8-17.9 instead of 18.8-20.4."""
    n = world.size
    _, rows = await shm_exchange(world, spec, flat)
    # One copy of every row, this rank's own included: at world 2 that costs less than two
    # copies around it (1.6 against 1.7 us for 64 KiB in all, timeit).
    gathered.reshape(n, -1)[...] = rows
    shm_done(world, spec)


async def shm_gather(
    world: World,
    spec: OpSpec,
    flat: np.ndarray,
    gathered: np.ndarray | None,
    root: int,
    *,
    in_place: bool,
) -> None:
    """Every rank's ``flat`` into root's ``gathered`` (``in_place``: the root's ``flat`` is
    its block of it already). The root writes nothing into its slot, which no one reads,
    and copies its own block straight from ``flat``: one copy of it fewer."""
    n, r, count = world.size, world.rank, flat.shape[0]
    _, rows = await shm_exchange(world, spec, flat, write=r != root)
    if r == root:
        assert gathered is not None
        into = gathered.reshape(n, count)
        into[:r] = rows[:r]
        into[r + 1 :] = rows[r + 1 :]
        if not in_place:
            into[r] = flat
    shm_done(world, spec)


async def shm_alltoall(world: World, spec: OpSpec, flat: np.ndarray, out: np.ndarray) -> None:
    """Block j of every rank's ``flat`` (``n`` blocks, the ``n - 1`` of the other ranks at
    most ``SHM_MAX_BYTES``) to rank j, where block i of ``out`` is rank i's. Rank q's slot
    holds its blocks for the other ranks in rank order; its own block for itself stays
    out, which at world 2 halves what it copies in."""
    slots = world.shm
    assert slots is not None
    n, r = world.size, world.rank
    count = flat.shape[0] // n
    rows = slots.rows(spec.seq & 1, flat.dtype, (n - 1) * count)
    await shm_claim(world, spec)
    mine = rows[r]
    if r:
        mine[: r * count] = flat[: r * count]
    if r < n - 1:
        mine[r * count :] = flat[(r + 1) * count :]
    shm_publish(world, spec, mine.nbytes)
    await shm_wait(world, spec)
    received = out.reshape(n, count)
    received[r] = flat[r * count : (r + 1) * count]
    for q in range(n):
        if q != r:
            # In rank q's slot, rank r's block comes after those of the ranks below r but q.
            at = (r - (r > q)) * count
            received[q] = rows[q, at : at + count]
    shm_done(world, spec)


async def shm_post(
    world: World, spec: OpSpec, state: np.ndarray, payload: Sequence[np.ndarray] = ()
) -> list[memoryview]:
    """Publish this rank's ``state`` (a small int64 array, the same length on every rank
    whose call agrees: the publication's size) with the flat, C-contiguous arrays of
    ``payload`` one after another right after it, and wait until every rank has published.
    Returns every rank's slot as bytes (:attr:`SharedSlots.byte_rows`; as a numpy array:
    :func:`slot_bytes`); every rank's state is its slot's first ``state.nbytes`` (see
    :func:`posted_states`), and the caller copies what it needs of a payload before it
    calls :func:`shm_done` (or its data path's end does)."""
    slots = world.shm
    assert slots is not None
    r, nbytes = world.rank, state.nbytes
    rows = slots.byte_rows[spec.seq & 1]
    await shm_claim(world, spec)
    own = rows[r]
    own[:nbytes] = state.data.cast("B")
    at = nbytes
    for piece in payload:
        end = at + piece.nbytes
        own[at:end] = piece.data.cast("B")
        at = end
    # What every rank publishes: the states' size, whoever has a payload.
    shm_publish(world, spec, nbytes)
    await shm_wait(world, spec)
    return rows


def slot_bytes(world: World, spec: OpSpec) -> np.ndarray:
    """Every rank's slot of ``spec``'s parity as ``(n, SHM_MAX_BYTES)`` bytes."""
    assert world.shm is not None
    return world.shm.rows(spec.seq & 1, _BYTES, SHM_MAX_BYTES)


def posted_states(world: World, spec: OpSpec, words: int) -> np.ndarray:
    """Every rank's state of ``words`` int64s that :func:`shm_post` published for ``spec``,
    as ``(n, words)`` views of the slots (valid until the caller says it is done)."""
    assert world.shm is not None
    return world.shm.rows(spec.seq & 1, _INT64, words)


# -- cross-memory attach ----------------------------------------------------------------------


async def _copy(
    world: World,
    spec: OpSpec,
    exposed: np.ndarray | None,
    readers: Sequence[int],
    reads: dict[int, tuple[int, list[tuple[int, np.ndarray]]]],
    meanwhile: tuple[np.ndarray, np.ndarray] | None = None,
    *,
    announced: np.ndarray | None = None,
) -> None:
    """Expose ``exposed`` to ``readers``; from each peer of ``reads`` (peer: (the size of
    the array it exposes, [(byte offset in it, array to fill)])) read what is listed; then
    :func:`finish`. ``meanwhile`` (destination, source) is this rank's own block, copied
    once the exposure is out, while the peers read: at 4 MiB in all at world 2, copying it
    first made a scatter's peer wait 100-200 us longer for its announcement.
    ``announced``: the call was published on the segment already (a scatter's header round)
    with these ``(n, 2)`` address words."""
    if announced is None:
        announced = await expose(world, spec, exposed, readers, meanwhile)
    elif meanwhile is not None:
        meanwhile[0][...] = meanwhile[1]
    for peer, (size, targets) in reads.items():
        address = await address_of(world, spec, announced, peer, size)
        for offset, into in targets:
            if into.nbytes:
                await read_peer(world, spec, peer, address + offset, into)
    await finish(world, spec, reads, readers)


def _peers_from(world: World) -> list[int]:
    """The peers in the order r+1, r+2, ...: ranks start on different peers, so that they do
    not all read the same rank's memory first."""
    n, r = world.size, world.rank
    return [(r + k) % n for k in range(1, n)]


async def cma_allgather(
    world: World,
    spec: OpSpec,
    gathered: np.ndarray,
    bounds: Sequence[int],
    source: np.ndarray,
    announced: np.ndarray | None = None,
    peers: Sequence[int] | None = None,
) -> None:
    """Every rank's block into ``gathered``, rank i's at ``[bounds[i], bounds[i + 1])``
    (blocks of any sizes), each rank reading each peer's block straight into its place.
    ``announced``: as for :func:`_copy`, every rank's ``source`` address from a
    publication that began the call (allgatherv's counts), and then ``peers``: the peers
    to read from (the others' blocks came with that publication); default: every peer.

    ``source`` is this rank's block where the caller has it (its ``x``, which may be its
    block of ``gathered``: in place): the peers read it there, and this rank copies it
    into place while they do. Reading the source rather than a copy just made of it
    matters on a machine whose cores do not share a cache: the copy's lines are dirty in
    this core's cache and cross to the reader one by one, while a source that has not
    changed since the last call may sit in the reader's cache already (forked processes,
    1 MiB, the reader's median per block of 100: 84-111 us from a source unchanged since
    the last block in every stretch of the machine, 117-790 us from one just rewritten:
    bench/modes.py --reads)."""
    readers = _peers_from(world)
    blocks = [gathered[bounds[q] : bounds[q + 1]] for q in range(world.size)]
    reads = {q: (blocks[q].nbytes, [(0, blocks[q])]) for q in (readers if peers is None else peers)}
    own = blocks[world.rank]
    # The checks allow x to overlap out= only as exactly this block (see _allgather._place).
    meanwhile = None if np.may_share_memory(source, own) else (own, source)
    await _copy(world, spec, source, readers, reads, meanwhile, announced=announced)


async def cma_gather(
    world: World, spec: OpSpec, flat: np.ndarray, gathered: np.ndarray | None, root: int
) -> None:
    """Every rank's ``flat`` into root's ``gathered``, the root reading each peer's block
    into its place. The root's own block is the caller's to copy, after this returns: the
    peers return once the root's done word is out, so that copy holds up nobody."""
    count = flat.shape[0]
    if world.rank != root:
        await _copy(world, spec, flat, [root], {})
        return
    assert gathered is not None
    reads = {
        q: (flat.nbytes, [(0, gathered[q * count : (q + 1) * count])]) for q in _peers_from(world)
    }
    await _copy(world, spec, None, [], reads)


async def cma_scatter(
    world: World,
    spec: OpSpec,
    blocks: np.ndarray | None,
    out: np.ndarray,
    root: int,
    announced: np.ndarray | None = None,
) -> None:
    """Root's ``blocks`` (``n * out.size`` elements), block i read by rank i into its
    ``out``; the root copies its own block. ``announced``: as for :func:`_copy`, the root's
    address from the header round (:func:`scatter_address`)."""
    n, r, nbytes = world.size, world.rank, out.nbytes
    if r == root:
        assert blocks is not None
        own = (out, blocks[r * out.shape[0] : (r + 1) * out.shape[0]])
        await _copy(world, spec, blocks, _peers_from(world), {}, own, announced=announced)
        return
    reads = {root: (n * nbytes, [(r * nbytes, out)])}
    await _copy(world, spec, None, [], reads, announced=announced)


def scatter_address(blocks: np.ndarray) -> np.ndarray:
    """What a scatter's root publishes in its header round, after the header, when the
    blocks go by cross-memory attach: their address and size, as :func:`expose` would."""
    return np.array([data_address(blocks), blocks.nbytes], dtype=np.uint64)


def scatter_words(world: World, spec: OpSpec, header_nbytes: int) -> np.ndarray:
    """The ``(n, 2)`` address words in the slots :func:`shm_post` published for ``spec``,
    after headers of ``header_nbytes``, where :func:`scatter_address` put the root's (only
    the root's mean anything)."""
    rows = slot_bytes(world, spec)
    return rows[:, header_nbytes : header_nbytes + 16].view(np.uint64)


async def cma_alltoall(world: World, spec: OpSpec, flat: np.ndarray, out: np.ndarray) -> None:
    """Block j of every rank's ``flat`` (``n`` blocks) to rank j, read by rank j straight
    into block i of its ``out`` for rank i's."""
    n, r = world.size, world.rank
    count = flat.shape[0] // n
    block_bytes = count * flat.dtype.itemsize
    own = (out[r * count : (r + 1) * count], flat[r * count : (r + 1) * count])
    peers = _peers_from(world)
    reads = {q: (flat.nbytes, [(r * block_bytes, out[q * count : (q + 1) * count])]) for q in peers}
    await _copy(world, spec, flat, peers, reads, own)
