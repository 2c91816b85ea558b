"""A rank for tests/test_setup_failures.py: open a communicator (and close it again), with a
fault injected into the set-up when ``SETUP_FAULT`` says so. Usage as every worker here
(``python setup_worker.py open OUT_DIR INDEX``, see _worker_util.py); the report's ``open``
step's ``ended`` (every step has one: the host's monotonic clock, ``time.monotonic()``, at
which open_communicator returned or raised) is compared with other processes on this host.

``SETUP_FAULT`` (only the victim has it):

- ``mesh-kill``: SIGKILL itself in the middle of the mesh (once its first data connection is
  up), after writing ``w{INDEX}.died`` holding the time;
- ``mesh-raise``: raise ``RuntimeError`` there instead;
- ``agree-kill``: SIGKILL itself once the capability agreement is done (before READY).

``SETUP_OPEN_S`` bounds open_communicator (default 20 s); the test can also make a rank give
up at once by creating ``w{INDEX}.giveup``. The ``trioring`` logger goes to the log at INFO,
with levels, so that tests can check what was logged where users look.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import trio
from _worker_util import Reporter

import trioring
from trioring import _rendezvous
from trioring._onehost import _agree as onehost_agree

OPEN_S = float(os.environ.get("SETUP_OPEN_S", "20"))
FAULT = os.environ.get("SETUP_FAULT", "")


def _die(reporter: Reporter, how: str) -> None:
    reporter.write(f"w{reporter.index}.died", repr(time.monotonic()).encode())
    if how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    raise RuntimeError("injected failure in the middle of the mesh")


def inject(reporter: Reporter) -> None:
    if FAULT.startswith("mesh-"):
        real_mesh = _rendezvous.connect_mesh

        async def faulty_mesh(*args: Any) -> None:
            links = args[-1]
            async with trio.open_nursery() as nursery:
                nursery.start_soon(real_mesh, *args)
                while not links:  # noqa: ASYNC110 (in-process: this rank's own dict)
                    await trio.sleep(0.001)
                _die(reporter, FAULT.removeprefix("mesh-"))

        _rendezvous.connect_mesh = faulty_mesh  # type: ignore[assignment]
    elif FAULT == "agree-kill":
        real_agree = onehost_agree.agree_on_shm

        async def faulty_agree(*args: Any) -> Any:
            await real_agree(*args)
            _die(reporter, "kill")

        onehost_agree.agree_on_shm = faulty_agree  # type: ignore[assignment]
    elif FAULT:
        raise SystemExit(f"unknown SETUP_FAULT {FAULT!r}")


async def run(reporter: Reporter) -> None:
    started = time.monotonic()
    error: BaseException | None = None
    with trio.CancelScope() as giving_up:
        async with trio.open_nursery() as nursery:

            async def give_up() -> None:
                await reporter.wait_for(f"w{reporter.index}.giveup")
                giving_up.cancel()

            nursery.start_soon(give_up)
            try:
                with trio.fail_after(OPEN_S):
                    async with trioring.open_communicator():
                        reporter.mark("connected")
            except Exception as exc:
                error = exc
            nursery.cancel_scope.cancel()
    if giving_up.cancelled_caught:
        error = trio.TooSlowError(f"gave up: the test created w{reporter.index}.giveup")
    reporter.record("open", started, error)


def main() -> None:
    _, out_dir, index = sys.argv[1:4]
    reporter = Reporter(Path(out_dir), int(index))
    logging.basicConfig(
        level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(name)s %(message)s"
    )
    inject(reporter)
    try:
        trio.run(run, reporter)
    finally:
        reporter.save()


if __name__ == "__main__":
    main()
