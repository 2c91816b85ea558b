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
import fcntl
import mmap
import os
import platform
import select
import socket
import sys
import weakref
from typing import final

import numpy as np
import trio

__all__ = [
    "BROKEN",
    "CONSUMED",
    "FINISHED",
    "LINE",
    "PIPE_CHUNKS",
    "PIPE_CHUNK_BYTES",
    "PRODUCED",
    "READY",
    "SHM_MAX_BYTES",
    "SLOT_BYTES",
    "SharedSlots",
    "create_segment",
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
#: are used, up to 2 x 256 KiB per rank.
SHM_MAX_BYTES = 256 * 1024
LINE = 64
#: One rank's slot: a 64-byte line for the frame header, then the payload.
SLOT_BYTES = LINE + SHM_MAX_BYTES
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
#: The pipe: one ring of chunks per communicator, through which a large call's data
#: streams (see _pipe for the measurements that chose its shape). Its pages are touched
#: only by the calls that use it, so a communicator that never does costs no memory for it.
PIPE_CHUNK_BYTES = 1024 * 1024
PIPE_CHUNKS = 4
_PAYLOAD_AT = LINE


def segment_bytes(world_size: int) -> int:
    return world_size * LINE + 2 * world_size * SLOT_BYTES + PIPE_CHUNKS * PIPE_CHUNK_BYTES


def _unavailable() -> str | None:
    if not sys.platform.startswith("linux"):
        return f"needs Linux (memfd_create and SCM_RIGHTS); this is {sys.platform}"
    machine = platform.machine().lower()
    if machine not in ("x86_64", "amd64"):
        return (
            f"needs an x86-64 CPU, whose stores become visible in program order; this is "
            f"{machine or 'unknown'}, where Python cannot order shared-memory accesses"
        )
    if not hasattr(os, "memfd_create") or not hasattr(socket, "send_fds"):
        return "this Python has no os.memfd_create or socket.send_fds"
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
        oversubscribed: bool,
    ) -> None:
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
        #: Whether this rank shares its CPUs with more ranks than there are CPUs among
        #: them (see _cpus.Cpus.oversubscribed). Then a wait yields the CPU before anything else, since
        #: the peer it waits for may be waiting for this core: at world 4 on 2 cores a
        #: barrier that took its schedule point first took 87 us (median of 5 runs of 5,000)
        #: against 52 us; at world 2 on 2 cores the schedule point first saved 3 us of 22
        #: in a 4-byte allreduce.
        self.oversubscribed = oversubscribed
        #: The last collective this rank published in each slot parity (0: none yet).
        self.last_used = [0, 0]
        slots_end = world_size * LINE + 2 * world_size * SLOT_BYTES
        slots = buffer[world_size * LINE : slots_end].reshape(2, world_size, SLOT_BYTES)
        #: The pipe's ring, chunk by chunk.
        self.pipe = buffer[slots_end:].reshape(PIPE_CHUNKS, PIPE_CHUNK_BYTES)
        self.headers = [[slots[p, q, :48].data for q in range(world_size)] for p in (0, 1)]
        self._payload_rows = slots[:, :, _PAYLOAD_AT:]
        self.closed = False
        self.events = select.epoll()
        self.link_of_fd: dict[int, int] = {}
        for peer, link_fd in link_fds.items():
            self.events.register(link_fd, select.EPOLLIN | select.EPOLLRDHUP)
            self.link_of_fd[link_fd] = peer

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

    def close(self) -> None:
        """Stop using the segment. A wait parked on the connections' epoll set sees the set
        closed. The mapping goes with the last view of it: at once, unless the frame of a
        collective interrupted in another task (or an exception's traceback) still holds
        one."""
        if self.closed:
            return
        self.closed = True
        with contextlib.suppress(RuntimeError):  # outside Trio: nothing can be waiting
            trio.lowlevel.notify_closing(self.events.fileno())
        self.events.close()
        self._cache.clear()
        self.headers = []
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


def create_segment(world_size: int) -> int:
    """A new anonymous shared segment for ``world_size`` ranks; its file descriptor."""
    fd = os.memfd_create("trioring-slots")  # close-on-exec by default
    try:
        os.ftruncate(fd, segment_bytes(world_size))
    except BaseException:
        os.close(fd)
        raise
    return fd
