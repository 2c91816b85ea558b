"""Allreduce, reduce and reduce_scatter by cross-memory attach between the ranks of one host:
each rank reduces its segment of the array, reading the peers' values of it directly
(through :mod:`._cma_collectives`' exposure, reads and done words), and either the peers
read the finished segments or, where the ranks push (:mod:`._push`), it writes them into
the peers' arrays."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np
import trio

from .._algorithms import World, chunks
from .._util import ignore_fp_errors
from . import _cma, _push
from ._cma_collectives import (
    _SCHEDULE_EVERY_SECONDS,
    _WORDS,
    ANNOUNCE,
    address_of,
    expose,
    finish,
    read_peer,
)
from ._shm_collectives import shm_ready

if TYPE_CHECKING:
    from .._wire import OpSpec

__all__ = ["cma_allreduce", "cma_reduce", "cma_reduce_scatter"]


#: The reads that feed a reduction go through the scratch buffer in pieces of at most this
#: many bytes (or the communicator's chunk, the scratch's size, if smaller), each reduced
#: into the result before the next is read, while it is still in the core's cache (2 MiB
#: of L2 here, which the copy's source and the result share with it). Forced by cma, each
#: call timed alone between a reset and a check (``bench/thresholds.py``, a copy of it that
#: set this per algorithm name, 5-9 rounds, us, 128 KiB / 256 KiB / 512 KiB / 1 MiB, the
#: chunk it was before): allreduce at world 2, 2 MiB 518 / 490 / 500 / 535, 4 MiB 770 /
#: 719 / 735 / 825, 16 MiB 2427 / 2180 / 2231 / 2714, 64 MiB (256 KiB / 1 MiB) 14617 /
#: 15253; reduce_scatter 4 MiB 797 / 703 / - / 759; reduce 4 MiB 994 / 940 / - / 1014,
#: 64 MiB 24374 / 23291 / - / 24878; at world 4 (2 cores) allreduce 4 MiB 2842 / 2909 / -
#: / 3047, reduce_scatter 4 MiB 1725 / 1544 / - / 1668, 16 MiB 6784 / 5867 / - / 6686,
#: reduce 4 MiB 2633 / 2575 / - / 2704. Smaller pieces pay a system call and Python per
#: piece (64 KiB: 4 MiB 802-1027 us). Since the ranks write their pieces into the peers'
#: arrays (_push), measured again at world 2 (bench/paired.py --sizes 4M --windows 7, two
#: runs each, ratio to Open MPI, 128 KiB / 256 KiB / 512 KiB): allreduce 1.12, 1.05 /
#: 1.05, 0.93 / 1.02, 1.10; reduce 1.03, 0.93 / 0.97, 1.04 / 0.97, 1.08: within the noise.
_REDUCE_STEP_BYTES = 256 * 1024

#: A reduce's root takes a larger segment than the other ranks (_segment_bounds). Pushed
#: (_reduce_pushed), each of them also writes its finished segment into the root's array, a
#: copy the root does not make: a segment costs its rank n - 1 reads and reductions, and
#: that write about half of one more, so the root's share is ``1 + 1 / (_ROOT_EXTRA_DIVISOR
#: (n - 1))`` times another's (1.5 at world 2). In equal shares at world 2 the root finished
#: its 2 MiB of a 4 MiB reduce in 250-300 us and then waited 80-150 for the other rank,
#: whose 2 MiB took 340-440 (phase timers on both ranks). Against Open MPI in the same ranks
#: (bench/paired.py -n 2 --collective reduce, 9 windows, launches alternating, median
#: ratio), equal shares / the root's 1.4 times another's: 4 MiB 0.71, 0.72, 0.75, 0.65 /
#: 0.72, 0.64, 0.70, 0.63; 16 MiB 0.48, 0.46, 0.52 / 0.43, 0.42, 0.45; 64 MiB 0.29-0.30 /
#: 0.24-0.25 (four launches of each, three at 16 MiB). 1.25, 1.5 and 1.75 times measured the
#: same (16 and 64 MiB, two launches each); at world 4 on 2 cores, 1.13 times: 4 MiB 0.34
#: either way, 16 MiB 0.30 / 0.27-0.29. Where the ranks do not push (_reduce_segments), the
#: others reduce their segments into a new array each, whose pages the kernel supplies and
#: clears as they are first written, and the root reads them afterwards; there too the
#: root's larger share measured faster (TRIORING_PUSH=0, bench/paired.py -n 2 --sizes
#: 4M,16M,64M --windows 7, equal / root 1.5x / 2x, three launches each): 4 MiB 1.05, 1.00,
#: 1.02 / 0.99, 0.89, 0.98 / 0.98, 0.94, 1.05; 16 MiB 0.68-0.78 / 0.71-0.75 / 0.66-0.70; 64
#: MiB 0.58-0.61 / 0.39-0.42 / 0.38-0.41. Half the share (0.5x) took 1.32-1.42 at 4 MiB and
#: 0.75-0.78 at 64 MiB. At world 4 on 2 cores, 1x / 1.17x / 1.5x within the spread (64 MiB
#: 0.32-0.33 / 0.32-0.35 / 0.35, two launches each).
_ROOT_EXTRA_DIVISOR = 2


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
    bitwise identical on every rank. Control (see :func:`expose`): the array's address;
    "my segment is final" (after which peers read it, and we may overwrite theirs in ours),
    the ready word through the segment or frame step 1; "done reading yours" (frame step
    2 without a segment). Each rank sends a step to every peer before it waits for that
    step from any, so one task does it all, without deadlock: starting tasks and passing
    frames between them cost more than the copies at a few MiB. An abort frame from a peer
    other than the one being waited for is still seen, by the watch that a long wait keeps
    on the idle links (``Link._park``). Scratch: one chunk.
    """
    await _reduce_segments(world, spec, flat, reduce, divide, None)


