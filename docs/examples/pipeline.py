import numpy as np
import trio

import trioring

MICRO_BATCHES = 6
ROWS, FEATURES = 288, 512  # 1.125 MiB of float64 per micro-batch: sent by rendezvous
ACTIVATION, RESULT = 1, 2  # tags


def layer(stage: int) -> np.ndarray:
    """Stage `stage`'s weights, the same wherever they are made."""
    rng = np.random.default_rng(stage)
    return rng.standard_normal((FEATURES, FEATURES)) / np.sqrt(FEATURES)


def micro_batch(i: int) -> np.ndarray:
    return np.random.default_rng(100 + i).standard_normal((ROWS, FEATURES))


def forward(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    return np.maximum(x @ w, 0.0)


async def stage(comm: trioring.Communicator) -> None:
    """Receive from the stage before, apply this stage's layer, send to the stage after."""
    r, n = comm.rank, comm.world_size
    w = layer(r)
    # A task of its own keeps the next receive posted while this one computes and sends,
    # so the stage before does not wait for the stage after. The channel has no buffer: a
    # stage holds at most two micro-batches, one in its layer and one received and waiting.
    send_channel, receive_channel = trio.open_memory_channel[np.ndarray](0)

    async def receive_all() -> None:
        async with send_channel:
            for _ in range(MICRO_BATCHES):
                await send_channel.send(await comm.recv(source=r - 1, tag=ACTIVATION))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(receive_all)
        async with receive_channel:
            async for x in receive_channel:
                # The last stage returns its output to rank 0, on another tag.
                if r < n - 1:
                    await comm.send(forward(x, w), dest=r + 1, tag=ACTIVATION)
                else:
                    await comm.send(forward(x, w), dest=0, tag=RESULT)


async def first_stage(comm: trioring.Communicator) -> list[np.ndarray]:
    """Rank 0 feeds the pipeline and, in another task, collects what comes out of it."""
    w = layer(0)
    n = comm.world_size
    results: list[np.ndarray] = []

    async def feed() -> None:
        for i in range(MICRO_BATCHES):
            # A send returns once the next stage has the data: micro-batch i + 1 is
            # computed here while stage 1 works on micro-batch i.
            await comm.send(forward(micro_batch(i), w), dest=1, tag=ACTIVATION)

    async def collect() -> None:
        for _ in range(MICRO_BATCHES):
            # Messages of one source and tag arrive in the order they were sent.
            results.append(await comm.recv(source=n - 1, tag=RESULT))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(feed)
        nursery.start_soon(collect)
    return results


async def main() -> None:
    async with trioring.open_communicator() as comm:
        n = comm.world_size
        assert n >= 2, "a pipeline needs two stages or more"
        if comm.rank > 0:
            await stage(comm)
            return
        results = await first_stage(comm)
        for i, y in enumerate(results):
            # The same layers in one process: the pipeline changes where they run, not what
            # they compute, so the results are bitwise equal.
            x = micro_batch(i)
            for s in range(n):
                x = forward(x, layer(s))
            print(
                f"micro-batch {i}: sum {y.sum():10.4f}, same as one process: {np.array_equal(x, y)}"
            )
        print(f"{MICRO_BATCHES} micro-batches through {n} stages")


trio.run(main)
