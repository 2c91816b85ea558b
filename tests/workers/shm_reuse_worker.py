"""One rank of tests/test_shm_reuse.py: shared-segment barriers with a scan between them (a
collective by the sockets in which, at world 3, rank 1 hears only from rank 0), where rank 2
stalls right after publishing each barrier, as a rank does that the scheduler puts aside.
Rank 1 then finishes the scan and reaches the next barrier, which uses the same slot of the
segment, while rank 2 has not yet read the last one: it must wait for rank 2 rather than
overwrite what rank 2 is about to read (which rank 2 would take for a mismatch, or worse, for
data).

``trioring run -n 3 --transport unix shm_reuse_worker.py OUT_DIR``: the report
(``rank{RANK}.json``) holds the error, if any, the features and the checked scan results.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import trio

import trioring
from trioring._onehost import _shm_collectives

ROUNDS = 8
STALL_S = 0.15


def stall_after_publishing() -> None:
    """Make this rank stop for STALL_S (the whole process: time.sleep) right after it
    publishes a barrier on the segment, before it looks at its peers'."""
    publish = _shm_collectives.shm_publish

    def stalling(world: Any, spec: Any, nbytes: int) -> None:
        publish(world, spec, nbytes)
        if spec.kind.label == "barrier":
            time.sleep(STALL_S)

    _shm_collectives.shm_publish = stalling  # type: ignore[assignment]


async def main(out_dir: Path) -> None:
    report: dict[str, Any] = {"error": None, "wrong": 0}
    async with trioring.open_communicator() as comm:
        report["features"] = sorted(comm.features)
        if comm.rank == 2:
            stall_after_publishing()
        try:
            with trio.fail_after(60):
                for i in range(ROUNDS):
                    await comm.barrier()
                    x = np.full(3, comm.rank + i, np.int64)
                    await comm.scan(x)
                    expected = sum(q + i for q in range(comm.rank + 1))
                    report["wrong"] += int(not np.all(x == expected))
                await comm.barrier()
        except trioring.CollectiveError as exc:
            report["error"] = f"{type(exc).__name__}: {exc}"
        (out_dir / f"rank{comm.rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    trio.run(main, Path(sys.argv[1]))