async def cma_reduce(
    world: World,
    spec: OpSpec,
    flat: np.ndarray,
    root: int,
    reduce: np.ufunc,
    *,
    divide: bool,
) -> None:
    """Reduce by direct reads: as :func:`cma_allreduce`, but a rank other than ``root``
    reduces its segment into a new array (its own array is only read), says where that is
    with its "final" (the slot's words after its address, or the payload of frame step 1,
    to the root only), and only the root copies the finished segments, into its array. The
    work of reducing is spread over every rank, as in the allreduce, the root's segment the
    larger (:func:`_segment_bounds`); the root reads the others' values of its own segment
    to reduce it, then their finished segments. Scratch: one chunk, and on a non-root its
    segment. With a segment, the publication agrees on the root; without one, the caller's
    agreement round has."""
    await _reduce_segments(world, spec, flat, reduce, divide, root)


def _segment_bounds(total: int, n: int, root: int | None) -> list[int]:
    """Where each rank's segment of a reduction by cross-memory attach of ``total``
    elements begins, and the end: equal shares for an allreduce; for a reduce, the root's
    share is ``1 + 1 / (2 (n - 1))`` times another rank's (see _ROOT_EXTRA_DIVISOR). The
    same on every rank."""
    if root is None:
        return [q * total // n for q in range(n + 1)]
    unit = _ROOT_EXTRA_DIVISOR * (n - 1)  # another rank's weight; the root's is one more
    whole = n * unit + 1
    bounds, weight = [0], 0
    for q in range(n):
        weight += unit + (q == root)
        bounds.append(total * weight // whole)
    return bounds


async def _reduce_segments(
    world: World,
    spec: OpSpec,
    flat: np.ndarray,
    reduce: np.ufunc,
    divide: bool,
    root: int | None,
) -> None:
    """:func:`cma_allreduce` (``root`` None) and :func:`cma_reduce`."""
    if _push.can_push(world):
        await _reduce_pushed(world, spec, flat, reduce, divide, root)
        return
    n, r = world.size, world.rank
    peers = [q for q in range(n) if q != r]
    itemsize = flat.dtype.itemsize
    total = flat.shape[0]
    bounds = _segment_bounds(total, n, root)
    lo, hi = bounds[r], bounds[r + 1]
    # Where this rank reduces its segment: in place, unless the array is a reduce's input.
    kept = root is None or r == root
    # A new array per call: keeping one from call to call measured no faster (a 4 MiB
    # reduce at worlds 2 and 4, alternating blocks of one run: 1761 against 1821 us, 5314
    # against 4801, within the blocks' spread).
    mine = flat[lo:hi] if kept else np.empty(hi - lo, flat.dtype)
    # The waits for the peers' frames poll briefly like any receive (see Link._recv_some).
    # Parking at once looked right, since the peer waited for is copying megabytes, but the
    # poll's first try yields the CPU, often to that very peer, and a wake-up through the
    # event loop costs more: parking made 1 MiB at world 4 on 2 cores 1.8x slower (4 MiB
    # 1.3x, world 2 4 MiB 1.2x; 64 MiB unchanged).
    announced = await expose(world, spec, flat, peers, None if kept else (mine, flat[lo:hi]))
    addresses = await _reduce_from(world, spec, announced, flat, peers, (lo, hi, mine), reduce)
    if divide:
        np.divide(mine, n, out=mine)
    # Who copies this rank's finished segment, and whose this rank copies.
    copiers = peers if root is None else [root] if r != root else []
    sources = peers if root is None or r == root else []
    # Where the peers' finished segments are, for a reduce, through the segment.
    finals = None
    if announced is not None:
        assert world.shm is not None
        finals = world.shm.rows(spec.seq & 1, _WORDS, 4)[:, 2:]
        if not kept:
            # Beside this rank's address in its slot, stored before the ready word.
            finals[r] = (_cma.data_address(mine), mine.nbytes)
        await shm_ready(world, spec)
    else:
        where = b"" if kept else ANNOUNCE.pack(_cma.data_address(mine), mine.nbytes)
        for peer in copiers:
            await world.links[peer].send(spec, 1, memoryview(where))
    for peer in sources:
        start, stop = bounds[peer], bounds[peer + 1]
        address = addresses[peer] + start * itemsize
        if root is not None:
            # The peer's segment is in the array it reduced it into.
            size = (stop - start) * itemsize
            address = await address_of(world, spec, finals, peer, size, step=1)
        elif announced is None:
            await world.links[peer].recv(spec, 1, memoryview(b""))
        if stop > start:
            await read_peer(world, spec, peer, address, flat[start:stop])
    # The peers have finished reading our arrays only when this returns.
    await finish(world, spec, peers, peers, step=2)


async def _reduce_pushed(
    world: World,
    spec: OpSpec,
    flat: np.ndarray,
    reduce: np.ufunc,
    divide: bool,
    root: int | None,
) -> None:
    """:func:`cma_allreduce` (``root`` None) and :func:`cma_reduce` where the ranks push
    (_push.can_push): rank r reduces segment r piece by piece as before (own values first,
    then the peers' in rank order), and writes each finished piece straight into every
    peer's array (a reduce's: into the root's), while it is still in this core's cache,
    instead of those reading the finished segments afterwards from memory. Only segment r's
    owner reads or writes that segment of a peer's array, and it reads each piece before it
    writes it, so no "final" round is needed: a rank returns once every rank has said done
    (its reads of this rank's array, and its writes into it, are over). A rank written into
    that leaves early waits for the writes in progress to stop (see _push); the writes stop
    for any schedule point. A reduce's other ranks reduce each piece in a new array of one
    piece, since their own arrays stay as they are, and its root, which writes nothing,
    takes the larger segment (:func:`_segment_bounds`)."""
    assert world.peer_pids is not None
    n, r = world.size, world.rank
    peers = [q for q in range(n) if q != r]
    itemsize = flat.dtype.itemsize
    total = flat.shape[0]
    bounds = _segment_bounds(total, n, root)
    lo, hi = bounds[r], bounds[r + 1]
    chunk = max(1, min(world.chunk_bytes, _REDUCE_STEP_BYTES) // itemsize)
    scratch = world.scratch[: chunk * itemsize].view(flat.dtype)
    local, into = _cma.data_address(flat), _cma.data_address(scratch)
    # Where this rank's finished pieces go, and who writes into this rank's array.
    kept = root is None or r == root
    targets = peers if root is None else [root] if r != root else []
    writers = peers if kept else []
    piece = None if kept else np.empty(chunk, flat.dtype)
    at_piece = 0 if piece is None else _cma.data_address(piece)
    try:
        announced = await expose(world, spec, flat, peers)
        addresses = [(q, await address_of(world, spec, announced, q, flat.nbytes)) for q in peers]
        writes = [(q, at) for q, at in addresses if q in targets]
        _push.begin(world, spec)
        since = time.perf_counter()
        with ignore_fp_errors():  # overflow to inf is a valid result, as in ring_allreduce
            for offset, count in chunks(lo, hi, chunk):
                if not count:
                    continue
                at, size = offset * itemsize, count * itemsize
                if piece is None:
                    target, source = flat[offset : offset + count], local + at
                else:
                    target, source = piece[:count], at_piece
                    target[...] = flat[offset : offset + count]
                for peer, address in addresses:
                    try:
                        _cma.read_into(world.peer_pids[peer], address + at, into, size)
                    except _cma.CmaError as exc:
                        _push.end(world, spec)
                        raise await world.links[peer].memory_error(spec, exc) from exc
                    reduce(target, scratch[:count], out=target)
                if divide:
                    np.divide(target, n, out=target)
                for peer, address in writes:
                    try:
                        _push.write(world, peer, address + at, source, size)
                    except _cma.CmaError as exc:
                        raise await _push.failed(world, spec, peer, exc) from exc
                if time.perf_counter() - since >= _SCHEDULE_EVERY_SECONDS:
                    _push.end(world, spec)
                    await trio.lowlevel.checkpoint()
                    _push.begin(world, spec)
                    since = time.perf_counter()
                else:
                    await trio.lowlevel.checkpoint_if_cancelled()
        _push.end(world, spec)
        await finish(world, spec, peers, peers)
    except BaseException:
        _push.end(world, spec)
        await _push.pushed(world, spec, writers)
        raise


async def cma_reduce_scatter(
    world: World,
    spec: OpSpec,
    flat: np.ndarray,
    bounds: list[int],
    out: np.ndarray,
    reduce: np.ufunc,
    *,
    divide: bool,
) -> None:
    """Reduce-scatter by direct reads: rank r copies its own block ``[bounds[r], bounds[r +
    1])`` of ``flat`` into ``out``, then reduces into it that block of every peer's input,
    read chunk by chunk (peers from r + 1 on, so that the ranks do not all read one peer
    first). Blocks may differ in size (reduce_scatterv). The first half of
    :func:`cma_allreduce`, whose result block a rank keeps; scratch: one chunk."""
    r = world.rank
    peers = [(r + k) % world.size for k in range(1, world.size)]
    lo, hi = bounds[r], bounds[r + 1]
    announced = await expose(world, spec, flat, peers, (out, flat[lo:hi]))
    await _reduce_from(world, spec, announced, flat, peers, (lo, hi, out), reduce)
    if divide:
        np.divide(out, world.size, out=out)
    await finish(world, spec, peers, peers)


async def _reduce_from(
    world: World,
    spec: OpSpec,
    announced: np.ndarray | None,
    flat: np.ndarray,
    peers: list[int],
    into: tuple[int, int, np.ndarray],
    reduce: np.ufunc,
) -> dict[int, int]:
    """Reduce into ``into`` (lo, hi, an array that holds this rank's ``flat[lo:hi]``) that
    range of each peer's ``flat``, in the order of ``peers``, read piece by piece through
    the scratch buffer (``_REDUCE_STEP_BYTES``). Returns the peers' addresses."""
    lo, hi, mine = into
    itemsize = flat.dtype.itemsize
    chunk = max(1, min(world.chunk_bytes, _REDUCE_STEP_BYTES) // itemsize)
    scratch = world.scratch[: chunk * itemsize].view(flat.dtype)
    addresses = {}
    # Overflow to inf is a valid result, as in ring_allreduce.
    with ignore_fp_errors():
        for peer in peers:
            addresses[peer] = address = await address_of(world, spec, announced, peer, flat.nbytes)
            for offset, count in chunks(lo, hi, chunk):
                if not count:
                    continue
                incoming = scratch[:count]
                await read_peer(world, spec, peer, address + offset * itemsize, incoming)
                target = mine[offset - lo : offset - lo + count]
                reduce(target, incoming, out=target)
    return addresses
