import numpy as np
import trio

import trioring


async def main() -> None:
    async with trioring.open_communicator() as comm:
        n, r = comm.world_size, comm.rank

        # dist.all_gather(tensor_list, t), t of a different size on every rank, one of
        # them empty. The sizes are found by trioring: no list of receive buffers.
        parts = await comm.allgatherv(np.arange(r, dtype=np.float32))  # rank r: r elements
        assert [len(p) for p in parts] == list(range(n))

        # dist.reduce(t, dst=0): the result lands on rank 0 only; the others keep theirs.
        y = np.full(3, r + 1.0)
        await comm.reduce(y, root=0, op="sum")
        assert (y == (n * (n + 1) / 2 if r == 0 else r + 1.0)).all()

        # dist.reduce_scatter_tensor(out, big, op=ReduceOp.AVG): a new array is returned.
        big = np.full(2 * n, float(r))
        mine = await comm.reduce_scatter(big, op="mean")
        assert (mine == (n - 1) / 2).all()

        # dist.all_to_all(out_list, in_list): rank r sends r + j elements to rank j.
        got = await comm.alltoallv([np.full(r + j, r, dtype=np.int16) for j in range(n)])
        assert all((g == i).all() and len(g) == i + r for i, g in enumerate(got))

        # dist.broadcast_object_list([config], src=0): trioring's object collectives
        # encode plain data (no pickle: nothing a peer sends can run code here).
        config = await comm.broadcast_object({"lr": 0.1, "steps": 8} if r == 0 else None, root=0)

        if r == 0:
            print("allgatherv sizes:", [len(p) for p in parts])
            print("reduce on rank 0:", y)
            print("reduce_scatter mean:", mine)
            print("alltoallv sizes received:", [len(g) for g in got])
            print("broadcast config:", config)


trio.run(main)
