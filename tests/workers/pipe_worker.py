"""One rank of tests/test_pipe.py: a collective through the shared segment's pipe (forced) of
16 MiB of float32 (rooted ones from root 0), sixteen chunks or more through a ring of four,
that goes wrong.

``trioring run -n N --transport unix pipe_worker.py MODE OUT_DIR VICTIM [COLLECTIVE]``
(COLLECTIVE: ``broadcast``, the default, ``allreduce``, ``reduce``, ``reduce_scatter``,
``allgather``, ``gather``, ``scatter`` or ``alltoall``; ``mismatch`` is a broadcast; or
``slot_broadcast``, a 256 KiB broadcast through the slots, in four pieces as where no
rank is crowded).
Modes:

- ``kill``: rank VICTIM SIGKILLs itself as it finishes its third chunk (written, copied
  out or reduced), in the middle of the stream; in a ``slot_broadcast``, as the root
  says that its third piece is in.
- ``cancel``: rank VICTIM cancels its call at the same point (a cancel scope it cancels
  itself), and reports whether it was cancelled.
- ``mismatch``: rank VICTIM names itself the root; the others name rank 0.

Survivors report what they raised and how long after the call's start. They ignore SIGTERM,
so that the launcher's teardown after a death does not race their report.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import _worker_util
import numpy as np
import trio

import trioring
from trioring._onehost import _pipe, _shm

ELEMENTS = 4 * 1024 * 1024


def at_third_chunk(action: Any, collective: str) -> None:
    """Run ``action`` as this rank finishes its third chunk of the pipe (the third piece
    of a ``slot_broadcast``'s root)."""
    if collective == "slot_broadcast":
        store = _shm.SharedSlots.store

        def counted_store(self: Any, word: int, value: int) -> None:
            store(self, word, value)
            if (
                word == self.own_word + _shm.PRODUCED
                and value & ((1 << _shm.PROGRESS_BITS) - 1) == 3
            ):
                action()

        _shm.SharedSlots.store = counted_store  # type: ignore[method-assign]
        return
    original = _pipe._Stream.breathe
    calls = [0]

    async def counted(self: Any) -> None:
        calls[0] += 1
        if calls[0] == 3:
            action()
        await original(self)

    _pipe._Stream.breathe = counted  # type: ignore[method-assign]


def call(comm: trioring.Communicator, collective: str, root: int) -> Any:
    """The collective ``collective`` of 16 MiB in all, forced through the pipe."""
    n, rank = comm.world_size, comm.rank
    if collective == "slot_broadcast":
        comm._force_algorithm("broadcast", "shm")
        # In pieces, as where no rank is crowded (every rank sets it alike), on any CPU.
        assert comm._world.shm is not None
        comm._world.shm.crowded = False
        _worker_util.slot_pieces_on_any_cpu()
        return comm.broadcast(np.full(_shm.SHM_MAX_BYTES // 4, float(rank), np.float32), root=root)
    comm._force_algorithm(collective, "pipe")
    x = np.full(ELEMENTS, float(rank), np.float32)
    if collective == "broadcast":
        return comm.broadcast(x, root=root)
    if collective == "allreduce":
        return comm.allreduce(x)
    if collective == "reduce":
        return comm.reduce(x, root=root)
    if collective == "reduce_scatter":
        return comm.reduce_scatter(x.reshape(n, -1))
    if collective == "alltoall":
        return comm.alltoall(x[: ELEMENTS // n * n].reshape(n, -1))
    block = x[: ELEMENTS // n]
    if collective == "allgather":
        return comm.allgather(block)
    if collective == "gather":
        return comm.gather(block, root=root)
    assert collective == "scatter"
    return comm.scatter(x[: ELEMENTS // n * n].reshape(n, -1) if rank == root else None, root=root)


async def main(mode: str, out_dir: Path, victim: int, collective: str) -> int:
    report: dict[str, Any] = {}
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    with trio.fail_after(60):
        async with trioring.open_communicator() as comm:
            rank = comm.rank
            root = 0
            scope = trio.CancelScope()
            if rank == victim:
                if mode == "kill":
                    at_third_chunk(lambda: os.kill(os.getpid(), signal.SIGKILL), collective)
                elif mode == "cancel":
                    at_third_chunk(scope.cancel, collective)
                else:
                    root = victim
            await comm.barrier()
            started = time.monotonic()
            try:
                with scope:
                    await call(comm, collective, root)
            except trioring.CollectiveError as exc:
                report["error"] = type(exc).__name__
                report["message"] = str(exc)
                report["peer"] = getattr(exc, "peer", None)
            else:
                report["error"] = None
            report["cancelled"] = scope.cancelled_caught
            report["broken"] = comm.broken
            report["elapsed"] = time.monotonic() - started
            (out_dir / f"rank{rank}.json").write_text(json.dumps(report))
    return 0


if __name__ == "__main__":
    collective = sys.argv[4] if sys.argv[4:] else "broadcast"
    sys.exit(trio.run(main, sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), collective))
