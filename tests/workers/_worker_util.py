"""What the worker scripts in this directory share.

A worker is one rank: ``python <script> SCENARIO OUT_DIR INDEX [ARGS...]``, configured by the
environment as a user's process would be (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ...).
``INDEX`` names its files in ``OUT_DIR`` (it is the rank, except in worlds that deliberately
have two processes with the same ``RANK``):

- ``w{INDEX}.connected``: created once ``open_communicator`` has returned;
- ``w{INDEX}.<name>``: other markers a scenario creates for the test to wait on;
- ``w{INDEX}.json``: the report, written atomically when the worker ends: one entry per step
  with the exception it raised (type, message, attributes) and how long it took.

Expected trioring errors are recorded, not raised, and the worker exits with status 0; any
exit status other than 0 means the worker itself went wrong (its traceback is in its log).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio

import trioring

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

#: Bound on open_communicator (rendezvous of a healthy world takes < 1 s); a test that expects
#: a rank to wait for peers that never come lowers it with WORKER_OPEN_TIMEOUT_S.
OPEN_TIMEOUT_S = float(os.environ.get("WORKER_OPEN_TIMEOUT_S", "20"))
#: Polling interval for marker files.
POLL_S = 0.005


def is_cancellation(exc: BaseException | None) -> bool:
    """``trio.Cancelled``, or an exception group holding nothing else."""
    if isinstance(exc, BaseExceptionGroup):
        return exc.split(trio.Cancelled)[1] is None
    return isinstance(exc, trio.Cancelled)


def describe(exc: BaseException) -> dict[str, Any]:
    """An exception as JSON: type, message, trioring attributes and cause."""
    cause = exc.__cause__
    cause_errno = getattr(cause, "errno", None)
    return {
        "type": type(exc).__name__,
        "mro": [cls.__name__ for cls in type(exc).__mro__],
        "trioring": isinstance(exc, trioring.TrioringError),
        "message": str(exc),
        "rank": getattr(exc, "rank", None),
        "peer": getattr(exc, "peer", None),
        "collective": getattr(exc, "collective", None),
        "seq": getattr(exc, "seq", None),
        "reason": getattr(exc, "reason", None),
        "cause": None if cause is None else type(cause).__name__,
        "cause_is_cancellation": is_cancellation(cause),
        "address_in_use": cause_errno == errno.EADDRINUSE,
        "notes": list(getattr(exc, "__notes__", [])),
        "group": [
            f"{type(sub).__name__}: {sub}"
            + (f" (from {type(sub.__cause__).__name__}: {sub.__cause__})" if sub.__cause__ else "")
            for sub in getattr(exc, "exceptions", ())
        ],
    }


def count_calls(calls: dict[str, int], module: Any, name: str) -> None:
    """Replace the async function ``module.name`` with one that counts its calls in
    ``calls[name]``: how a worker tells its test which algorithm the decision table ran.
    The collectives look their algorithm up on the module at each call, so this sees
    them all."""
    original = getattr(module, name)

    @functools.wraps(original)
    async def wrapper(*args: Any, **kwargs: Any) -> None:
        calls[name] = calls.get(name, 0) + 1
        await original(*args, **kwargs)

    setattr(module, name, wrapper)


def slot_pieces_on_any_cpu() -> None:
    """Copy broadcasts of more than three pieces through the slots piece by piece where no
    rank is crowded, as on Intel CPUs, whatever this machine's CPU (elsewhere the slots copy
    whole: trioring._onehost._shm.slot_pieces_from_bytes), so that the piece protocol is
    tested on every machine. Every rank's worker calls it alike; crowded ranks still copy
    whole."""
    from trioring._onehost import _shm, _shm_collectives

    _shm_collectives._PIECES_FROM_BYTES = _shm.slot_pieces_from_bytes("GenuineIntel")


def write_atomically(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


class Reporter:
    def __init__(self, out_dir: Path, index: int) -> None:
        self.out_dir = out_dir
        self.index = index
        self.report: dict[str, Any] = {"index": index, "pid": os.getpid(), "steps": {}}

    def record(self, step: str, started: float, exc: BaseException | None, **extra: Any) -> None:
        # "ended" on the host's monotonic clock, to set beside other processes' marks (a
        # fault's time, a peer's end): "elapsed" also counts waits for peers to start.
        ended = time.monotonic()
        self.report["steps"][step] = {
            "elapsed": ended - started,
            "ended": ended,
            "error": None if exc is None else describe(exc),
            **extra,
        }

    async def step(
        self, name: str, function: Callable[[], Awaitable[object]], *, hang_after: float
    ) -> BaseException | None:
        """Run ``function`` and record how it ended. After ``hang_after`` seconds it is
        cancelled and recorded as ``TooSlowError``, i.e. "this rank hung"."""
        started = time.monotonic()
        try:
            with trio.fail_after(hang_after):
                await function()
        except Exception as exc:
            self.record(name, started, exc)
            return exc
        self.record(name, started, None)
        return None

    def mark(self, name: str) -> None:
        write_atomically(self.out_dir / f"w{self.index}.{name}", b"")

    def write(self, filename: str, data: bytes) -> None:
        write_atomically(self.out_dir / filename, data)

    async def wait_for(self, filename: str) -> None:
        """Wait until ``OUT_DIR/filename`` exists (created by the test or another worker
        process, hence polling: a trio.Event cannot cross processes). Callers bound it."""
        path = self.out_dir / filename
        while not path.exists():  # noqa: ASYNC110
            await trio.sleep(POLL_S)

    def save(self) -> None:
        write_atomically(
            self.out_dir / f"w{self.index}.json", json.dumps(self.report, indent=1).encode()
        )


async def _run(reporter: Reporter, scenario: Any, args: list[str]) -> None:
    started = time.monotonic()
    async with contextlib.AsyncExitStack() as stack:
        try:
            with trio.fail_after(OPEN_TIMEOUT_S):
                comm = await stack.enter_async_context(trioring.open_communicator())
        except Exception as exc:
            reporter.record("open", started, exc)
            return
        reporter.record(
            "open",
            started,
            None,
            rank=comm.rank,
            world_size=comm.world_size,
            transport=comm.transport,
        )
        reporter.mark("connected")
        await scenario(reporter, comm, args)


def run_reporting(reporter: Reporter, async_fn: Any, *args: Any) -> None:
    """``trio.run(async_fn, reporter, *args)``; the report is saved whatever happens, with
    the traceback of a crash in it."""
    try:
        trio.run(async_fn, reporter, *args)
    except BaseException:
        reporter.report["crash"] = traceback.format_exc()
        raise
    finally:
        reporter.save()


def main(scenarios: dict[str, Any]) -> None:
    """Run the scenario named by ``sys.argv[1]`` (see the module docstring)."""
    name, out_dir, index, *args = sys.argv[1:]
    if cpus := os.environ.get("WORKER_CPUS"):
        # Pinned before the communicator opens, as a launcher that binds ranks to cores does.
        os.sched_setaffinity(0, {int(cpu) for cpu in cpus.split(",")})
    run_reporting(Reporter(Path(out_dir), int(index)), _run, scenarios[name], args)
