"""A Trio application: collectives next to other tasks, one deadline per
training step, and a bounded recovery after a cancelled collective.

Run it with ``trioring run -n 4 trio_app.py``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import trio

import trioring

STEPS = 4
ELEMENTS = 25_000  # float32 gradients per step: 100 kB, a ring allreduce
SLOW_RANK, SLOW_STEP, STALL_S = 3, 2, 3.0  # rank 3 stalls 3 s in step 2...
STALLS = 1  # ...in this many attempts at it
STEP_DEADLINE_S = 1.0  # rank 0 gives up on a step after this long
STALL_WARNING_S = 0.5  # the heartbeat warns about a step slower than this
MAX_ATTEMPTS = 3  # attempts at one step before the program gives up
BACKOFF_S = 0.5  # the wait before the first retry, doubled for each next one


@dataclass
class Progress:
    """What the tasks of one rank share."""

    rank: int
    step: int = 0
    attempt: int = 1  # of the current step, counting from 1
    batch: np.ndarray | None = None  # loaded, not yet trained on
    step_started: float | None = None  # when the running step began

    @property
    def where(self) -> str:
        return f"rank {self.rank}: step {self.step}"


async def load_batches(
    progress: Progress, send_channel: trio.MemorySendChannel[np.ndarray]
) -> None:
    """Stands in for reading and decoding data: one batch per step."""
    async with send_channel:
        for step in range(STEPS):
            batch = np.full(ELEMENTS, progress.rank + step, dtype=np.float32)
            await send_channel.send(batch)


async def heartbeat(progress: Progress) -> None:
    """Warns once about a slow step. It keeps running while a collective
    waits: awaiting a collective blocks only the task that awaits it."""
    warned = None
    while True:
        await trio.sleep(0.1)
        started = progress.step_started
        now = trio.current_time()
        late = started is not None and now - started > STALL_WARNING_S
        if late and started != warned:
            print(f"{progress.where} is taking over {STALL_WARNING_S} s")
            warned = started


async def backward(progress: Progress, batch: np.ndarray) -> np.ndarray:
    """Stands in for the forward and backward passes: rank 3 is slow in
    step 2."""
    slow = (progress.rank, progress.step) == (SLOW_RANK, SLOW_STEP)
    if slow and progress.attempt <= STALLS:
        await trio.sleep(STALL_S)  # e.g. a GPU that another job is using
    return batch * 2.0


async def train_step(comm: trioring.Communicator, grads: np.ndarray) -> float:
    """Three collectives; the caller bounds them all with one deadline."""
    await comm.allreduce(grads, op="mean")  # average the gradients
    loss = np.array([grads.mean()])
    await comm.allreduce(loss, op="max")  # the worst loss of any rank
    await comm.barrier()  # e.g. before writing a checkpoint
    return float(loss[0])


async def train(
    comm: trioring.Communicator,
    batches: trio.MemoryReceiveChannel[np.ndarray],
    progress: Progress,
) -> None:
    # Only rank 0 has a deadline, so that the output is the same every run.
    deadline_s = STEP_DEADLINE_S if comm.rank == 0 else math.inf
    while progress.step < STEPS:
        if progress.batch is None:  # waiting for data: no deadline
            progress.batch = await batches.receive()
        progress.step_started = trio.current_time()
        # --8<-- [start:deadline]
        with trio.fail_after(deadline_s):
            grads = await backward(progress, progress.batch)
            loss = await train_step(comm, grads)
        # --8<-- [end:deadline]
        progress.step_started = None
        if comm.rank == 0:
            print(f"step {progress.step}: loss {loss}")
        progress.step += 1
        progress.attempt, progress.batch = 1, None


async def report(
    comm: trioring.Communicator,
    exc: Exception,
    progress: Progress,
) -> None:
    where = progress.where
    progress.step_started = None
    name = type(exc).__name__
    if isinstance(exc, trioring.CollectiveError):  # a peer's failure
        reason = ""
        if isinstance(exc, trioring.PeerAbortedError):
            reason = f": {exc.reason}"
        print(f"{where}: {name} from rank {exc.peer}{reason}")
    else:  # this rank's own deadline fired
        print(f"{where}: {name}; communicator broken: {comm.broken}")
    # Call only a broken communicator here: it raises at once, without I/O.
    # One that is not broken (the deadline fired outside any collective)
    # would run a real barrier while the peers wait in another collective,
    # and every rank would get CollectiveMismatchError.
    if comm.broken:
        try:
            await comm.barrier()
        except trioring.CommunicatorBrokenError:
            print(f"{where}: every later call raises CommunicatorBrokenError")


async def back_off(progress: Progress) -> None:
    """Waits before the next attempt at a failed step, longer each time."""
    delay = BACKOFF_S * 2 ** (progress.attempt - 1)
    print(f"{progress.where}: retrying in {delay} s")
    await trio.sleep(delay)
    progress.attempt += 1


async def main() -> None:
    send_channel, batches = trio.open_memory_channel[np.ndarray](1)
    progress: Progress | None = None
    async with trio.open_nursery() as nursery:
        while progress is None or progress.step < STEPS:
            async with trioring.open_communicator() as comm:
                if progress is None:  # the first one: start the other tasks
                    progress = Progress(rank=comm.rank)
                    nursery.start_soon(load_batches, progress, send_channel)
                    nursery.start_soon(heartbeat, progress)
                try:
                    await train(comm, batches, progress)
                except (trio.TooSlowError, trioring.CollectiveError) as exc:
                    await report(comm, exc, progress)
                    if progress.attempt == MAX_ATTEMPTS:
                        print(f"{progress.where}: giving up")
                        raise
            # Leaving the block closed the communicator: no peer waits for
            # this rank any more. If a step failed, the loop opens a new one
            # (every rank does) and retries that step with the same batch.
            if progress.step < STEPS:
                await back_off(progress)
        nursery.cancel_scope.cancel()  # stop the heartbeat


trio.run(main)
