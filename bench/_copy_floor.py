"""The third side of bench/paired.py above 256 KiB: the floor of a single-copy design, the
least any library that moves each byte once between the ranks of one host could take.

Up to 256 KiB bench/_floor_worker.py times trioring's shared-segment design with nothing
else. Larger calls leave the slots, and the one primitive that copies each byte once between
processes is the kernel's ``process_vm_readv``, which Open MPI's shared-memory transport uses
too for large messages (its "single copy", cross-memory attach). So this is each collective
by direct reads with nothing else: every rank exposes its arrays' addresses once, at
preparation; a call is the reads and reductions that trioring's cross-memory algorithms
make (src/trioring/_onehost/_cma_collectives.py, _copies.py), one ``process_vm_readv`` per
block (per 256 KiB piece where a block is reduced, into a scratch buffer that stays in cache,
as trioring's), and the least synchronisation that makes a call correct: every rank
publishes "my inputs are ready" before anyone reads them, "my segment is final" where a
result is read from a peer, and "done reading" before any rank returns (so that no rank
overwrites an array a peer still reads). Each of those is a bump of a counter in bench/
_floor_worker.py's shared page, polled with ``sched_yield``; each makes every rank wait for
every rank, as trioring's publications do (Open MPI's pairwise handshakes wait only for the
one peer they concern: at these sizes a few microseconds against hundreds).

Left out, against trioring: everything but the copies, the reductions and the counters (the
event loop, checks, identity, cancellation, failure detection, the decision table). Its
ratio to Open MPI's time, in the same windows, bounds what a library built on single copies
can reach here at that size; where trioring's table picks the segment's pipe instead (two
copies, through a ring of chunks), trioring's time is the pipe's and the floor still says
what a single copy costs.

It reads by trioring's own ``process_vm_readv`` call (``trioring._onehost._cma``), and it
relies on the ranks running as the same user with no Yama or seccomp rule against it between
them (trioring's "cma" feature probes the same; where it is refused the cell has no floor);
the tests run ``bench/_floor_worker.py --check``, which checks this floor too.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import numpy as np
from _harness import exchanged, rows

from trioring._onehost._cma import read_into
from trioring._onehost._cma_reductions import _REDUCE_STEP_BYTES

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

    from _floor_worker import Segment

#: The smallest call (paired.py's size) this floor runs: above bench/_floor_worker.py's.
MIN_BYTES = 256 * 1024 + 1
#: Reductions read a peer's block through a scratch buffer of this size, trioring's own
#: piece (_cma_reductions._REDUCE_STEP_BYTES, the fastest of 128 KiB to 1 MiB here), so
#: that the reduction finds what it reads in the cache.
CHUNK_BYTES = _REDUCE_STEP_BYTES


class Reader:
    """What rank ``segment.r`` needs to read its peers' arrays: their pids and the
    addresses of the arrays they exposed (shared through the segment's page, once, when the
    cell is prepared; every rank prepares the same cells in the same order)."""

    def __init__(self, segment: Segment, exposed: list[np.ndarray]) -> None:
        words = segment.share([os.getpid(), *(array.ctypes.data for array in exposed)])
        self.pids = [w[0] for w in words]
        #: [rank][i]: the address of rank's i-th exposed array.
        self.addresses = [w[1:] for w in words]
        # Whether every rank may read every other (Yama's ptrace_scope, for one, may forbid
        # it between processes that are not parent and child), agreed by all.
        probe = np.empty(1, np.uint8)
        fine = 1
        for q in range(segment.n):
            try:
                self.read(q, self.addresses[q][0], probe)
            except OSError:
                fine = 0
        self.permitted = all(w[0] for w in segment.share([fine]))

    def read(self, peer: int, address: int, into: np.ndarray) -> None:
        """Copy ``into.nbytes`` bytes from ``address`` in ``peer``'s memory into ``into``,
        by trioring's own ``process_vm_readv`` call (an ``OSError`` if refused)."""
        read_into(self.pids[peer], address, into.ctypes.data, into.nbytes)


def _reduce_in(
    reader: Reader,
    scratch: np.ndarray,
    peer: int,
    address: int,
    into: np.ndarray,
) -> None:
    """``into`` += the ``into.size`` float32s at ``address`` in ``peer``, chunk by chunk."""
    chunk = scratch.shape[0]
    for lo in range(0, into.shape[0], chunk):
        part = into[lo : lo + chunk]
        incoming = scratch[: part.shape[0]]
        reader.read(peer, address + lo * 4, incoming)
        np.add(part, incoming, out=part)


