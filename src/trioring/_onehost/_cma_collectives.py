"""Cross-memory attach between the ranks of one host: the protocol every collective by it
follows (a rank exposes its array, its peers read it, and each says when it is done), the
reads themselves (in threads for large ones), and the broadcast. The reductions are in
:mod:`._cma_reductions`, the copying collectives in :mod:`._copies`."""

from __future__ import annotations

import functools
import struct
import threading
import time
from typing import TYPE_CHECKING

import numpy as np
import trio

from . import _cma, _push
from ._shm_collectives import shm_claim, shm_finish, shm_publish, shm_wait

if TYPE_CHECKING:
    from collections.abc import Iterable, Sequence

    from outcome import Outcome

    from .._algorithms import World
    from .._wire import OpSpec

__all__ = [
    "ANNOUNCE",
    "READ_THREADS",
    "READ_THREADS_MIN_BYTES",
    "address_of",
    "cma_broadcast",
    "expose",
    "finish",
    "read_peer",
    "read_threads",
]


# -- cross-memory attach ---------------------------------------------------------------------
#
# Ranks on one host read each other's arrays directly (see _cma), so each byte is copied once.
# A few words of control order the memory accesses: a rank reads a region of a peer's array
# only after the peer said the region holds what the step needs, and it returns only after
# every peer said it has finished reading its array, so a caller may overwrite the array as
# soon as the call returns. With a shared segment those words go through it (the call's
# publication with the array's address, a ready word, the done words: see _shm): no system
# call, and the publication checks the call's identity on every rank. Without one they are
# frames, which carry every step's identity (mismatches raise as with sockets). Measured
# against Open MPI in the same ranks (bench/paired.py, 9 windows, ratio trioring / Open MPI),
# frames (TRIORING_SHM=0) against the segment at world 2: broadcast 1 MiB 2.00 / 1.32,
# 4 MiB 1.22 / 1.14; allreduce 1 MiB 1.67 / 1.41, 4 MiB 1.51 / 1.39. At world 4 (2 cores,
# the windows spread 0.8-2.7) 1 MiB gained (allreduce 2.48-2.57 / 1.74-1.86, broadcast
# 1.41-2.02 / 1.07-1.22) and 4 MiB stayed within the spread (1.26-1.65 / 1.53-1.62).

#: How long a copy may hold the thread before it lets other tasks run.
_SCHEDULE_EVERY_SECONDS = 0.001
#: One read takes at most this much (or the communicator's chunk, if larger): 4 MiB takes
#: 250-450 us here, so a cancellation is still noticed within about half a millisecond.
#: In 1 MiB reads a 4 MiB broadcast at world 2 took 5-10 % longer (420-486 against 363-434
#: us, the reads alone 299-357 against 266-322; alternating blocks of 20 calls in one run).
_READ_STEP_BYTES = 4 * 1024 * 1024
#: A reader's threads (see read_threads) split its copy at page boundaries.
_PAGE = 4096
#: Where the ranks on a host have CPUs to spare, a rank that reads a large array while the
#: others only wait (a broadcast's other ranks; the root parks meanwhile) reads it in this
#: many threads: one core copied about 5 GB/s from another process's memory here (64 MiB
#: in 12.1-12.3 ms; 4 MiB, whose source may sit in a cache, in 0.44), two together about
#: twice that. By cross-memory attach at world 2 (2 vCPUs, Intel, two launches of 20 calls
#: each, ms), two threads against one: 64 MiB 6.0-6.2 / 12.1-12.3, 32 MiB 1.8-1.9 /
#: 3.4-4.2, 16 MiB 1.0-1.1 / 1.6, 8 MiB 0.76-0.84 / 0.87-0.92, 4 MiB 0.58-0.64 / 0.44-0.50
#: (handing a share to a thread and hearing back costs more than it saves). More threads
#: were not measured: this machine has two CPUs.
READ_THREADS = 2
#: ... from this many bytes, where threaded reads beat the segment's pipe, the broadcast's
#: path otherwise. Timed as the benchmarks time a call (bench/paired.py, against Open MPI
#: in the same ranks; the root refills its array before every call, so it starts in that
#: core's caches, which favours the pipe), two runs each, ratio to Open MPI, threads /
#: pipe: 64 MiB 0.68-0.69 / 0.93-0.96, 32 MiB 0.72 / 0.76-0.80, 24 MiB 0.61-0.74 /
#: 0.78-0.80, 16 MiB 0.71-0.90 / 0.72-0.75 (a wash), 8 MiB 1.19-1.35 / 1.16-1.37.
READ_THREADS_MIN_BYTES = 24 * 1024 * 1024

