"""The third side of bench/paired.py: trioring's shared-segment design with nothing else, the
least any Python library built that way could take for a call of up to 256 KiB.

bench/floor.py's limit is a 4-byte exchange. Above a few bytes the copies count too, so this
is the same protocol trioring's segment runs for calls that fit its slots (see
``trioring/_onehost/_shm_collectives.py``, ``_shm_reductions.py`` and ``_copies.py``): every
rank copies what its peers need into its own slot of a mapping shared by all, bumps its
counter, waits (polling, ``os.sched_yield`` between looks) until every peer's counter
reached the same call, and copies or reduces what it needs out of the peers' slots with one
numpy call per block, the same copies and reductions trioring's segment makes. Every rank
waits for every rank in every call, as trioring's publication does (its mismatch checks
need it). Slots alternate by the call's parity, as trioring's, so no "done" round is
needed: a rank reaches call c + 2 only once every peer reached c + 1, that is, finished
reading call c.

Left out, against trioring: the Trio event loop and its schedule point per call, argument
checks, the call's identity (which every rank compares), cancellation, failure detection,
the decision table. :func:`scheduled` puts the first two back (and nothing else): the same
steps as a Trio call that takes the one schedule point it owes where trioring takes it. It
relies on x86-64's store order (a slot's data is visible before the counter that follows
it), as trioring's segment does. The ranks run it between the other
two sides' calls, with the same inputs, refills and checks as bench/_mpi_worker.py's.

    .venv/bin/python bench/_floor_worker.py --check 3

checks it without MPI: forked ranks over an anonymous shared mapping run every collective
at a few sizes, back to back, and any wrong result fails (the tests run this).
"""

from __future__ import annotations

import argparse
import mmap
import os
import signal
import sys
import tempfile
import time
from typing import TYPE_CHECKING, Any

import _copy_floor
import numpy as np
import trio
from _harness import exchanged, rows

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Iterator

#: The largest call (paired.py's size: what one rank sends or receives in all) the floor
#: runs through its slots: trioring's SHM_MAX_BYTES, 256 KiB, where the targets' mid sizes
#: end and most collectives leave the segment's slots (reduce, and where no rank is
#: crowded gather, reduce_scatter and broadcast, take them up to 512 KiB: not floored).
MAX_BYTES = 256 * 1024
_LINE = 64  # one cache line per rank's counter
_HEAD = 4096  # the counters' page; the slots follow


def segment_bytes(n: int) -> int:
    """The size of the mapping a world of ``n`` shares."""
    if n * _LINE > _HEAD:
        raise SystemExit(f"the floor runs up to {_HEAD // _LINE} ranks, not {n}")
    return _HEAD + 2 * n * MAX_BYTES


