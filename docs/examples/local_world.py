import numpy as np
import trio

import trioring
from trioring.testing import open_local_world


async def rank_main(comm: trioring.Communicator, results: list[np.ndarray]) -> None:
    x = np.full(4, comm.rank + 1.0)
    await comm.allreduce(x)
    results[comm.rank] = x


async def main() -> None:
    results: list[np.ndarray] = [np.empty(0)] * 3
    async with open_local_world(3) as comms, trio.open_nursery() as nursery:
        for comm in comms:
            nursery.start_soon(rank_main, comm, results)
    for x in results:
        assert (x == 6.0).all()
    print("every rank got", results[0])


trio.run(main)
