import numpy as np
import trio

import trioring

CELLS = 48  # the whole domain: a ring of cells (periodic boundary)
STEPS = 200
ALPHA = 0.25  # diffusion number; explicit steps are stable up to 0.5
LEFTWARD, RIGHTWARD = 1, 2  # tags: with 2 ranks both neighbours are one rank


def initial() -> np.ndarray:
    u = np.zeros(CELLS)
    u[CELLS // 4 : CELLS // 2] = 1.0  # a block of heat in one part of the ring
    return u


def step(u: np.ndarray) -> np.ndarray:
    """One explicit diffusion step on the interior of `u`, whose first and last cells are
    halos: copies of the neighbours' edge cells."""
    return u[1:-1] + ALPHA * (u[:-2] - 2 * u[1:-1] + u[2:])


async def main() -> None:
    async with trioring.open_communicator() as comm:
        r, n = comm.rank, comm.world_size
        assert CELLS % n == 0, f"{CELLS} cells do not split into {n} equal parts"
        size = CELLS // n
        left, right = (r - 1) % n, (r + 1) % n
        u = np.empty(size + 2)  # [halo, my cells..., halo]
        u[1:-1] = initial()[r * size : (r + 1) * size]

        for _ in range(STEPS):
            # My first cell goes left and lands in the left neighbour's right halo, while
            # the right neighbour's first cell lands in mine; then the other way round.
            # sendrecv sends and receives at once, so the ring of exchanges cannot deadlock,
            # and out= puts each halo straight into its cell.
            await comm.sendrecv(u[1:2], dest=left, source=right, sendtag=LEFTWARD, out=u[-1:])
            await comm.sendrecv(u[-2:-1], dest=right, source=left, sendtag=RIGHTWARD, out=u[:1])
            u[1:-1] = step(u)

        parts = await comm.gather(u[1:-1], root=0)
        if r == 0:
            assert parts is not None
            mine = parts.reshape(-1)
            whole = initial()
            for _ in range(STEPS):  # the same steps on the whole ring, in one process
                whole = step(np.concatenate([whole[-1:], whole, whole[:1]]))
            print(f"{CELLS} cells, {STEPS} steps, world of {n}")
            print(f"heat: {initial().sum():.6f} before, {mine.sum():.6f} after")
            print(f"hottest cell: {mine.max():.6f} (was 1.0)")
            print("same as one process, bit for bit:", np.array_equal(mine, whole))


trio.run(main)
