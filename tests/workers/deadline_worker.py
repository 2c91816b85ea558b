"""Worker for ``test_deadlines.py``: one rank of a world in which a caller's deadline fires
inside a collective. Run as ``deadline_worker.py deadline OUT_DIR INDEX DEADLINED ABSENT
[COLLECTIVE]`` (see ``_worker_util``): ``DEADLINED`` and ``ABSENT`` are comma-separated
ranks; ``COLLECTIVE`` is ``allreduce`` (the default), ``broadcast`` (from the lowest
absent rank) or ``reduce`` (to the lowest deadlined rank).

Every rank allreduces 4 bytes once (``agreed``). Then the ranks in ``DEADLINED`` call the
collective (the step is named after it) under ``trio.fail_after(DEADLINE_S)``, the
other present ranks without a deadline of their own, while the ranks in ``ABSENT`` stay out
until every present rank is done (they then enter and raise). Every rank then calls a
barrier, on its broken communicator. The report holds every step's error, the notes of what
escaped the deadlined call, the WARNING records of the ``trioring`` logger and the
communicator's features.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import _worker_util
import numpy as np
import trio

if TYPE_CHECKING:
    from _worker_util import Reporter

    import trioring

DEADLINE_S = 1.0
#: A rank that raises nothing within this many seconds is recorded as hanging.
HANG_S = 15.0


class _Records(logging.Handler):
    def __init__(self, into: list[list[Any]]) -> None:
        super().__init__(logging.WARNING)
        self.into = into

    def emit(self, record: logging.LogRecord) -> None:
        self.into.append([record.levelname, record.getMessage()])


def _ranks(text: str) -> set[int]:
    return {int(part) for part in text.split(",") if part}


async def scenario_deadline(
    reporter: Reporter, comm: trioring.Communicator, args: list[str]
) -> None:
    deadlined, absent = _ranks(args[0]), _ranks(args[1])
    name = args[2] if len(args) > 2 else "allreduce"
    records: list[list[Any]] = []
    logging.getLogger("trioring").addHandler(_Records(records))
    reporter.report.update(log=records, features=sorted(comm.features))
    array = np.ones(1, np.float32)
    if await reporter.step("agreed", lambda: comm.allreduce(array), hang_after=HANG_S) is not None:
        return
    present = [rank for rank in range(comm.world_size) if rank not in absent]

    def call() -> Any:
        if name == "broadcast":
            return comm.broadcast(array, root=min(absent))
        if name == "reduce":
            return comm.reduce(array, root=min(deadlined))
        return comm.allreduce(array)

    if comm.rank in absent:
        with trio.fail_after(HANG_S):
            for rank in present:
                await reporter.wait_for(f"w{rank}.done")
        await reporter.step(name, call, hang_after=HANG_S)
    elif comm.rank in deadlined:
        started = time.monotonic()
        escaped: BaseException | None = None
        try:
            with trio.fail_after(DEADLINE_S):
                try:
                    await call()
                except BaseException as exc:
                    escaped = exc
                    raise
        except Exception as exc:
            reporter.record(
                name,
                started,
                exc,
                escaped_is_cancellation=_worker_util.is_cancellation(escaped),
                escaped_notes=list(getattr(escaped, "__notes__", [])),
            )
        else:
            reporter.record(name, started, None)
    else:
        await reporter.step(name, call, hang_after=HANG_S)
    reporter.mark("done")
    await reporter.step("barrier", comm.barrier, hang_after=HANG_S)


if __name__ == "__main__":
    _worker_util.main({"deadline": scenario_deadline})