class Segment:
    """Rank ``r``'s view of ``mapping`` (zeroed, :func:`segment_bytes` long, shared by the
    ``n`` ranks): a counter per rank, and two slots (by the call's parity) of ``MAX_BYTES``
    per rank. The mapping lives as long as the process: the prepared calls hold views of
    it."""

    def __init__(self, mapping: mmap.mmap, r: int, n: int) -> None:
        self.n, self.r, self.calls = n, r, 0
        self._counters = memoryview(mapping).cast("Q")
        #: [parity] -> (n, MAX_BYTES // 4) float32: every rank's slot.
        self.slots = np.frombuffer(mapping, np.float32, offset=_HEAD).reshape(2, n, -1)
        self._mine = r * _LINE // 8
        self._peers = [q * _LINE // 8 for q in range(n) if q != r]

    def start(self) -> int:
        """Begin a call: its slot parity."""
        self.calls += 1
        return self.calls & 1

    def sync(self) -> None:
        """Publish this rank's slot for the call, then wait until every peer has."""
        counters, calls, yield_ = self._counters, self.calls, os.sched_yield
        counters[self._mine] = calls
        for at in self._peers:
            while counters[at] < calls:
                yield_()

    async def scheduled_sync(self, owed: bool = True) -> bool:
        """:meth:`sync` with the one schedule point a Trio call owes (while ``owed``: a call
        that publishes more than once owes only one), taken as trioring's segment takes it:
        as the first look of a wait that must wait (the peers catch up meanwhile). Whether
        it took it (if not, the caller takes it after the call)."""
        counters, calls, yield_ = self._counters, self.calls, os.sched_yield
        counters[self._mine] = calls
        scheduled = not owed
        for at in self._peers:
            if counters[at] < calls and not scheduled:
                scheduled = True
                await trio.lowlevel.checkpoint()
            while counters[at] < calls:
                yield_()
        return scheduled and owed

    def share(self, values: list[int]) -> list[list[int]]:
        """Every rank's ``values`` (at most 7 words each, the same number on every rank):
        this rank's go into its counter's cache line, then two calls' worth of counters
        make sure that every rank has written its own before any reads them, and has read
        them all before any rank writes the next ones. For bench/_copy_floor.py's
        addresses."""
        width = len(values)
        assert width < _LINE // 8
        for i, value in enumerate(values, start=self._mine + 1):
            self._counters[i] = value
        self.start()
        self.sync()
        lines = [q * _LINE // 8 for q in range(self.n)]
        shared = [list(self._counters[at + 1 : at + 1 + width]) for at in lines]
        self.start()
        self.sync()
        return shared


def plain(segment: Segment, steps: Callable[[], Iterator[None]]) -> Callable[[], None]:
    """The floor's call: ``steps`` (a generator function that yields once, where every rank
    publishes its slot and waits for every peer's, see :func:`prepare`) with
    :meth:`Segment.sync` where it yields (driving the generator costs about 0.07 us)."""
    sync = segment.sync

    def call() -> None:
        for _ in steps():
            sync()

    return call


def scheduled(
    segment: Segment, steps: Callable[[], Iterator[None]]
) -> Callable[[], Awaitable[None]]:
    """The floor's call as a Trio-native one must at least be: one schedule point per call,
    as the first look of its wait (:meth:`Segment.scheduled_sync`), or after the call where
    it did not wait. No checks, identity, cancellation or failure detection besides."""
    sync = segment.scheduled_sync

    async def call() -> None:
        took = False
        for _ in steps():
            took = await sync(not took) or took
        if not took:
            await trio.lowlevel.cancel_shielded_checkpoint()

    return call


def open_over(comm: Any) -> Segment:
    """A segment shared by the ranks of the MPI communicator ``comm`` (started by mpirun,
    not forked: the mapping is a file in ``/dev/shm`` that rank 0 makes, and unlinks once
    every rank has it open)."""
    n, r = comm.Get_size(), comm.Get_rank()
    nbytes = segment_bytes(n)
    path = None
    if r == 0:
        where = "/dev/shm" if os.path.isdir("/dev/shm") else None
        fd, path = tempfile.mkstemp(prefix="trioring-floor-", dir=where)
        os.ftruncate(fd, nbytes)
        os.close(fd)
    path = comm.bcast(path, root=0)
    with open(path, "r+b") as file:
        mapping = mmap.mmap(file.fileno(), nbytes)
    comm.Barrier()
    if r == 0:
        os.unlink(path)
    return Segment(mapping, r, n)


def _sum_rows(mine: np.ndarray, rows: np.ndarray, r: int, out: np.ndarray) -> None:
    """``out`` = ``mine`` (this rank's values, read where they lie, as trioring's
    reductions read them, not back from its slot) plus every other row of ``rows``, one
    numpy call per row (``out`` may be ``mine``)."""
    peers = [q for q in range(rows.shape[0]) if q != r]
    np.add(mine, rows[peers[0]], out=out)
    for q in peers[1:]:
        np.add(out, rows[q], out=out)


def prepare(
    segment: Segment, collective: str, count: int
) -> tuple[Callable[[], None], Callable[[], Iterator[None]], Callable[[], bool]] | None:
    """(untimed refill, the call's steps, check of the result) of one cell, with
    bench/_mpi_worker.py's inputs, root (n - 1) and expected results; None where the call
    does not fit the slots. :func:`plain` and :func:`scheduled` make the steps a call."""
    n, r, slots = segment.n, segment.r, segment.slots
    k = max(1, count // n)
    root = n - 1
    total = n * (n + 1) / 2
    start = segment.start
    if max(count, n * k) * 4 > MAX_BYTES:
        return None

    def nothing() -> None:
        pass

    if collective == "barrier":

        def barrier() -> Iterator[None]:
            start()
            yield

        return nothing, barrier, lambda: True
    if collective in ("allreduce", "broadcast", "reduce"):
        array = np.empty(count, np.float32)
        mine = [slots[p, r, :count] for p in (0, 1)]
        everyone = [slots[p, :, :count] for p in (0, 1)]

        def refill() -> None:
            array.fill(r + 1)

        if collective == "allreduce":

            def allreduce() -> Iterator[None]:
                p = start()
                mine[p][...] = array
                yield
                _sum_rows(array, everyone[p], r, array)

            return refill, allreduce, lambda: bool(np.all(array == total))
        if collective == "broadcast":

            def broadcast() -> Iterator[None]:
                p = start()
                if r == root:
                    mine[p][...] = array
                    yield
                else:
                    yield
                    array[...] = everyone[p][root]

            return refill, broadcast, lambda: bool(np.all(array == n))

        def reduce() -> Iterator[None]:
            p = start()
            if r != root:
                mine[p][...] = array
                yield
                return
            yield
            every = everyone[p]
            for q in range(n - 1):
                np.add(array, every[q], out=array)

        expected = total if r == root else r + 1
        return refill, reduce, lambda: bool(np.all(array == expected))
    if collective in ("allgather", "gather"):
        x, out = np.full(k, r + 1, np.float32), np.empty((n, k), np.float32)
        gathered = rows(n, k)
        mine = [slots[p, r, :k] for p in (0, 1)]
        blocks = [slots[p, :, :k] for p in (0, 1)]

        def refill_out() -> None:
            out.fill(0)

        if collective == "allgather":

            def allgather() -> Iterator[None]:
                p = start()
                mine[p][...] = x
                yield
                out[...] = blocks[p]  # every row, this rank's own too, as trioring does

            return refill_out, allgather, lambda: bool(np.array_equal(out, gathered))

        def gather() -> Iterator[None]:
            p = start()
            if r != root:
                mine[p][...] = x
                yield
                return
            yield
            out[:root] = blocks[p][:root]
            out[root] = x

        if r != root:
            return nothing, gather, lambda: True
        return refill_out, gather, lambda: bool(np.array_equal(out, gathered))
    if collective == "scatter":
        # The root's slot holds the other ranks' blocks in rank order (the root is last).
        everything, received = rows(n, k), np.empty(k, np.float32)
        others = [slots[p, root, : (n - 1) * k] for p in (0, 1)]
        mine = [slots[p, root, r * k : (r + 1) * k] for p in (0, 1)]

        def scatter() -> Iterator[None]:
            p = start()
            if r == root:
                others[p][...] = everything[:root].reshape(-1)
                yield
                received[...] = everything[root]
            else:
                yield
                received[...] = mine[p]

        return (lambda: received.fill(0)), scatter, lambda: bool(np.all(received == r + 1))
    if collective == "reduce_scatter":
        # Only the blocks the peers read go into the slot, as trioring's.
        x, out = np.full(n * k, r + 1, np.float32), np.empty(k, np.float32)
        below, above, block = x[: r * k], x[(r + 1) * k :], x[r * k : (r + 1) * k]
        lower = [slots[p, r, : r * k] for p in (0, 1)]
        upper = [slots[p, r, (r + 1) * k : n * k] for p in (0, 1)]
        own = [slots[p, :, r * k : (r + 1) * k] for p in (0, 1)]

        def reduce_scatter() -> Iterator[None]:
            p = start()
            lower[p][...] = below
            upper[p][...] = above
            yield
            _sum_rows(block, own[p], r, out)

        return (lambda: out.fill(0)), reduce_scatter, lambda: bool(np.all(out == total))
    if collective == "alltoall":
        # Rank q's slot holds its blocks for the other ranks in rank order, as trioring's.
        x, out = exchanged(n, k, r), np.empty((n, k), np.float32)
        expected = np.stack([exchanged(n, k, q)[r] for q in range(n)])
        below, above = x[:r].reshape(-1), x[r + 1 :].reshape(-1)
        lower = [slots[p, r, : r * k] for p in (0, 1)]
        upper = [slots[p, r, r * k : (n - 1) * k] for p in (0, 1)]
        theirs = [
            [
                (q, slots[p, q, (r - (r > q)) * k : (r - (r > q) + 1) * k])
                for q in range(n)
                if q != r
            ]
            for p in (0, 1)
        ]

        def alltoall() -> Iterator[None]:
            p = start()
            lower[p][...] = below
            upper[p][...] = above
            yield
            out[r] = x[r]
            for q, block in theirs[p]:
                out[q] = block

        return (lambda: out.fill(0)), alltoall, lambda: bool(np.array_equal(out, expected))
    return None


def prepare_any(
    segment: Segment, collective: str, count: int
) -> tuple[Callable[[], None], Callable[[], Iterator[None]], Callable[[], bool]] | None:
    """:func:`prepare` where the call fits the slots, else bench/_copy_floor.py's floor of
    the single-copy design (every collective but the barrier)."""
    return prepare(segment, collective, count) or _copy_floor.prepare(segment, collective, count)


_COLLECTIVES = (
    "barrier", "allreduce", "broadcast", "reduce", "allgather", "reduce_scatter", "gather",
    "scatter", "alltoall",
)  # fmt: skip


def _check_rank(mapping: mmap.mmap, r: int, n: int, calls: int) -> int:
    """Rank ``r`` of the self-check: every collective at a few sizes, ``calls`` calls each
    back to back, plain then under Trio with its schedule point; the exit status."""
    segment = Segment(mapping, r, n)

    async def check_all() -> int:
        refused = False
        for collective in _COLLECTIVES:
            # The slots' sizes, then two of the single-copy floor's (bench/_copy_floor.py):
            # odd counts, one of them across its reductions' chunks.
            counts = [1, 3 * n + 1, MAX_BYTES // 4]
            if collective != "barrier":
                counts += [MAX_BYTES // 4 + 3 * n + 1, _copy_floor.CHUNK_BYTES // 2 + 5]
            for count in counts:
                prepared = prepare_any(segment, collective, count)
                if prepared is None and count * 4 > MAX_BYTES:
                    # Every rank returns None here alike (see _copy_floor.Reader).
                    refused = True
                    continue
                if prepared is None:
                    print(f"floor: rank {r}: {collective} of {count} did not fit", flush=True)
                    return 1
                refill, steps, check = prepared
                call, call_scheduled = plain(segment, steps), scheduled(segment, steps)
                for i in range(2 * calls):
                    refill()
                    if i < calls:
                        call()
                    else:
                        await call_scheduled()
                    if not check():
                        print(f"floor: rank {r}: wrong {collective} of {count}", flush=True)
                        return 1
        if r == 0:
            done = "refused between these ranks" if refused else "checked"
            print(f"floor: single copies (process_vm_readv): {done}", flush=True)
        return 0

    return trio.run(check_all)


def main() -> None:
    parser = argparse.ArgumentParser(description="check the floor's results without MPI")
    parser.add_argument("--check", type=int, required=True, metavar="N", help="world size")
    parser.add_argument("--calls", type=int, default=20, help="calls per cell (default 20)")
    parser.add_argument("--seconds", type=float, default=30.0, help="give up after (default 30)")
    args = parser.parse_args()
    n = args.check
    mapping = mmap.mmap(-1, segment_bytes(n))  # anonymous and MAP_SHARED: the children share it
    children = []
    for r in range(n):
        pid = os.fork()
        if pid == 0:  # the rank
            status = 1
            try:
                status = _check_rank(mapping, r, n, args.calls)
            except BaseException as error:  # any failure ends the rank, and says why
                print(f"floor: rank {r}: {error!r}", flush=True)
            finally:
                os._exit(status)
        children.append(pid)
    # A rank that fails leaves its peers waiting for its counter: stop them all then, or
    # at the deadline.
    deadline = time.monotonic() + args.seconds
    failed = None
    while children and failed is None:
        for pid in list(children):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                children.remove(pid)
                if status:
                    failed = f"a rank exited with status {status}"
        if time.monotonic() > deadline and failed is None:
            failed = f"the ranks did not finish within {args.seconds} s"
        time.sleep(0.01)
    for pid in children:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    if failed:
        sys.exit(f"floor: {failed}")
    print(f"floor: world {n}: every result right", flush=True)


if __name__ == "__main__":
    main()
