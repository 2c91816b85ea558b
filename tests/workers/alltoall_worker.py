"""One rank of tests/test_alltoall.py's real-process tests.

``trioring run -n N --transport T alltoall_worker.py MODE OUT_DIR [ARGS]``. Modes:

- ``check``: alltoall by both algorithms (forced in turn, then the table's choice) at
  several block sizes (0, 1, below the world size, odd, across the 1 MiB chunk) and dtypes,
  and alltoallv with uneven sizes (zeros on some pairs, one block across a chunk), checked
  against numpy; the report (``rank{RANK}.json``) lists any errors and a digest of what
  every rank sent, which must be the same on every rank.
- ``kill VICTIM``: every rank runs a pairwise alltoall of 4 MiB blocks (1 MiB chunks); rank
  VICTIM SIGKILLs itself at its sixth chunk, in the middle of the call. Survivors report
  what they raised (type, peer) and how long after the call's start. They ignore SIGTERM,
  so that the launcher's teardown after the victim's death does not race their report.
"""

from __future__ import annotations

import hashlib
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
from trioring._algorithms import _pairwise


def make(seed: int, rank: int, count: int, dtype: str) -> np.ndarray[Any, Any]:
    """Values that differ by rank, seed and position (cheap: the large cases are 10^6s)."""
    return ((np.arange(count, dtype=np.int64) * (2 * rank + 3) + seed * 7 + rank) % 97).astype(
        dtype
    )


async def check(comm: trioring.Communicator, report: dict[str, Any]) -> None:
    n, r = comm.world_size, comm.rank
    errors: list[str] = report["errors"]
    digest = hashlib.sha256()
    for name in ("bruck", "pairwise", None):
        comm._force_algorithm("alltoall", name)
        cases = [(0, "float32"), (1, "int8"), (max(n - 1, 1), "bool"), (37, "complex128")]
        cases += [(300_001, "float32")]
        for seed, (block, dtype) in enumerate(cases):
            inputs = [make(seed, q, n * block, dtype).reshape(n, block) for q in range(n)]
            got = await comm.alltoall(inputs[r])
            expected = np.stack([inputs[q][r] for q in range(n)])
            if got.shape != inputs[r].shape or got.tobytes() != expected.tobytes():
                errors.append(f"{name} alltoall {dtype}[{n}x{block}]: wrong result")
            digest.update(np.stack(inputs).tobytes())
    for seed, scale in enumerate((1, 70_000)):
        # rows[q][p]: what rank q sends to rank p; zeros on some pairs.
        rows = [[(q * 3 + p * 5 + seed) % 4 * scale for p in range(n)] for q in range(n)]
        inputs = [
            [
                make(seed, q * n + p, rows[q][p] * 2, "int64").reshape(rows[q][p], 2)
                for p in range(n)
            ]
            for q in range(n)
        ]
        parts = await comm.alltoallv(inputs[r])
        for q in range(n):
            if parts[q].shape != inputs[q][r].shape or not np.array_equal(parts[q], inputs[q][r]):
                errors.append(f"alltoallv rows {rows}: wrong block from rank {q}")
        for q in range(n):
            for p in range(n):
                digest.update(inputs[q][p].tobytes())
    report["digest"] = digest.hexdigest()


def kill_at_sixth_chunk() -> None:
    original = _pairwise.bytes_of
    calls = [0]

    def counting(flat: Any, offset: int, count: int) -> memoryview:
        calls[0] += 1
        if calls[0] == 6:
            os.kill(os.getpid(), signal.SIGKILL)
        return original(flat, offset, count)

    _pairwise.bytes_of = counting  # type: ignore[assignment]


async def main(mode: str, out_dir: Path, args: list[str]) -> int:
    report: dict[str, Any] = {"errors": []}
    if mode == "kill":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    with trio.fail_after(60):
        async with trioring.open_communicator() as comm:
            rank = comm.rank
            if mode == "check":
                await check(comm, report)
            else:
                victim = int(args[0])
                comm._force_algorithm("alltoall", "pairwise")
                x = np.ones(comm.world_size * 1024 * 1024, np.float32)
                await comm.barrier()
                if rank == victim:
                    kill_at_sixth_chunk()
                started = time.monotonic()
                try:
                    if args[1:] == ["alltoallv"]:
                        await comm.alltoallv(list(x.reshape(comm.world_size, -1)))
                    else:
                        await comm.alltoall(x)
                except trioring.CollectiveError as exc:
                    report["error"] = type(exc).__name__
                    report["peer"] = exc.peer
                    report["message"] = str(exc)
                else:
                    report["error"] = None
                report["elapsed"] = time.monotonic() - started
    (out_dir / f"rank{rank}.json").write_text(json.dumps(report))
    return 1 if report["errors"] else 0


if __name__ == "__main__":
    sys.exit(trio.run(main, sys.argv[1], Path(sys.argv[2]), sys.argv[3:]))
