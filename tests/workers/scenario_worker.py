"""Worker for ``test_multiprocess_errors.py``: one rank of a world in which something goes
wrong. Run as ``scenario_worker.py SCENARIO OUT_DIR INDEX [ARG]`` (see ``_worker_util``).

Scenarios:

- ``open``: open the communicator (the report records how that ended), then one barrier.
- ``mismatch CASE``: two good collectives, then one where rank 1 disagrees with the others
  (``CASE`` says how), then a barrier on the broken communicator.
- ``cancel CANCELLER GATED``: one allreduce of a large array, which rank ``CANCELLER``
  abandons after 0.2 s by ``trio.move_on_after``; rank ``GATED`` joins only once the
  canceller has given up (so the collective cannot complete before that), the others join at
  once. Then every rank tries one more collective.
- ``kill VICTIM COLLECTIVE``: two good collectives, then each rank creates a ``ready``
  marker; rank ``VICTIM`` then waits to be killed by the test, the survivors wait for the
  test's ``go`` file (created once the victim is dead) and run one more collective
  (``allreduce``, or ``broadcast`` from the victim), then a barrier.
"""

from __future__ import annotations

import functools
import time
from typing import TYPE_CHECKING

import _worker_util
import numpy as np
import trio

if TYPE_CHECKING:
    from _worker_util import Reporter

    import trioring

#: A rank that raises nothing within this many seconds is recorded as hanging (TooSlowError).
HANG_S = 10.0
#: How long the cancelling rank lets its allreduce run.
CANCEL_AFTER_S = 0.2
#: Elements of the large array (float32: 16 MB, more than socket buffers hold).
LARGE = 4_000_000


async def scenario_open(reporter: Reporter, comm: trioring.Communicator, args: list[str]) -> None:
    await reporter.step("barrier", comm.barrier, hang_after=HANG_S)


async def _mismatched_call(comm: trioring.Communicator, case: str) -> None:
    odd = comm.rank == 1
    array = np.ones(1000, np.float32)
    if case == "dtype":
        await comm.allreduce(np.ones(1000, np.float64) if odd else array)
    elif case == "count":
        await comm.allreduce(np.ones(1001, np.float32) if odd else array)
    elif case == "op":
        await comm.allreduce(array, op="max" if odd else "sum")
    elif case == "kind-broadcast":
        await (comm.broadcast(array, root=0) if odd else comm.allreduce(array))
    elif case == "kind-barrier":
        await (comm.barrier() if odd else comm.allreduce(array))
    elif case == "root":
        await comm.broadcast(array, root=1 if odd else 0)
    else:
        raise ValueError(f"unknown mismatch case {case!r}")


async def scenario_mismatch(
    reporter: Reporter, comm: trioring.Communicator, args: list[str]
) -> None:
    (case,) = args

    async def agreed() -> None:
        await comm.barrier()
        await comm.allreduce(np.ones(10, np.float32))

    if await reporter.step("agreed", agreed, hang_after=HANG_S) is not None:
        return
    await reporter.step("mismatch", lambda: _mismatched_call(comm, case), hang_after=HANG_S)
    await reporter.step("after", comm.barrier, hang_after=HANG_S)


async def scenario_cancel(reporter: Reporter, comm: trioring.Communicator, args: list[str]) -> None:
    canceller, gated = map(int, args)
    if await reporter.step("agreed", comm.barrier, hang_after=HANG_S) is not None:
        return
    array = np.ones(LARGE, np.float32)
    if comm.rank == canceller:
        started = time.monotonic()
        escaped: BaseException | None = None
        with trio.move_on_after(CANCEL_AFTER_S) as scope:
            try:
                await comm.allreduce(array)
            except BaseException as exc:
                escaped = exc
                raise
        reporter.record(
            "cancelled",
            started,
            None,
            cancelled_caught=scope.cancelled_caught,
            escaped=None if escaped is None else type(escaped).__name__,
            escaped_is_cancellation=_worker_util.is_cancellation(escaped),
            broken=comm.broken,
        )
        reporter.mark("cancelled")
        await reporter.step("allreduce-after", lambda: comm.allreduce(array), hang_after=HANG_S)
        await reporter.step("barrier-after", comm.barrier, hang_after=HANG_S)
        return
    if comm.rank == gated:
        with trio.fail_after(HANG_S):
            await reporter.wait_for(f"w{canceller}.cancelled")
    await reporter.step("allreduce", lambda: comm.allreduce(array), hang_after=HANG_S)
    await reporter.step("barrier-after", comm.barrier, hang_after=HANG_S)


async def scenario_kill(reporter: Reporter, comm: trioring.Communicator, args: list[str]) -> None:
    victim, collective = int(args[0]), args[1]

    async def agreed() -> None:
        await comm.allreduce(np.ones(1000, np.float32))
        await comm.barrier()

    if await reporter.step("agreed", agreed, hang_after=HANG_S) is not None:
        return
    reporter.mark("ready")
    # The victim waits to be killed; the survivors wait for the test to have killed it.
    with trio.fail_after(30 if comm.rank == victim else HANG_S):
        await reporter.wait_for("never" if comm.rank == victim else "go")
    array = np.ones(1000, np.float32)
    if collective == "allreduce":
        call = functools.partial(comm.allreduce, array)
    else:
        call = functools.partial(comm.broadcast, array, root=victim)
    await reporter.step("next", call, hang_after=HANG_S)
    await reporter.step("barrier-after", comm.barrier, hang_after=HANG_S)


if __name__ == "__main__":
    _worker_util.main(
        {
            "open": scenario_open,
            "mismatch": scenario_mismatch,
            "cancel": scenario_cancel,
            "kill": scenario_kill,
        }
    )
