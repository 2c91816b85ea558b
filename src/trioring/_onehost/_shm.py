"""Shared-memory slots: small collectives between ranks on one host without system calls.

A socket exchange costs each rank a ``writev`` and a ``readv`` per step, and on a host with
fewer cores than ranks every wake-up waits for the peer to be scheduled. Through shared
memory, a rank publishes its payload and a sequence number with ordinary stores and reads
everyone else's with ordinary loads: at world 4 on 2 cores a barrier takes about 0.4 of
the socket path's time, and a 4-byte allreduce about 0.55.

One segment per communicator, created by rank 0 (``memfd_create``: it has no name, so it
cannot leak past the processes that map it) and handed to every peer over its Unix
connection (``SCM_RIGHTS``) when the communicator opens. Layout, for ``n`` ranks::

    n sequence words, one per 64-byte line          (rank r publishes seq in line r;
                                                     its done and finished words follow)
    n parked words, one per line                    (see SharedSlots.wake_parked)
    2 x n slots of SLOT_BYTES (parity of seq, rank)  (48-byte frame header, then payload)
    PIPE_CHUNKS chunks of PIPE_CHUNK_BYTES           (the pipe: large calls, see _pipe)

Rank r publishes collective ``s`` by writing its payload and the frame header that names
``s`` (kind, dtype, count, op, root, seq) into slot ``(s % 2, r)``, then ``s`` into its
sequence word. A reader that sees a peer's word at ``s`` or later reads that peer's slot
``(s % 2, q)``, and once it has read all it needs writes ``s`` into its *done* word (the
next word of its line). Before it writes slot ``(s % 2, r)`` again, for a later collective,
a rank waits until every peer's done word has reached the collective that last used that
slot. When every collective goes through the segment, that wait never waits: a rank reaches
``s + 2`` only after every rank has published ``s + 1``, so after every rank has finished
reading ``s``. It is there for the collectives in between that go by the sockets, some of
which let a rank finish without hearing from every rank (a scan's rank 1 hears only from
rank 0 at world 3): without it, such a rank could overwrite a slot that a slower peer was
still reading.

The publication order (payload and header first, sequence word last) is all the
synchronisation there is. x86-64 keeps stores in program order and loads in program order
(TSO), and CPython performs each of these writes as a plain store in its own bytecode, so a
reader that sees the new sequence number also sees the slot. Weakly ordered CPUs (ARM,
POWER) give no such guarantee and Python cannot issue fences, so the path is x86-64 only.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import mmap
import os
import platform
import select
import socket
import stat
import sys
import weakref
from typing import final

import numpy as np
import trio

__all__ = [
    "BROADCAST_PIECE_MIN_BYTES",
    "BROKEN",
    "CONSUMED",
    "FINISHED",
    "LINE",
    "PIPE_CHUNKS",
    "PIPE_CHUNK_BYTES",
    "PRODUCED",
    "PROGRESS_BITS",
    "PUSHING",
    "READY",
    "SHM_MAX_BYTES",
    "SLOT_BYTES",
    "SLOT_PAYLOAD_BYTES",
    "WAKER_MAX_RANKS",
    "SharedSlots",
    "broadcast_piece_bytes",
    "create_segment",
    "create_wakers",
    "segment_bytes",
    "unavailable_reason",
]

#: Payloads up to this many bytes per rank go through the shared segment. Measured with
#: `trioring bench` at worlds 2 and 4 (float32, 2 shared cores; segment against the
#: sockets and cross-memory attach, alternating runs): the segment won every collective it
#: takes at 16, 64 and 256 KiB (at world 2 allreduce 42 against 51-65 us at 64 KiB, 87
#: against 116-133 at 256 KiB; broadcast 32-40 against 64-80 at 64 KiB; at world 4
#: broadcast 172-274 against 325-534 us at 64 KiB), and above 256 KiB its allreduce, which
#: every rank computes whole, lost to cross-memory attach at world 4. Every slot is
#: touched only as far as a call writes it, so the segment costs memory for the sizes that
#: are used. Reduces take more, up to the whole slot (SLOT_PAYLOAD_BYTES), and so do
#: gathers, reduce_scatters and broadcasts where no rank is crowded: there that measured
#: faster.
SHM_MAX_BYTES = 256 * 1024
#: What one rank's slot holds. The collectives whose time above SHM_MAX_BYTES was Python and
#: rounds of agreement rather than copies gained from the slots up to this size; the others
#: keep SHM_MAX_BYTES. Each forced in turn, through slots of 1 MiB against the pipe and
#: cross-memory attach (bench/thresholds.py --each, float32, 5 rounds of 10 calls, the
#: slowest rank, Intel Xeon, 2 vCPUs; slots / the table's choice before, us):
#:   reduce     w2 320 KiB 44.6 / 69.4 (cma), 512 KiB 66.6 / 98.7; w3 384 KiB 203 / 399
#:              (pipe), 510 KiB 316 / 463 (bench/paired.py, ratio to Open MPI, two runs
#:              each: 384 KiB 1.41-1.46 against 1.49-1.84, 512 KiB 1.05-1.08 / 1.23-1.31);
#:   reduce_scatter  w2 320 KiB 44.7 / 59.6 (pipe), 512 KiB 57.2 / 80.2; but w3 (3 ranks
#:              on 2 cores) 384 KiB 341 / 321, 510 KiB 394 / 453 (cma 385);
#:   gather     w2 512 KiB blocks (1 MiB in all) 84.8-90.6 / 113-119 (pipe), 1 MiB blocks
#:              184 / 222; w3 512 KiB blocks 297 / 448, but in the same ranks as Open MPI
#:              (bench/paired.py, two runs each, alternating) 2.55-2.65 of its time against
#:              2.12-2.64, a spread of 1.1-3.8 between windows; w4 512 KiB blocks even;
#:   broadcast  w2 320 KiB 39.0 / 41.4 (cma), 512 KiB 48.6 / 54.1, 1 MiB 93.1 / 88.8; but w3
#:              384 KiB 168 / 158 (pipe), 510 KiB 221 / 201.
#: Against Open MPI in the same run (bench/compare.py -n 2 --rounds 3, ratio to its time,
#: before / after): reduce 320 KiB 1.45 / 0.95, 512 KiB 1.38 / 0.91; reduce_scatter 320 KiB
#: 1.30 / 0.91, 512 KiB 0.96 / 0.72; gather 1 MiB 1.75 / 1.20; broadcast 320 KiB 1.07 /
#: 0.93, 512 KiB 0.87 / 0.77 (1 MiB 0.73 / 0.81: not taken). What did not gain, and stays at
#: SHM_MAX_BYTES: allreduce (every rank reduces every slot: w2 512 KiB 94.2 against 82.9 by
#: cma, w3 384 KiB 388 against 285), allgather (w2 768 KiB and 1 MiB within 5 % of cma, w3
#: 768 KiB 417 against 388 through the pipe), alltoall (w2 768 KiB 108 against 106 by cma,
#: w3 384 KiB 324 against 285), scatter (w2 1 MiB 86-88 against 69-71 by cma). So the slot
#: holds 512 KiB, 1 MiB per rank with both parities, touched only as far as calls write it.
#: Measured on Intel only: elsewhere the slots copy a broadcast whole, and the broadcast
#: keeps SHM_MAX_BYTES (see _collectives._broadcast.shm_limit); the others' gains are the
#: Python and the rounds the slots save, which no CPU removes.
SLOT_PAYLOAD_BYTES = 512 * 1024
LINE = 64
#: One rank's slot: a 64-byte line for the frame header, then the payload.
SLOT_BYTES = LINE + SLOT_PAYLOAD_BYTES
#: What a rank that gave up writes over its sequence number.
BROKEN = 2**64 - 1
#: Where a rank's *finished* word is in its line, from its sequence word.
FINISHED = 2
#: Where a rank's *ready* word is in its line: a collective that needs one more step of
#: agreement after its publication (the cross-memory-attach allreduce: "my part of the
#: result is final") writes its sequence number there.
READY = 3
#: Where a rank's *produced* and *consumed* words are in its line: how far a call through
#: the pipe has got (see _pipe).
PRODUCED = 4
CONSUMED = 5
#: Where a rank's *pushing* word is in its line: a broadcast's root that writes into its
#: readers' arrays says there when it may be writing (see _push).
PUSHING = 6
#: The produced and consumed words hold the call's sequence number above this many bits of
#: chunk (or piece) count, so that a word left from an earlier call is always behind: 2**24
#: chunks of 1 MiB, 16 TiB in one call, and 2**40 calls.
PROGRESS_BITS = 24
#: The pipe: one ring of chunks per communicator, through which a large call's data
#: streams (see _pipe for the measurements that chose its shape). Its pages are touched
#: only by the calls that use it, so a communicator that never does costs no memory for it.
PIPE_CHUNK_BYTES = 1024 * 1024
PIPE_CHUNKS = 4
#: A broadcast's other ranks wait for the root's copy before they can copy anything: cut
#: into pieces, each piece goes out while the root copies the next. Pieces of a quarter of
#: the array (a power of two, from BROADCAST_PIECE_MIN_BYTES to PIPE_CHUNK_BYTES), and
#: through the slots only from four pieces of the minimum. At world 2 (bench/paired.py,
#: against Open MPI in the same ranks, runs alternating with whole copies): 256 KiB
#: through the slots 0.95-0.99 of Open MPI's time in pieces of 64 KiB against 1.00-1.09
#: (192 KiB in three pieces: even; 128 KiB in two: even; 64 KiB in pieces of 16 or 32
#: KiB: 1.30-1.37 against 1.17-1.21, each piece's word and wait cost more than the
#: overlap gained); through the pipe 512 KiB 1.04-1.09 against 1.24-1.28 in 1 MiB chunks,
#: 1 MiB 1.04-1.08 against 1.19-1.25, 4 MiB even (its 1 MiB chunks already are quarters).
#: Only where no rank shares its CPUs with more ranks than it has (SharedSlots.crowded): at
#: world 4 on 2 cores, where a reader may not run while the root copies, 256 KiB in pieces
#: took 139-163 us against 127-132 whole, 1 MiB 491-538 against 455-483 (two runs each,
#: alternating with the code before).
#: The other collectives through the pipe keep 1 MiB chunks: at world 2 every rank writes
#: and reads at once there, and 256 KiB chunks were even or slower (1 and 4 MiB allreduce,
#: allgather, alltoall, reduce_scatter).
#: Those numbers are the Intel Xeon machine's. On the second AMD EPYC machine (2 vCPUs,
#: family 23 model 1, see _collectives._limits; every handoff between its cores costs
#: several times more: a 4-byte allreduce took Open MPI 3.8-7.0 us there against 0.9)
#: pieces through the slots were slower: 256 KiB at world 2 took 1.74 of Open MPI's time
#: whole (median of seven runs of ``bench/paired.py``, 7 windows each, alternating;
#: 1.64-2.37) against 2.35 in pieces (2.08-2.95), while the pipe's quarter chunks were even
#: (1 MiB 1.84, 1.74-2.11, against 2.07, 1.65-2.56, in 1 MiB chunks; 512 KiB and 2 MiB
#: within the spread). So the slots take pieces on Intel CPUs only
#: (:func:`slot_pieces_from_bytes`, by vendor as the pipe's limits in
#: _collectives._limits), the pipe everywhere.
BROADCAST_PIECE_MIN_BYTES = 64 * 1024
#: Communicators of up to this many ranks give every rank an eventfd, through which peers
#: wake its parked waits (see SharedSlots.wake_parked); larger ones park on the event
#: loop's timer alone. The eventfds cost ``n`` descriptors per rank and communicator, as
#: many as its connections: at 64 ranks, a world and four ``dup``s then hold about 700 of
#: the usual soft limit of 1024, where without them a world of 128 and four ``dup``s hold
#: 770 and with them would need 1400.
WAKER_MAX_RANKS = 64
_PAYLOAD_AT = LINE


def broadcast_piece_bytes(nbytes: int, *, crowded: bool) -> int:
    """The pieces a broadcast of ``nbytes`` is copied in (see BROADCAST_PIECE_MIN_BYTES),
    where some rank is ``crowded`` (:attr:`SharedSlots.crowded`) the pipe's whole chunks:
    a power of two, so that the pipe's ring holds a whole number of them; through the
    slots, only more than three pieces are copied piece by piece."""
    if crowded:
        return PIPE_CHUNK_BYTES
    quarter = 1 << max(0, (nbytes // 4).bit_length() - 1)
    return min(PIPE_CHUNK_BYTES, max(BROADCAST_PIECE_MIN_BYTES, quarter))


def slot_pieces_from_bytes(vendor: str) -> int:
    """Through the slots, a broadcast of more than this many bytes is copied piece by piece
    where no rank is crowded, on a CPU of ``vendor`` (``vendor_id`` in /proc/cpuinfo): from
    four pieces of the minimum on Intel CPUs, never elsewhere (see
    BROADCAST_PIECE_MIN_BYTES). Every rank with a segment runs on one host, so all read the
    same vendor and copy alike."""
    return 3 * BROADCAST_PIECE_MIN_BYTES if vendor == "GenuineIntel" else SLOT_PAYLOAD_BYTES


def segment_bytes(world_size: int) -> int:
    return 2 * world_size * LINE + 2 * world_size * SLOT_BYTES + PIPE_CHUNKS * PIPE_CHUNK_BYTES


def _unavailable() -> str | None:
    if not sys.platform.startswith("linux"):
        return f"needs Linux (memfd_create and SCM_RIGHTS); this is {sys.platform}"
    machine = platform.machine().lower()
    if machine not in ("x86_64", "amd64"):
        return (
            f"needs an x86-64 CPU, whose stores become visible in program order; this is "
            f"{machine or 'unknown'}, where Python cannot order shared-memory accesses"
        )
    if not all(hasattr(os, name) for name in ("memfd_create", "eventfd")) or not hasattr(
        socket, "send_fds"
    ):
        return "this Python has no os.memfd_create, os.eventfd or socket.send_fds"
    return None


_reason = _unavailable()


def unavailable_reason() -> str | None:
    """Why small collectives cannot use shared memory in this process, or None if they can
    (every rank must also agree when a communicator opens)."""
    if os.environ.get("TRIORING_SHM", "").strip() == "0":
        return "turned off by TRIORING_SHM=0"
    return _reason


@final
class SharedSlots:
    """This rank's view of the communicator's shared segment, and an epoll set over its
    data connections: a wait on the segment watches them for abort frames and closed
    connections, which say that a peer will never publish."""

    def __init__(
        self,
        fd: int,
        rank: int,
        world_size: int,
        link_fds: dict[int, int],
        *,
        wakers: list[int],
        oversubscribed: bool,
    ) -> None:
        """Map the segment ``fd``; ``wakers`` are every rank's eventfd, by rank (or none:
        see WAKER_MAX_RANKS), which the new object owns (it closes them; if this raises,
        they stay the caller's)."""
        if wakers and len(wakers) != world_size:
            raise ValueError(f"expected {world_size} eventfds, got {len(wakers)}")
        # An eventfd is an anonymous inode, of no file type: what this rank writes into a
        # peer's (8-byte counts) can never land in a file.
        if any(stat.S_IFMT(os.fstat(waker).st_mode) for waker in wakers):
            raise OSError(errno.EINVAL, "a shared segment's waker is not an eventfd")
        size = segment_bytes(world_size)
        # Only a memfd has seals: anything else a peer might send is refused.
        fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        if os.fstat(fd).st_size < size:
            raise OSError(f"shared segment is {os.fstat(fd).st_size} bytes, expected {size}")
        # Mapped with libc rather than the mmap module, which would keep a duplicate of the
        # descriptor open for as long as any view of the map lives.
        buffer = _map_shared(fd, size)
        self._cache: dict[tuple[int, np.dtype, int], np.ndarray] = {}
        #: Sequence words: rank r's is ``seqs[r * LINE // 8]``, on a line of its own.
        self.seqs = buffer.data.cast("Q")
        self.own_word = rank * LINE // 8
        self.peers = [q for q in range(world_size) if q != rank]
        #: Where each peer's sequence word is in :attr:`seqs`.
        self.peer_words = [q * LINE // 8 for q in self.peers]
        #: The "done" words, beside the sequence words: rank r writes ``s`` into its own
        #: once it has finished reading the slots of collective ``s``.
        self.own_done = self.own_word + 1
        self.peer_done = [word + 1 for word in self.peer_words]
        #: The third word of the line: the last collective a rank had finished on the
        #: segment (its done word) when it gave up (see :meth:`mark_broken`).
        self.own_finished = self.own_word + FINISHED
        #: The *ready* words (see READY).
        self.own_ready = self.own_word + READY
        self.peer_ready = [word + READY for word in self.peer_words]
        #: The *parked* words, by rank: nonzero (a ticket, new for every park) while the
        #: rank's wait sleeps in the event loop, so that a peer's store wakes it (see
        #: :meth:`wake_parked`). Each on a line of its own, away from the sequence words:
        #: a store's look at them then stays in this core's cache, where one at the line the
        #: peer had just written cost 2-5 us a call (percall.py at world 2).
        self.parked_words = [(world_size + q) * LINE // 8 for q in range(world_size)]
        self.own_parked = self.parked_words[rank]
        self.peer_parked = [self.parked_words[q] for q in self.peers] if wakers else []
        #: The last ticket of each peer's that this rank woke: one wake-up per park.
        self._woken = dict.fromkeys(self.peer_parked, 0)
        self._waker_of = {self.parked_words[q]: wakers[q] for q in self.peers} if wakers else {}
        self._ticket = 0
        #: Whether this rank shares its CPUs with more ranks than there are CPUs among
        #: them (see _cpus.Cpus.oversubscribed). Then a wait yields the CPU before anything else, since
        #: the peer it waits for may be waiting for this core: at world 4 on 2 cores a
        #: barrier that took its schedule point first took 87 us (median of 5 runs of 5,000)
        #: against 52 us; at world 2 on 2 cores the schedule point first saved 3 us of 22
        #: in a 4-byte allreduce.
        self.oversubscribed = oversubscribed
        #: Whether any rank of the communicator is :attr:`oversubscribed`: the same on every
        #: rank, agreed when the segment is (see _agree.agree_on_shm). Then a broadcast
        #: copies whole, not in pieces (see BROADCAST_PIECE_MIN_BYTES), since its readers
        #: may not run while the root copies, and the choice must be every rank's.
        self.crowded = True
        #: How many CPUs the ranks of the communicator may run on, all of them together: the
        #: least any rank counted, the same on every rank, agreed with the segment (0:
        #: unknown). Where there are two for every rank that reads while the others wait,
        #: such a reader reads in two threads (see _cma_collectives.read_threads); where
        #: there is one for every rank, a broadcast's root writes a share of its array into
        #: the readers' (see _push).
        self.cpus = 0
        #: Whether every rank offered to read large arrays in threads (TRIORING_THREADS),
        #: and to have a broadcast's root write into the readers' arrays (TRIORING_PUSH, and
        #: process_vm_writev works): see _agree.agree_on_shm.
        self.threads = False
        self.push = False
        #: The last collective this rank published in each slot parity (0: none yet).
        self.last_used = [0, 0]
        slots_at = 2 * world_size * LINE
        slots_end = slots_at + 2 * world_size * SLOT_BYTES
        slots = buffer[slots_at:slots_end].reshape(2, world_size, SLOT_BYTES)
        #: The pipe's ring, chunk by chunk.
        self.pipe = buffer[slots_end:].reshape(PIPE_CHUNKS, PIPE_CHUNK_BYTES)
        self.headers = [[slots[p, q, :48].data for q in range(world_size)] for p in (0, 1)]
        self._payload_rows = slots[:, :, _PAYLOAD_AT:]
        #: Every rank's payload in each slot parity as bytes, ``byte_rows[parity][rank]``,
        #: for the uneven collectives' blocks: a memoryview's slice assignment copied a small
        #: block in 0.35 us, numpy's in 1.0 (timeit, 2 vCPUs, AMD EPYC).
        self.byte_rows = [[memoryview(row) for row in self._payload_rows[p]] for p in (0, 1)]
        self.closed = False
        self.events = select.epoll()
        self.link_of_fd: dict[int, int] = {}
        for peer, link_fd in link_fds.items():
            self.events.register(link_fd, select.EPOLLIN | select.EPOLLRDHUP)
            self.link_of_fd[link_fd] = peer
        #: This rank's eventfd, in the same epoll set: a parked wait wakes on a peer's
        #: progress as it does on an abort frame.
        self.waker = wakers[rank] if wakers else -1
        if wakers:
            self.events.register(self.waker, select.EPOLLIN)
        self.wakers = wakers

    def store(self, word: int, value: int) -> None:
        """Write ``value`` into this rank's ``word`` (sequence, done, ready, produced or
        consumed: every store a peer may wait for), then wake the peers that sleep."""
        self.seqs[word] = value
        self.wake_parked()

    def wake_parked(self) -> None:
        """Wake every peer whose wait on the segment sleeps in its event loop: call after
        every store into this rank's words (:meth:`store` does). A peer that polls, as most
        do, costs a load.

        Without this, a sleeping wait wakes only on its event loop's timer, a millisecond
        after it parked however soon the word it waits for is written: a rank that comes
        to a call earlier than its poll lasts (a millisecond) would finish it up to a
        millisecond late."""
        seqs, woken = self.seqs, self._woken
        for word in self.peer_parked:
            ticket = seqs[word]
            if ticket and ticket != woken[word]:
                woken[word] = ticket
                with contextlib.suppress(BlockingIOError):  # its counter is full: it is awake
                    os.eventfd_write(self._waker_of[word], 1)

    def park(self) -> None:
        """Say that this rank's wait is about to sleep in the event loop: from now on a
        peer that writes one of its words wakes it. The caller then looks once more at
        what it waits for before it sleeps (a word written before the peer saw this one
        woke no one)."""
        self._ticket += 1
        self.seqs[self.own_parked] = self._ticket

    def unpark(self) -> None:
        """Say that this rank's wait no longer sleeps, and empty its eventfd."""
        self.seqs[self.own_parked] = 0
        if self.waker >= 0:
            with contextlib.suppress(BlockingIOError):  # nobody woke it: the timer did
                os.eventfd_read(self.waker)

    def rows(self, parity: int, dtype: np.dtype, count: int) -> np.ndarray:
        """Every rank's payload in slot ``parity`` as an ``(n, count)`` array of ``dtype``.
        The last few are kept: a program calls small collectives of one shape over and
        over, and making the view costs about as much as the arithmetic."""
        key = (parity, dtype, count)
        rows = self._cache.get(key)
        if rows is None:
            if len(self._cache) >= 8:
                self._cache.clear()
            rows = self._payload_rows[parity, :, : count * dtype.itemsize].view(dtype)
            self._cache[key] = rows
        return rows

    def mark_broken(self) -> None:
        """Tell peers that this rank gave up: a peer that finds this instead of a sequence
        number looks for the abort frame on the connection (see _shm_collectives.shm_wait).

        The last collective this rank finished stays readable beside it: a slow peer may
        still be waiting in it, having published it but not yet looked again, and there it
        has completed (this rank saw every rank's publication, and the slots are not written
        again), so the peer must not raise in it. A collective this rank gave up in, even one
        it had published, raises on every peer that waits in it."""
        seqs = self.seqs
        if not self.closed and seqs[self.own_word] != BROKEN:
            seqs[self.own_finished] = seqs[self.own_done]
            seqs[self.own_done] = BROKEN
            seqs[self.own_word] = BROKEN
            self.wake_parked()

    def close(self) -> None:
        """Stop using the segment. A wait parked on the connections' epoll set sees the set
        closed. The mapping goes with the last view of it: at once, unless the frame of a
        collective interrupted in another task (or an exception's traceback) still holds
        one."""
        # Forget the descriptors before closing them: a number closed here may be reused by
        # a file this process opens next, which no later store may write into.
        wakers, self.wakers = self.wakers, []
        self.peer_parked, self._waker_of, self.waker = [], {}, -1
        for fd in wakers:
            os.close(fd)
        if self.closed:
            return
        self.closed = True
        with contextlib.suppress(RuntimeError):  # outside Trio: nothing can be waiting
            trio.lowlevel.notify_closing(self.events.fileno())
        self.events.close()
        self._cache.clear()
        self.headers = []
        self.byte_rows = []
        self.seqs.release()
        del self._payload_rows
        del self.pipe


_libc = ctypes.CDLL(None, use_errno=True) if _reason is None else None


def _map_shared(fd: int, size: int) -> np.ndarray[tuple[int], np.dtype[np.uint8]]:
    """``size`` bytes of ``fd`` mapped shared, as bytes; unmapped when the last view of
    them is garbage."""
    assert _libc is not None
    mmap_ = _libc.mmap
    mmap_.restype = ctypes.c_void_p
    mmap_.argtypes = (
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_long,
    )
    address = mmap_(None, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0)
    if address is None or address == ctypes.c_void_p(-1).value:
        code = ctypes.get_errno()
        raise OSError(code, f"mmap of the shared segment failed: {os.strerror(code)}")
    memory = (ctypes.c_uint8 * size).from_address(address)
    munmap = _libc.munmap
    munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
    weakref.finalize(memory, munmap, address, size)
    array: np.ndarray[tuple[int], np.dtype[np.uint8]] = np.frombuffer(
        memoryview(memory).cast("B"), dtype=np.uint8
    )
    return array


def create_wakers(world_size: int) -> list[int]:
    """One eventfd per rank (non-blocking, so that emptying one that nobody wrote returns
    at once), through which peers wake its parked waits."""
    wakers: list[int] = []
    try:
        for _ in range(world_size):
            wakers.append(os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC))
    except BaseException:
        for fd in wakers:
            os.close(fd)
        raise
    return wakers


def create_segment(world_size: int) -> int:
    """A new anonymous shared segment for ``world_size`` ranks; its file descriptor."""
    fd = os.memfd_create("trioring-slots")  # close-on-exec by default
    try:
        os.ftruncate(fd, segment_bytes(world_size))
    except BaseException:
        os.close(fd)
        raise
    return fd
