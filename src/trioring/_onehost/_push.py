"""A broadcast's root writing part of its array into the readers' arrays while they read the
rest (``process_vm_writev``): where every rank of the host has a CPU of its own, the root's
core otherwise only waits while each reader copies the whole array alone.

Writing into another process's memory is safe only while that process waits for the write,
so the protocol is about one thing: no write may land in a reader's array once the reader's
call has ended, however it ended. Each side announces itself before it looks at the other,
with a full fence between (:func:`fence`), so at least one of them sees the other:

* the root stores ``2 * seq`` in its *pushing* word (:data:`~._shm.PUSHING`), then looks at
  a reader's sequence word before every write step (at most ``PUSH_STEP_BYTES``), and
  writes only while it is not ``BROKEN``; once it has stopped, for any reason, it stores
  ``2 * seq + 1``;
* a reader that leaves the call early (cancelled, or failing) first marks its sequence word
  ``BROKEN``, then looks at the root's pushing word: if the root may be writing (``2 *
  seq``), it waits, shielded, until the root stores that it has stopped, or its connection
  ends (its process is gone: the kernel closes a dead process's sockets only after its
  memory is gone, so no write of it is still under way). A root that runs stops within one
  step (a millisecond at most here); one stopped by a signal or a debugger in the middle
  of its write steps holds a reader's cancellation until it runs again or dies.

A reader that completes its call waits anyway for the root's *done* word, which the root
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
    import numpy as np

    from .._algorithms import World
    from .._wire import OpSpec

__all__ = ["PUSH_MIN_BYTES", "PUSH_STEP_BYTES", "fence", "push_bytes", "push_into", "pushed"]

#: Above this many bytes (the largest broadcast the segment's slots take) a broadcast's
#: root writes a share of its array into its readers' arrays where it may (see
#: push_bytes), instead of streaming it through the segment's pipe or having them read it
#: in threads. At world 2 (bench/paired.py --windows 5, against Open MPI in the same ranks,
#: ratio to its time, pushed / through the pipe, runs alternating by TRIORING_PUSH): 384 KiB
#: 1.31 / 1.72, 512 KiB 1.11 / 1.40, 768 KiB 1.00 / 1.33, 1 MiB 1.03 / 1.32, 2 MiB 1.01 /
#: 1.35, 4 MiB 0.87 / 1.42, 8 MiB 0.72 / 1.27, 16 MiB 0.52 / 0.75; pushed / read in two
#: threads: 24 MiB 0.56 / 0.70, 64 MiB 0.60 / 0.68. Below, the slots won (forced, pushed /
#: slots: 64 KiB 2.20 / 1.48, 128 KiB 1.43 / 1.06, 256 KiB 1.70 / 1.14).
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


def push_bytes(world: World, nbytes: int) -> int:
    """How many bytes (the end of the array) a broadcast's root writes into each reader's
    array of ``nbytes``: ``nbytes / n`` in whole pages, so that each of the ``n`` ranks
    copies ``(n - 1) / n`` of it; 0 (the readers read it all) unless the ranks agreed on
    pushing (:attr:`~._shm.SharedSlots.push`), there is a CPU for each of them, and the
    array has at least ``PUSH_MIN_BYTES``. The same on every rank."""
    slots = world.shm
    if slots is None or not slots.push or nbytes < PUSH_MIN_BYTES or slots.cpus < world.size:
        return 0
    return nbytes // world.size // _PAGE * _PAGE


async def push_into(
    world: World,
    spec: OpSpec,
    announced: np.ndarray,
    flat: np.ndarray,
    readers: list[int],
    share: int,
) -> None:
    """The root's writes: the last ``share`` bytes of ``flat`` into each reader's array
    (``announced``: every rank's address and size, see _cma_collectives.expose), reader by
    reader, while they read the rest. Stops writing into a reader that gave up. Checks
    for cancellation between steps but never yields meanwhile, so nothing else of this
    process runs while a reader may wait for the writes to stop."""
    slots = world.shm
    assert slots is not None
    assert world.peer_pids is not None
    seqs = slots.seqs
    pushing = slots.own_word + PUSHING
    nbytes = flat.nbytes
    local = _cma.data_address(flat) + nbytes - share
    seqs[pushing] = 2 * spec.seq
    fence()
    try:
        for peer in readers:
            word = peer * LINE // 8
            if seqs[word] == BROKEN:
                continue  # it left: finish raises its reason
            address = int(announced[peer, 0]) + nbytes - share
            if int(announced[peer, 1]) != nbytes:
                link = world.links[peer]
                raise link.protocol_error(spec, f"announced an array of {announced[peer, 1]} bytes")
            pid = world.peer_pids[peer]
            done = 0
            while done < share and seqs[word] != BROKEN:
                step = min(PUSH_STEP_BYTES, share - done)
                try:
                    _cma.write_into(pid, address + done, local + done, step)
                except _cma.CmaError as exc:
                    link = world.links[peer]
                    raise await link.explained(
                        spec, link.memory_failed(spec, exc, wrote=True)
                    ) from exc
                done += step
                await trio.lowlevel.checkpoint_if_cancelled()
    finally:
        slots.store(pushing, 2 * spec.seq + 1)


async def pushed(world: World, spec: OpSpec, root: int) -> None:
    """Call in a reader of a pushed broadcast that is leaving ``spec``'s call early (with
    the exception on its way): marks this rank as gone in the segment, and returns once
    ``root`` cannot write into its array any more. Shielded: the wait is for the root's
    current write step (or for nothing, if it was not writing)."""
    slots = world.shm
    assert slots is not None
    slots.mark_broken()
    fence()
    seqs = slots.seqs
    word = root * LINE // 8 + PUSHING
    writing = 2 * spec.seq
    if seqs[word] != writing:
        return
    fd = next(fd for fd, peer in slots.link_of_fd.items() if peer == root)
    ended = select.poll()
    ended.register(fd, select.POLLRDHUP)
    since = time.perf_counter()
    with trio.CancelScope(shield=True):
        while seqs[word] == writing:
            # Its connection hung up: its process is gone (or closed the communicator,
            # which it cannot do within its writes). Closed here (POLLNVAL: another task
            # closed this communicator), the root ends its writes within its share.
            if any(event & ~select.POLLNVAL for _, event in ended.poll(0)):
                return
            # Within a step, at once; past a millisecond the root is not running, and the
            # look may as well sleep.
            if time.perf_counter() - since < 0.001:
                await trio.lowlevel.checkpoint()
            else:
                await trio.sleep(0.001)
