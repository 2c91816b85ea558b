"""One rank of tests/test_gather.py's real-process tests.

``trioring run -n N --transport T gather_worker.py MODE OUT_DIR [ARGS]``. Modes:

- ``check``: gather, gatherv, scatter (an array and a list) and scatterv at several sizes,
  dtypes and roots, checked against numpy, bitwise; the report (``rank{RANK}.json``) lists
  any errors.
- ``kill COLLECTIVE VICTIM ALGORITHM``: every rank runs COLLECTIVE (``gather``,
  ``gatherv``, ``scatter`` or ``scatterv``, root 0; the uneven ones with rank q's share
  (q + 1) MiB) on 16 MiB of float32 per rank (1 MiB chunks), by ALGORITHM
  (forced); rank VICTIM SIGKILLs itself in the middle of the call: by the tree at its third
  data frame, sent or received; by cross-memory attach (``cma``) as it exposes its
  array's address (a gather's peer: the root waits for it) or before it reads (a
  scatter's).
  Survivors report what they raised, about which peer, and how long after the call's
  start. They ignore SIGTERM, so that the launcher's teardown after the victim's death does
  not race their report.
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
from trioring import _framing
from trioring._onehost import _cma, _cma_collectives, _copies

#: Frames larger than this are data (the tokens and headers before them are smaller).
_DATA_FRAME = 64 * 1024


def make(seed: int, rank: int, shape: tuple[int, ...], dtype: str) -> np.ndarray[Any, Any]:
    values = np.random.default_rng([seed, rank]).integers(-100, 100, shape)
    return values.astype(dtype)


async def check(comm: trioring.Communicator, errors: list[str]) -> None:
    n, r = comm.world_size, comm.rank
    cases = [
        (0, 0, "float32"),
        (1, 1, "int8"),
        (2, 333, "float64"),
        (3, 70_001, "int64"),
        (4, 5, "bool"),
    ]
    for seed, size, dtype in cases:
        for root in sorted({0, n - 1}):
            x = make(seed, r, (size,), dtype)
            got = await comm.gather(x, root=root)
            if r == root:
                want = np.stack([make(seed, q, (size,), dtype) for q in range(n)])
                if got is None or got.tobytes() != want.tobytes() or got.shape != want.shape:
                    errors.append(f"gather {dtype}[{size}] root {root}: wrong result")
            elif got is not None:
                errors.append(f"gather root {root}: rank {r} got {got!r}")
            rows = [(size + 7 * q) % (size + 3) for q in range(n)]
            parts = await comm.gatherv(make(seed, r, (rows[r], 2), dtype), root=root)
            if r == root:
                want_parts = [make(seed, q, (rows[q], 2), dtype) for q in range(n)]
                if parts is None or any(
                    p.shape != w.shape or p.tobytes() != w.tobytes()
                    for p, w in zip(parts, want_parts, strict=True)
                ):
                    errors.append(f"gatherv {dtype}{rows} root {root}: wrong result")
            elif parts is not None:
                errors.append(f"gatherv root {root}: rank {r} got {parts!r}")
            blocks = make(seed, root, (n, size), dtype)
            mine = await comm.scatter(blocks if r == root else None, root=root)
            if mine.shape != (size,) or mine.tobytes() != blocks[r].tobytes():
                errors.append(f"scatter {dtype}[{n}x{size}] root {root}: wrong on rank {r}")
            listed = [make(seed, q, (rows[q], 3), dtype) for q in range(n)]
            mine = await comm.scatter(listed if r == root else None, root=root)
            if mine.shape != listed[r].shape or mine.tobytes() != listed[r].tobytes():
                errors.append(f"scatter of a list {dtype}{rows} root {root}: wrong on rank {r}")
            mine = await comm.scatterv(listed if r == root else None, root=root)
            if mine.shape != listed[r].shape or mine.tobytes() != listed[r].tobytes():
                errors.append(f"scatterv {dtype}{rows} root {root}: wrong on rank {r}")


def kill_at_third_data_frame(algorithm: str) -> None:
    """SIGKILL this process at its third data frame, sent or received (with ``cma``: as it
    exposes its array, a gather's peer, or before its first read, a scatter's peer; through
    the shared segment or by frames, whichever the communicator uses)."""
    if algorithm == "cma":

        def die(*args: Any, **kwargs: Any) -> Any:
            os.kill(os.getpid(), signal.SIGKILL)

        original_expose = _cma_collectives.expose

        async def expose(world: Any, spec: Any, exposed: Any, *args: Any) -> Any:
            if exposed is not None:
                die()
            return await original_expose(world, spec, exposed, *args)

        _cma_collectives.expose = _copies.expose = expose  # type: ignore[assignment]
        _cma.read_into = die
        return
    frames = [0]

    def count(nbytes: int) -> None:
        if nbytes > _DATA_FRAME:
            frames[0] += 1
            if frames[0] == 3:
                os.kill(os.getpid(), signal.SIGKILL)

    original_send, original_recv = _framing.Link.send, _framing.Link.recv

    async def send(self: Any, spec: Any, offset: int, payload: memoryview) -> None:
        count(payload.nbytes)
        await original_send(self, spec, offset, payload)

    async def recv(self: Any, spec: Any, offset: int, into: memoryview) -> None:
        await original_recv(self, spec, offset, into)
        count(into.nbytes)

    _framing.Link.send = send  # type: ignore[method-assign]
    _framing.Link.recv = recv  # type: ignore[method-assign]


async def main(mode: str, out_dir: Path, args: list[str]) -> int:
    errors: list[str] = []
    report: dict[str, Any] = {"errors": errors}
    if mode == "kill":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    with trio.fail_after(60):
        async with trioring.open_communicator() as comm:
            rank = comm.rank
            if mode == "check":
                await check(comm, errors)
            else:
                collective, victim, algorithm = args[0], int(args[1]), args[2]
                comm._force_algorithm(collective, algorithm)
                if rank == victim:
                    kill_at_third_data_frame(algorithm)
                n = comm.world_size
                x = np.ones(4 * 1024 * 1024, np.float32)
                await comm.barrier()
                started = time.monotonic()
                try:
                    if collective == "gather":
                        await comm.gather(x, root=0)
                    elif collective == "gatherv":
                        await comm.gatherv(x[: (rank + 1) * 1024 * 1024], root=0)
                    elif collective == "scatterv":
                        parts = [x[: (q + 1) * 1024 * 1024] for q in range(n)]
                        await comm.scatterv(parts if rank == 0 else None, root=0)
                    else:
                        blocks = np.ones((n, x.size), np.float32) if rank == 0 else None
                        await comm.scatter(blocks, root=0)
                except trioring.CollectiveError as exc:
                    report["error"] = type(exc).__name__
                    report["peer"] = exc.peer
                    report["message"] = str(exc)
                else:
                    report["error"] = None
                report["elapsed"] = time.monotonic() - started
    (out_dir / f"rank{rank}.json").write_text(json.dumps(report))
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(trio.run(main, sys.argv[1], Path(sys.argv[2]), sys.argv[3:]))