def prepare(
    segment: Segment, collective: str, count: int
) -> tuple[Callable[[], None], Callable[[], Iterator[None]], Callable[[], bool]] | None:
    """(untimed refill, the call's steps, check of the result) of one cell, with
    bench/_mpi_worker.py's inputs, root (n - 1) and expected results, as
    bench/_floor_worker.py's ``prepare``: the steps yield where every rank publishes and
    waits for every peer (a new call of the segment's counter each time). None where the
    call is small enough for bench/_floor_worker.py's slots, for a barrier, and where the
    ranks may not read each other's memory (the same on every rank)."""
    n, r = segment.n, segment.r
    k = max(1, count // n)
    root = n - 1
    total = n * (n + 1) / 2
    start = segment.start
    if max(count, n * k) * 4 < MIN_BYTES or collective == "barrier":
        return None
    peers = [(r + j) % n for j in range(1, n)]
    scratch = np.empty(CHUNK_BYTES // 4, np.float32)

    if collective in ("allreduce", "reduce"):
        array = np.empty(count, np.float32)
        bounds = [q * count // n for q in range(n + 1)]
        lo, hi = bounds[r], bounds[r + 1]
        # Where this rank reduces its segment: in place, except on a reduce's non-root,
        # whose array is input only.
        kept = collective == "allreduce" or r == root
        mine = array[lo:hi] if kept else np.empty(hi - lo, np.float32)
        # The second address is where the rank's finished segment will be.
        reader = Reader(segment, [array, mine])
        if not reader.permitted:
            return None
        sources = peers if collective == "allreduce" or r == root else []

        def refill() -> None:
            array.fill(r + 1)

        def reduce() -> Iterator[None]:
            start()
            yield  # every rank's input is ready
            if not kept:
                mine[...] = array[lo:hi]
            for q in peers:
                _reduce_in(reader, scratch, q, reader.addresses[q][0] + lo * 4, mine)
            start()
            yield  # every segment is final
            for q in sources:
                reader.read(q, reader.addresses[q][1], array[bounds[q] : bounds[q + 1]])
            start()
            yield  # nobody reads this rank's arrays any more

        expected = total if kept else r + 1
        return refill, reduce, lambda: bool(np.all(array == expected))

    if collective == "broadcast":
        array = np.empty(count, np.float32)
        reader = Reader(segment, [array])
        if not reader.permitted:
            return None

        def broadcast() -> Iterator[None]:
            start()
            yield  # the root's array is ready
            if r != root:
                reader.read(root, reader.addresses[root][0], array)
            start()
            yield  # nobody reads the root's array any more

        return (lambda: array.fill(r + 1)), broadcast, lambda: bool(np.all(array == n))

    if collective in ("allgather", "gather"):
        x, out = np.full(k, r + 1, np.float32), np.empty((n, k), np.float32)
        gathered = rows(n, k)
        reader = Reader(segment, [x])
        if not reader.permitted:
            return None
        gathers = collective == "allgather" or r == root

        def gather() -> Iterator[None]:
            start()
            yield  # every rank's block is ready
            if gathers:
                for q in peers:
                    reader.read(q, reader.addresses[q][0], out[q])
            start()
            yield
            if gathers:
                out[r] = x  # no peer waits for this rank's own block

        if not gathers:
            return (lambda: None), gather, lambda: True
        return (lambda: out.fill(0)), gather, lambda: bool(np.array_equal(out, gathered))

    if collective == "scatter":
        everything, received = rows(n, k), np.empty(k, np.float32)
        reader = Reader(segment, [everything])
        if not reader.permitted:
            return None

        def scatter() -> Iterator[None]:
            start()
            yield  # the root's blocks are ready
            if r == root:
                received[...] = everything[root]
            else:
                reader.read(root, reader.addresses[root][0] + r * k * 4, received)
            start()
            yield

        return (lambda: received.fill(0)), scatter, lambda: bool(np.all(received == r + 1))

    if collective == "reduce_scatter":
        x, out = np.full(n * k, r + 1, np.float32), np.empty(k, np.float32)
        reader = Reader(segment, [x])
        if not reader.permitted:
            return None

        def reduce_scatter() -> Iterator[None]:
            start()
            yield
            out[...] = x[r * k : (r + 1) * k]
            for q in peers:
                _reduce_in(reader, scratch, q, reader.addresses[q][0] + r * k * 4, out)
            start()
            yield

        return (lambda: out.fill(0)), reduce_scatter, lambda: bool(np.all(out == total))

    if collective == "alltoall":
        x, out = exchanged(n, k, r), np.empty((n, k), np.float32)
        expected = np.stack([exchanged(n, k, q)[r] for q in range(n)])
        reader = Reader(segment, [x])
        if not reader.permitted:
            return None

        def alltoall() -> Iterator[None]:
            start()
            yield
            out[r] = x[r]
            for q in peers:
                reader.read(q, reader.addresses[q][0] + r * k * 4, out[q])
            start()
            yield

        return (lambda: out.fill(0)), alltoall, lambda: bool(np.array_equal(out, expected))
    return None
