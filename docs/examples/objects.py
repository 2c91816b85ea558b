import numpy as np
import trio

import trioring


async def main() -> None:
    async with trioring.open_communicator() as comm:
        n, r = comm.world_size, comm.rank

        # Rank 0's configuration reaches every rank; the others' argument is ignored.
        config = {"lr": 0.1, "layers": [64, 64], "name": "run-7"} if r == 0 else None
        config = await comm.broadcast_object(config, root=0)

        # Every rank's statistics reach every rank: a list of n objects, in rank order.
        # The histogram travels as raw bytes and comes back as a float64 array.
        hist = np.bincount(np.arange(r + 1) % 3, minlength=3).astype(np.float64)
        stats = await comm.allgather_object({"rank": r, "loss": 0.5 / (r + 1), "hist": hist})

        # Rows of any shape, on rank 0 only; the others get None.
        rows = await comm.gather_object(("ok", r, (None,) * r), root=0)

        # One rank to another: the last rank sends rank 0 a summary (in a world of one,
        # rank 0 sends it to itself).
        if r == n - 1:
            await comm.send_object({"from": r, "ranks": [s["rank"] for s in stats]}, dest=0)
        summary = await comm.recv_object(source=n - 1) if r == 0 else None

        # Anything else is refused before any I/O, on every rank that passes it, with
        # where it is; the communicator stays usable.
        try:
            await comm.allgather_object({"seen": [1, {2, 3}]})
        except trioring.InvalidArgumentError as exc:
            refused = str(exc).removesuffix(f" [job {exc.job_id}]")  # (launcher's id)
        total = await comm.allgather_object(len(refused))

        # Rank 0 hands every rank its own work item: a list of n objects, one per rank.
        work = [{"shard": q, "files": [f"part-{q}-{i}" for i in range(q + 1)]} for q in range(n)]
        mine = await comm.scatter_object(work if r == 0 else None, root=0)

        # Every rank sends every rank (itself too) its own object, and gets one from each.
        mail = await comm.alltoall_object([f"{r}->{q}" for q in range(n)])

        if r == 0:
            print("config:", config)
            print("losses:", [round(s["loss"], 3) for s in stats])
            print("hist sums:", [float(s["hist"].sum()) for s in stats])
            print("rows:", rows)
            print("summary:", summary)
            print("refused:", refused)
            print("still usable:", total == [len(refused)] * n)
            print("my work:", mine)
            print("mail:", mail)


trio.run(main)
