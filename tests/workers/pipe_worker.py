"""One rank of tests/test_pipe.py: a broadcast through the shared segment's pipe (forced) of
16 MiB of float32 from root 0, sixteen chunks through a ring of four, that goes wrong.

``trioring run -n N --transport unix pipe_worker.py MODE OUT_DIR VICTIM``. Modes:

- ``kill``: rank VICTIM SIGKILLs itself as it finishes its third chunk (the root having
  written it, a receiver having copied it out), in the middle of the stream.
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

import numpy as np
import trio

import trioring
from trioring._onehost import _pipe

ELEMENTS = 4 * 1024 * 1024


def at_third_chunk(action: Any) -> None:
    """Run ``action`` as this rank finishes its third chunk of the pipe."""
    original = _pipe._yield_now_and_then
    calls = [0]

    async def counted(since: float) -> float:
        calls[0] += 1
        if calls[0] == 3:
            action()
        return await original(since)

    _pipe._yield_now_and_then = counted


async def main(mode: str, out_dir: Path, victim: int) -> int:
    report: dict[str, Any] = {}
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    with trio.fail_after(60):
        async with trioring.open_communicator() as comm:
            rank = comm.rank
            comm._force_algorithm("broadcast", "pipe")
            root = 0
            scope = trio.CancelScope()
            if rank == victim:
                if mode == "kill":
                    at_third_chunk(lambda: os.kill(os.getpid(), signal.SIGKILL))
                elif mode == "cancel":
                    at_third_chunk(scope.cancel)
                else:
                    root = victim
            x = np.full(ELEMENTS, float(rank), np.float32)
            await comm.barrier()
            started = time.monotonic()
            try:
                with scope:
                    await comm.broadcast(x, root=root)
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
    sys.exit(trio.run(main, sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])))
