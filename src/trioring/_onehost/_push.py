"""Ranks writing into their peers' arrays (``process_vm_writev``) on one host: a broadcast's
root writes a share of its array into the readers' while they read the rest (its core
otherwise only waits), and each rank of an allreduce (a reduce) writes each piece of its
segment into every peer's array (the root's) as soon as it has reduced it, from its cache,
instead of the peers reading the finished segments from memory afterwards.

Writing into another process's memory is safe only while that process waits for the write,
so the protocol is about one thing: no write may land in an array once its owner's call
has ended, however it ended. Each side announces itself before it looks at the other,
with a full fence between (:func:`fence`), so at least one of them sees the other:

* a writer stores ``2 * seq`` in its *pushing* word (:data:`~._shm.PUSHING`,
  :func:`begin`), then looks at the owner's sequence word before every write (at most
  ``PUSH_STEP_BYTES``, or one piece of a reduction), and writes only while it is not
  ``BROKEN``; before anything that may let other tasks run, and once it has stopped, for
  any reason, it stores ``2 * seq + 1`` (:func:`end`);
* an owner that leaves the call early (cancelled, or failing) first marks its sequence
  word ``BROKEN``, then looks at each writer's pushing word: where one may be writing
  (``2 * seq``), it waits, shielded, until that writer stores that it has stopped, or its
  connection ends (its process is gone: the kernel closes a dead process's sockets only
  after its memory is gone, so no write of it is still under way) (:func:`pushed`). A
  writer that runs stops within one step (a millisecond at most here); one stopped by a
  signal or a debugger in the middle of its writes holds an owner's cancellation until it
  runs again or dies.

An owner that completes its call waits anyway for every writer's *done* word, which each
stores after its writes. Only on x86-64, whose stores reach other cores in program order
(as the segment's protocols assume elsewhere, see _cma.STORES_IN_ORDER), where a locked
instruction is a full fence.
"""

from __future__ import annotations

import select
import threading
import time
from typing import TYPE_CHECKING

import trio

from . import _cma
from ._shm import BROKEN, LINE, PUSHING

if TYPE_CHECKING:
    from collections.abc import Iterable, Sequence

    from .._algorithms import World
    from .._errors import CollectiveError
    from .._wire import OpSpec

__all__ = [
    "PUSH_MIN_BYTES",
    "PUSH_STEP_BYTES",
    "begin",
    "can_push",
    "end",
    "failed",
    "fence",
    "push_bytes",
    "push_into",
    "pushed",
    "write",
]

#: Above this many bytes (the largest broadcast the segment's slots take where they copy
#: it whole; where they take it in pieces, up to the whole slot: see
#: _collectives._broadcast.shm_limit) a broadcast's
#: root writes a share of its array into its readers' arrays where it may (see
#: push_bytes), instead of streaming it through the segment's pipe or having them read it
#: in threads. At world 2 (bench/paired.py --windows 5, against Open MPI in the same ranks,
#: ratio to its time, pushed / through the pipe, runs alternating by TRIORING_PUSH): 384 KiB
#: 1.31 / 1.72, 512 KiB 1.11 / 1.40, 768 KiB 1.00 / 1.33, 1 MiB 1.03 / 1.32, 2 MiB 1.01 /
#: 1.35, 4 MiB 0.87 / 1.42, 8 MiB 0.72 / 1.27, 16 MiB 0.52 / 0.75; pushed / read in two
#: threads: 24 MiB 0.56 / 0.70, 64 MiB 0.60 / 0.68. Below, the slots won (forced, pushed /
#: slots: 64 KiB 2.20 / 1.48, 128 KiB 1.43 / 1.06, 256 KiB 1.70 / 1.14). Those were the
#: Intel machine's numbers: on other CPUs the decision table pushes broadcasts, allreduces
#: and reduces only above the pipe's limits for pushed calls (_collectives._limits.
#: PipeLimits), where an AMD EPYC measured the pipe ahead.
PUSH_MIN_BYTES = 256 * 1024
#: The root looks at the reader's word between writes of at most this many bytes, so a
#: reader that leaves waits at most one (1 MiB: about 0.1-0.2 ms here).
PUSH_STEP_BYTES = 1024 * 1024
_PAGE = 4096

# An uncontended lock's acquire and release are each a locked instruction (glibc's
# semaphores), a full fence on x86-64: the one Python code can issue.
_FENCE = threading.Lock()


def fence() -> None:
    """Order this thread's earlier stores before its later loads (x86-64)."""
    _FENCE.acquire()
    _FENCE.release()


def can_push(world: World) -> bool:
    """Whether the ranks agreed on pushing (:attr:`~._shm.SharedSlots.push`): the same on
    every rank. An allreduce's ranks then write their finished segments into each other's
    arrays: every rank works in an allreduce, and what the writes save is a pass over
    memory, at any number of ranks per CPU (at world 4 on 2 vCPUs, bench/paired.py, two
    runs alternating: 64 MiB 0.46-0.47 of Open MPI's time against 0.57-0.59, 4 MiB
    0.89-0.91 against 1.33-1.34, 1 MiB 1.35-1.40 against 1.65-1.74)."""
    slots = world.shm
    return slots is not None and slots.push


