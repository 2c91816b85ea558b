"""One rank of tests/test_allgather.py's real-process tests. Run as
``allgather_worker.py SCENARIO OUT_DIR INDEX [ARGS...]`` (see ``_worker_util`` for the marker
files and the JSON report).

- ``check``: every algorithm of allgather and allgatherv that runs at this world size
  (recursive doubling only at a power of two), forced in turn, at several sizes
  (0, 1, below the world size, odd, across the 1 MiB chunk), checked against numpy; the
  report holds the errors and a digest of every result, which must be the same on every rank.
- ``kill GATED``: ``agreed`` (a small allgather), then a ring allgather of 16 MiB per rank
  (marker ``entering`` just before it; rank ``GATED`` enters only once the test created
  ``gate``), during which the test SIGKILLs a rank; then ``after``, a barrier on the broken
  communicator.
- ``cancel FAMILY``: ``agreed``, then ``call``, an allgather or allgatherv (``FAMILY``) that
  rank 0 cancels (its deadline, ``CANCEL_AFTER_S``) while the others wait for rank 3, which
  enters only once the test created ``gate``; marker ``reported`` after the call.
"""

from __future__ import annotations

import hashlib
import time
from typing import TYPE_CHECKING, Any

import _worker_util
import numpy as np
import trio

if TYPE_CHECKING:
    import trioring

HANG_S = 10.0
CANCEL_AFTER_S = 0.5


def make(seed: int, rank: int, count: int) -> np.ndarray[Any, Any]:
    return np.random.default_rng([seed, rank]).integers(-8, 9, count).astype(np.float32)


async def check(
    reporter: _worker_util.Reporter, comm: trioring.Communicator, args: list[str]
) -> None:
    n, rank = comm.world_size, comm.rank
    errors: list[str] = []
    digest = hashlib.sha256()
    names = ["bruck", "ring"] + (["recursive_doubling"] if n & (n - 1) == 0 else [])
    for name in names:
        comm._force_algorithm("allgather", name)
        comm._force_algorithm("allgatherv", name)
        for seed, count in enumerate((0, 1, n - 1, 1023, 300_001)):
            inputs = [make(seed, q, count) for q in range(n)]
            g = await comm.allgather(inputs[rank])
            if not np.array_equal(g, np.stack(inputs)):
                errors.append(f"{name} allgather float32[{count}]: wrong result")
            digest.update(g.tobytes())
            rows = [(q * 7 + seed) % 5 * (count // 4 + 1) for q in range(n)]
            inputs = [make(seed, q, rows[q] * 2).reshape(rows[q], 2) for q in range(n)]
            parts = await comm.allgatherv(inputs[rank])
            if len(parts) != n or not all(
                np.array_equal(p, a) and p.shape == a.shape
                for p, a in zip(parts, inputs, strict=True)
            ):
                errors.append(f"{name} allgatherv float32{rows}x2: wrong result")
            for part in parts:
                digest.update(part.tobytes())
    reporter.report["errors"] = errors
    reporter.report["digest"] = digest.hexdigest()


async def kill(
    reporter: _worker_util.Reporter, comm: trioring.Communicator, args: list[str]
) -> None:
    gated = int(args[0])
    await reporter.step("agreed", lambda: comm.allgather(np.ones(4)), hang_after=HANG_S)
    comm._force_algorithm("allgather", "ring")
    if comm.rank == gated:
        await reporter.wait_for("gate")
    else:
        reporter.mark("entering")
    big = np.full(4 * 1024 * 1024, comm.rank, np.float32)
    await reporter.step("allgather", lambda: comm.allgather(big), hang_after=HANG_S)
    await reporter.step("after", comm.barrier, hang_after=HANG_S)


async def cancel(
    reporter: _worker_util.Reporter, comm: trioring.Communicator, args: list[str]
) -> None:
    family = args[0]
    await reporter.step("agreed", lambda: comm.allgather(np.ones(4)), hang_after=HANG_S)
    call = comm.allgather if family == "allgather" else comm.allgatherv
    x = np.zeros((5, 2), np.int32)
    if comm.rank == 3:
        await reporter.wait_for("gate")
    if comm.rank == 0:
        started = time.monotonic()
        with trio.move_on_after(CANCEL_AFTER_S) as scope:
            await call(x)
        reporter.record("call", started, None, cancelled=scope.cancelled_caught)
    else:
        await reporter.step("call", lambda: call(x), hang_after=HANG_S)
    reporter.mark("reported")


if __name__ == "__main__":
    _worker_util.main({"check": check, "kill": kill, "cancel": cancel})
