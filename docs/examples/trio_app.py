"""A Trio application: collectives next to other tasks, one deadline per training step, and
recovery after a cancelled collective. Run it with ``trioring run -n 4 trio_app.py``."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import trio

import trioring

STEPS = 4
ELEMENTS = 25_000  # float32 gradients per step: 100 kB, a ring allreduce
SLOW_RANK, SLOW_STEP, STALL_S = 3, 2, 3.0  # rank 3's data loader stalls before step 2...
STEP_DEADLINE_S = 1.0  # ...and rank 0 gives up on a step after this long
STALL_WARNING_S = 0.5  # the heartbeat warns about a step that takes longer than this


@dataclass
class Progress:
    """What the tasks of one rank share."""

    rank: int
    step: int = 0
    batch: np.ndarray | None = None  # loaded, not yet trained on
    step_started: float | None = None  # trio.current_time() when the running step began


async def load_batches(
    progress: Progress, send_channel: trio.MemorySendChannel[np.ndarray]
) -> None:
    """Stands in for reading and decoding data: one batch per step."""
    async with send_channel:
        for step in range(STEPS):
            if progress.rank == SLOW_RANK and step == SLOW_STEP:
                await trio.sleep(STALL_S)  # a slow disk
            await send_channel.send(np.full(ELEMENTS, progress.rank + step, dtype=np.float32))


async def heartbeat(progress: Progress) -> None:
    """Warns once about a slow step. It keeps running while a collective waits: awaiting a
    collective blocks only the task that awaits it."""
    warned = None
    while True:
        await trio.sleep(0.1)
        started = progress.step_started
        late = started is not None and trio.current_time() - started > STALL_WARNING_S
        if late and started != warned:
            print(f"rank {progress.rank}: step {progress.step} is taking over {STALL_WARNING_S} s")
            warned = started


async def train_step(comm: trioring.Communicator, batch: np.ndarray) -> float:
    """Three collectives; the caller bounds them all with one deadline."""
    grads = batch * 2.0  # the "backward pass"
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
    # Only rank 0 has a deadline here, so that the output is the same on every run.
    deadline_s = STEP_DEADLINE_S if comm.rank == 0 else math.inf
    while progress.step < STEPS:
        if progress.batch is None:
            progress.batch = await batches.receive()  # waiting for data: no deadline
        progress.step_started = trio.current_time()
        # --8<-- [start:deadline]
        with trio.fail_after(deadline_s):
            loss = await train_step(comm, progress.batch)
        # --8<-- [end:deadline]
        progress.step_started = None
        if comm.rank == 0:
            print(f"step {progress.step}: loss {loss}")
        progress.step, progress.batch = progress.step + 1, None


async def report(comm: trioring.Communicator, exc: Exception, progress: Progress) -> None:
    where = f"rank {comm.rank}: step {progress.step}"
    progress.step_started = None
    if isinstance(exc, trioring.CollectiveError):  # a peer's failure reached this rank
        reason = f": {exc.reason}" if isinstance(exc, trioring.PeerAbortedError) else ""
        print(f"{where}: {type(exc).__name__} from rank {exc.peer}{reason}")
    else:  # this rank's own deadline fired
        print(f"{where}: {type(exc).__name__}; communicator broken: {comm.broken}")
    try:
        await comm.barrier()
    except trioring.CommunicatorBrokenError:
        print(f"{where}: every later call raises CommunicatorBrokenError")


async def main() -> None:
    send_channel, batches = trio.open_memory_channel[np.ndarray](1)
    progress: Progress | None = None
    async with trio.open_nursery() as nursery:
        while progress is None or progress.step < STEPS:
            async with trioring.open_communicator() as comm:
                if progress is None:  # the first communicator: start the other tasks
                    progress = Progress(rank=comm.rank)
                    nursery.start_soon(load_batches, progress, send_channel)
                    nursery.start_soon(heartbeat, progress)
                try:
                    await train(comm, batches, progress)
                except (trio.TooSlowError, trioring.CollectiveError) as exc:
                    await report(comm, exc, progress)
            # Leaving the block closed the communicator. If a step failed, the loop opens a
            # new one (every rank does) and retries that step with the same batch.
        nursery.cancel_scope.cancel()  # stop the heartbeat


trio.run(main)