def push_bytes(world: World, nbytes: int) -> int:
    """How many bytes (the end of the array) a broadcast's root writes into each reader's
    array of ``nbytes``: ``nbytes / n`` in whole pages, so that each of the ``n`` ranks
    copies ``(n - 1) / n`` of it; 0 (the readers read it all) unless :func:`can_push`, every
    rank has a CPU of its own (what the root's writes use is the core that would otherwise
    wait: at world 4 on 2 vCPUs they won nothing, 1 MiB 1.64-1.85 of Open MPI's time against
    1.01-1.55 through the pipe, 4 MiB 1.04-1.08 against 1.01-1.49, 64 MiB 0.68 against
    0.67-0.69), and the array has more than ``PUSH_MIN_BYTES``. The same on every rank."""
    if nbytes <= PUSH_MIN_BYTES or not can_push(world):
        return 0
    assert world.shm is not None
    return nbytes // world.size // _PAGE * _PAGE if world.shm.cpus >= world.size else 0


def begin(world: World, spec: OpSpec) -> None:
    """Say that this rank may write into peers' arrays for ``spec`` from now on (before it
    looks at any peer's word: see the module's docs)."""
    slots = world.shm
    assert slots is not None
    slots.seqs[slots.own_word + PUSHING] = 2 * spec.seq
    fence()


def end(world: World, spec: OpSpec) -> None:
    """Say that this rank writes no more for ``spec`` (until :func:`begin` again): before
    anything that may let other tasks run, and once its writes are over, however that is."""
    slots = world.shm
    assert slots is not None
    slots.store(slots.own_word + PUSHING, 2 * spec.seq + 1)


def write(world: World, peer: int, remote: int, local: int, nbytes: int) -> bool:
    """Between :func:`begin` and :func:`end`: write ``nbytes`` from ``local`` here to
    ``remote`` in ``peer``'s memory, in one system call, unless the peer has given up (then
    False; the call's end raises its reason). Raises _cma.CmaError."""
    slots = world.shm
    assert slots is not None
    assert world.peer_pids is not None
    if slots.seqs[peer * LINE // 8] == BROKEN:
        return False
    _cma.write_into(world.peer_pids[peer], remote, local, nbytes)
    return True


async def failed(world: World, spec: OpSpec, peer: int, exc: _cma.CmaError) -> CollectiveError:
    """The error to raise for a failed write into ``peer``'s memory (ends the writes)."""
    end(world, spec)
    return await world.links[peer].memory_error(spec, exc, wrote=True)


async def push_into(
    world: World, spec: OpSpec, targets: Sequence[tuple[int, int, int, int]]
) -> None:
    """Write into peers' memory: ``targets`` are (peer, address there, address here, bytes),
    written in turn while the peers wait for them (each announced the array written into,
    see _cma_collectives.expose, and the caller checked its size), in steps of at most
    ``PUSH_STEP_BYTES``. Stops writing into a peer that gave up. Checks for cancellation
    between steps but never yields meanwhile, so nothing else of this process runs while a
    peer may wait for the writes to stop."""
    begin(world, spec)
    try:
        for peer, remote, local, nbytes in targets:
            done = 0
            while done < nbytes:
                step = min(PUSH_STEP_BYTES, nbytes - done)
                try:
                    if not write(world, peer, remote + done, local + done, step):
                        break
                except _cma.CmaError as exc:
                    raise await failed(world, spec, peer, exc) from exc
                done += step
                await trio.lowlevel.checkpoint_if_cancelled()
    finally:
        end(world, spec)


async def pushed(world: World, spec: OpSpec, writers: Iterable[int]) -> None:
    """Call in a rank that peers (``writers``) push into, as it leaves ``spec``'s call
    early (with the exception on its way): marks this rank as gone in the segment, and
    returns once no writer can write into its arrays any more. Shielded: the wait is for
    each writer's current write step (or for nothing, where it was not writing)."""
    slots = world.shm
    assert slots is not None
    slots.mark_broken()
    fence()
    seqs = slots.seqs
    writing = 2 * spec.seq
    fd_of = {peer: fd for fd, peer in slots.link_of_fd.items()}
    with trio.CancelScope(shield=True):
        for writer in writers:
            word = writer * LINE // 8 + PUSHING
            if seqs[word] != writing:
                continue
            ended = select.poll()
            ended.register(fd_of[writer], select.POLLRDHUP)
            since = time.perf_counter()
            while seqs[word] == writing:
                # Its connection hung up: its process is gone (or closed the communicator,
                # which it cannot do within its writes). Closed here (POLLNVAL: another
                # task closed this communicator), the writer ends within its share.
                if any(event & ~select.POLLNVAL for _, event in ended.poll(0)):
                    break
                # Within a step, at once; past a millisecond the writer is not running,
                # and the look may as well sleep.
                if time.perf_counter() - since < 0.001:
                    await trio.lowlevel.checkpoint()
                else:
                    await trio.sleep(0.001)
