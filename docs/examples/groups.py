import hashlib

import numpy as np
import trio

import trioring

FEATURES, ROWS = 8, 64  # per rank
STEPS, SYNC_EVERY = 12, 4
LR = 0.1


def data(rank: int) -> tuple[np.ndarray, np.ndarray]:
    """Rank `rank`'s rows of a linear regression; the two groups' data differ."""
    rng = np.random.default_rng(rank)
    w_true = np.linspace(-1.0, 1.0, FEATURES) + 0.5 * (rank // 2)
    x = rng.standard_normal((ROWS, FEATURES))
    return x, x @ w_true + 0.1 * rng.standard_normal(ROWS)


async def report(
    side: trioring.Communicator, losses: trio.MemoryReceiveChannel[tuple[int, float]]
) -> None:
    """In a task of its own: gather every rank's loss on `side` and print them on rank 0,
    while the training runs its collectives on the other communicators."""
    async with losses:
        async for step, loss in losses:
            every = await side.allgather(np.array([loss]))
            if side.rank == 0:
                print(f"step {step:2}: losses by rank {np.round(every.ravel(), 4).tolist()}")


async def main() -> None:
    async with trioring.open_communicator() as comm:
        assert comm.world_size % 2 == 0, "two ranks per group"
        x, y = data(comm.rank)
        w = np.zeros(FEATURES)
        # Collectives on comm: every rank makes both, in the same order.
        async with comm.split(color=comm.rank // 2) as group, comm.dup() as side:
            assert group is not None
            send_loss, receive_loss = trio.open_memory_channel[tuple[int, float]](STEPS)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(report, side, receive_loss)
                async with send_loss:
                    for step in range(STEPS):
                        error = x @ w - y
                        grad = x.T @ error / ROWS
                        # Data parallelism inside the group: the group's ranks average
                        # their gradients and keep one replica of the model.
                        await group.allreduce(grad, op="mean")
                        w -= LR * grad
                        if (step + 1) % SYNC_EVERY == 0:
                            # Now and then the groups' replicas are averaged on the world.
                            await comm.allreduce(w, op="mean")
                        # To the reporting task; the send never waits (room for every step).
                        send_loss.send_nowait((step, float(np.mean(error**2))))
            # Every replica is the world's average after the last step: the same bytes on
            # every rank (compared by their hashes).
            digest = np.frombuffer(hashlib.sha256(w.tobytes()).digest(), np.uint8)
            digests = await comm.allgather(digest)
            if comm.rank == 0:
                same = bool((digests == digests[0]).all())
                print(f"{group.world_size} ranks per group, {comm.world_size // 2} groups")
                print(f"replicas identical on {comm.world_size} ranks: {same}")


trio.run(main)