ANNOUNCE = struct.Struct("<QQ")  # address of the array's data, its size in bytes
_WORDS = np.dtype(np.uint64)


async def expose(
    world: World,
    spec: OpSpec,
    exposed: np.ndarray | None,
    readers: Sequence[int],
    meanwhile: tuple[np.ndarray, np.ndarray] | None = None,
) -> np.ndarray | None:
    """The start of every collective by cross-memory attach: tell ``readers`` where
    ``exposed`` is (None: this rank exposes nothing), then copy ``meanwhile`` (destination,
    source), while they start reading.

    With a shared segment every rank publishes the call there, the address in its slot,
    and waits until all have: the publication is also the agreement on the call (kind,
    dtype, count, op, root), so a disagreement raises on every rank before any memory is
    read, without a round of frames. Returns every rank's (address, size) as ``(n, 2)``
    words, for :func:`address_of` until :func:`finish`. Without a segment, frame step 0 to
    each reader; returns None, and :func:`address_of` receives the peers' frames."""
    slots = world.shm
    if slots is None:
        if exposed is not None:
            mine = memoryview(ANNOUNCE.pack(_cma.data_address(exposed), exposed.nbytes))
            for peer in readers:
                await world.links[peer].send(spec, 0, mine)
        if meanwhile is not None:
            meanwhile[0][...] = meanwhile[1]
        return None
    rows = slots.rows(spec.seq & 1, _WORDS, 2)
    await shm_claim(world, spec)
    own = rows[world.rank]
    own[0] = 0 if exposed is None else _cma.data_address(exposed)
    own[1] = 0 if exposed is None else exposed.nbytes
    shm_publish(world, spec, ANNOUNCE.size)
    if meanwhile is not None:
        meanwhile[0][...] = meanwhile[1]
    await shm_wait(world, spec)
    return rows


async def address_of(
    world: World,
    spec: OpSpec,
    announced: np.ndarray | None,
    peer: int,
    nbytes: int,
    step: int = 0,
) -> int:
    """Where ``peer`` exposed its array of ``nbytes`` for ``spec``'s call: from the words
    :func:`expose` returned, or (None) from the peer's frame ``step``."""
    link = world.links[peer]
    if announced is None:
        data = bytearray(ANNOUNCE.size)
        await link.recv(spec, step, memoryview(data))
        address, size = ANNOUNCE.unpack(data)
    else:
        address, size = int(announced[peer, 0]), int(announced[peer, 1])
    if size != nbytes:
        raise link.protocol_error(spec, f"announced an array of {size} bytes, expected {nbytes}")
    return int(address)


