import numpy as np
import trio
from sharded_optimizer import samples, train  # the tutorial's first program, next to this one

import trioring

HELD_OUT = 30  # rows of held-out data: not a multiple of the world size
OUTPUT = "predictions.npy"


async def main() -> None:
    async with trioring.open_communicator() as comm:
        w, _ = await train(comm)
        x, y = samples(seed=2, count=HELD_OUT)
        rows = np.array_split(np.arange(HELD_OUT), comm.world_size)[comm.rank]
        predictions = x[rows] @ w

        # Where this rank's rows go in the shared output: the sum of the row counts of the
        # ranks before it. scan leaves the sum up to and including this rank's count.
        end = np.array([len(rows)])
        await comm.scan(end, op="sum")
        start = int(end[0]) - len(rows)

        # Rank 0 creates the file; once it exists, every rank writes its rows into it.
        if comm.rank == 0:
            np.lib.format.open_memmap(OUTPUT, mode="w+", shape=(HELD_OUT,)).flush()
        await comm.barrier()
        output = np.load(OUTPUT, mmap_mode="r+")
        output[start : start + len(rows)] = predictions
        output.flush()
        del output
        await comm.barrier()

        # Every rank sends rank 0 its metrics; the others get None.
        squared_error = float(np.sum((predictions - y[rows]) ** 2))
        metrics = np.array([start, len(rows), squared_error])
        table = await comm.gather(metrics, root=0)
        if comm.rank == 0:
            assert table is not None  # shape (world_size, 3): one row per rank
            for rank, (first, count, error) in enumerate(table):
                print(
                    f"rank {rank}: rows {first:.0f}-{first + count - 1:.0f}, "
                    f"squared error {error:.4f}"
                )
            mse = table[:, 2].sum() / table[:, 1].sum()
            print(f"held-out mean squared error {mse:.4f} over {table[:, 1].sum():.0f} rows")
            everything = np.load(OUTPUT)
            np.testing.assert_allclose(everything, x @ w, rtol=1e-12, atol=1e-12)
            print(f"{OUTPUT}: {len(everything)} predictions, written by {comm.world_size} ranks")
        else:
            assert table is None


if __name__ == "__main__":
    trio.run(main)