async def finish(
    world: World,
    spec: OpSpec,
    sources: Iterable[int],
    readers: Iterable[int],
    step: int = 1,
    *,
    park: bool = False,
) -> None:
    """The end of every collective by cross-memory attach: tell ``sources`` (the peers
    this rank read from) that it has finished, and return once every reader of this rank's
    arrays has said the same, so that the caller may overwrite them. The "done" goes only
    once every read is done, so that a rank returns only when the whole exchange it saw
    succeeded: were a gather's root to release each peer as soon as it had read it, a peer
    released before another died would return as if nothing had happened. With a shared
    segment, every rank waits for every rank's done word (:func:`shm_finish`); without,
    frame ``step`` to each source, then one from each reader. ``park``: a wait on the
    segment parks at once, leaving its CPU to readers that need it (see
    :func:`~._shm_collectives.shm_finish`)."""
    if world.shm is not None:
        await shm_finish(world, spec, park=park)
        return
    empty = memoryview(b"")
    for peer in sources:
        await world.links[peer].send(spec, step, empty)
    for peer in readers:
        await world.links[peer].recv(spec, step, empty)


def read_threads(world: World, nbytes: int, readers: int) -> int:
    """How many threads each of ``readers`` ranks reads an array of ``nbytes`` from a peer
    in, while the other ranks only wait for them (a broadcast's): ``READ_THREADS`` where the
    ranks agreed on a segment and on cross-memory attach, the array has at least
    ``READ_THREADS_MIN_BYTES`` and the ranks' CPUs together (:attr:`SharedSlots.cpus`)
    number ``READ_THREADS`` for every reader; else 1. The same on every rank."""
    slots = world.shm
    if slots is None or world.peer_pids is None or nbytes < READ_THREADS_MIN_BYTES:
        return 1
    return READ_THREADS if slots.threads and 0 < READ_THREADS * readers <= slots.cpus else 1


async def read_peer(
    world: World, spec: OpSpec, peer: int, address: int, into: np.ndarray, *, threads: int = 1
) -> None:
    """Copy ``into.nbytes`` bytes from ``address`` in ``peer``'s memory into ``into``, in
    reads of up to ``_READ_STEP_BYTES``. Cancellation is noticed after every read; other
    tasks get to run at least every millisecond (a schedule point after each read would
    cost more than the copy itself at a few MiB). ``threads`` > 1: in that many shares at
    once, one in this task, the others in helper threads (see :func:`_read_shares`)."""
    assert world.peer_pids is not None
    local = _cma.data_address(into)
    if threads > 1 and into.nbytes > _PAGE:
        await _read_shares(world, spec, peer, address, local, into.nbytes, threads)
        return
    await _read_range(world, spec, peer, address, local, 0, into.nbytes)


async def _read_shares(
    world: World, spec: OpSpec, peer: int, address: int, local: int, total: int, threads: int
) -> None:
    """:func:`read_peer` of ``total`` bytes to ``local`` (here) in ``threads`` shares of
    whole pages, read at once: this task reads the first as :func:`read_peer` reads, and
    a helper thread (from Trio's cache, ``trio.lowlevel.start_thread_soon``) each of the
    others, in reads of up to
    ``_READ_STEP_BYTES`` that hold no lock (``process_vm_readv`` through ctypes releases
    the GIL). The helpers start before this task reads, and this returns or raises only
    once every helper has ended: none outlives the call. Cancelled, or failing in its own
    share, this task tells the helpers to stop after their current read (half a
    millisecond here at most) and waits for them, shielded; a helper's failure (the peer
    died) raises as this task's own would."""
    assert world.peer_pids is not None
    pid = world.peer_pids[peer]
    share = -(-total // threads)
    share += -share % _PAGE
    bounds = [(lo, min(lo + share, total)) for lo in range(0, total, share)]
    stopping = threading.Event()
    outcomes: list[Outcome[None]] = []
    ended = trio.Event()
    token = trio.lowlevel.current_trio_token()
    started = 0

    def read(lo: int, hi: int) -> None:  # in a helper thread
        while lo < hi and not stopping.is_set():
            step = min(_READ_STEP_BYTES, hi - lo)
            _cma.read_into(pid, address + lo, local + lo, step)
            lo += step

    def deliver(result: Outcome[None]) -> None:  # in the helper thread, once read ended
        token.run_sync_soon(arrived, result)

    def arrived(result: Outcome[None]) -> None:  # in Trio's thread: after every start
        outcomes.append(result)
        if len(outcomes) == started:
            ended.set()

    try:
        for lo, hi in bounds[1:]:
            trio.lowlevel.start_thread_soon(functools.partial(read, lo, hi), deliver)
            started += 1
        await _read_range(world, spec, peer, address, local, *bounds[0])
    except BaseException:
        stopping.set()
        raise
    finally:
        if len(outcomes) < started:
            with trio.CancelScope(shield=True):
                await ended.wait()
    for result in outcomes:
        try:
            result.unwrap()
        except _cma.CmaError as exc:
            raise await world.links[peer].memory_error(spec, exc) from exc


async def _read_range(
    world: World, spec: OpSpec, peer: int, address: int, local: int, done: int, total: int
) -> None:
    """Bytes ``[done, total)`` of :func:`read_peer`'s copy, in this task: from ``address +
    done`` in ``peer`` to ``local + done`` here."""
    assert world.peer_pids is not None
    pid = world.peer_pids[peer]
    since = time.perf_counter()
    while done < total:
        step = min(max(world.chunk_bytes, _READ_STEP_BYTES), total - done)
        try:
            _cma.read_into(pid, address + done, local + done, step)
        except _cma.CmaError as exc:
            # The peer's connection says whether it gave up (its abort frame) or died (a
            # clean close, which this rank may tell the others at once). A rank killed in
            # a 64 MiB allreduce by cross-memory attach (bench/fault_latency.py, Unix, 8
            # repetitions): the median survivor raised 64 ms after at world 4 and 78 at
            # world 8 without that look (most of it the 50 ms look that every survivor then
            # waited out for the others' news), 11-17 and 25-53 ms with it (several runs).
            # Most of what is left comes before the read fails: the kernel reports the peer
            # gone only once the killed process has started to exit, which, with eight
            # processes on 2 cores, takes tens of milliseconds.
            raise await world.links[peer].memory_error(spec, exc) from exc
        done += step
        if time.perf_counter() - since >= _SCHEDULE_EVERY_SECONDS:
            await trio.lowlevel.checkpoint()
            since = time.perf_counter()
        else:
            await trio.lowlevel.checkpoint_if_cancelled()


async def cma_broadcast(world: World, spec: OpSpec, flat: np.ndarray, root: int) -> None:
    """Broadcast by direct reads: the root exposes its array, every other rank copies it
    and says so; the root returns when all have. Without a shared segment the caller's
    barrier round has already checked that every rank agrees on ``root``; with one,
    :func:`expose`'s publication does."""
    n, r = world.size, world.rank
    # Where every rank has a CPU, the root writes the end of the array into the readers'
    # (see _push); this beat reading in threads, which is where pushing is off.
    push = _push.push_bytes(world, flat.nbytes)
    threads = 1 if push else read_threads(world, flat.nbytes, n - 1)
    if r == root:
        peers = [q for q in range(n) if q != r]
        announced = await expose(world, spec, flat, peers)
        if push:
            end = flat.nbytes - push
            local = _cma.data_address(flat) + end
            targets = []
            for q in peers:
                at = await address_of(world, spec, announced, q, flat.nbytes)
                targets.append((q, at + end, local, push))
            await _push.push_into(world, spec, targets)
        # Where the others read in threads, the core this rank would poll on is theirs.
        await finish(world, spec, (), peers, park=threads > 1)
        return
    try:
        # Where the root pushes, this rank's array is announced to it, which writes its end.
        announced = await expose(world, spec, flat if push else None, ())
        address = await address_of(world, spec, announced, root, flat.nbytes)
        into = flat.view(np.uint8)[: flat.nbytes - push]
        await read_peer(world, spec, root, address, into, threads=threads)
        # Returns once the root has said done, after its writes.
        await finish(world, spec, (root,), ())
    except BaseException:
        if push:
            await _push.pushed(world, spec, (root,))
        raise
