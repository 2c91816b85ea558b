"""Average many small gradients with one allreduce: they live in one flat buffer, each a
view of its part, so one call reduces them all and nothing is copied in or out.

    trioring run -n 4 bucketing.py          # checks the result against one call per array
    trioring run -n 2 bucketing.py --time   # also times both ways
"""

import math
import statistics
import sys
import time

import numpy as np
import trio

import trioring

# A small model: 24 layers of a 32 x 32 weight matrix and a bias.
SHAPES: dict[str, tuple[int, ...]] = {}
for layer in range(24):
    SHAPES[f"layer{layer}.weight"] = (32, 32)
    SHAPES[f"layer{layer}.bias"] = (32,)


class FlatArrays:
    """Arrays of one dtype laid end to end in one buffer: ``views[name]`` is array ``name``,
    a view of its part of ``buffer``. Write into the views (``g[...] = ...``), never
    rebind them, and one collective on ``buffer`` covers every array."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], dtype: type) -> None:
        sizes = {name: math.prod(shape) for name, shape in shapes.items()}
        self.buffer = np.zeros(sum(sizes.values()), dtype)
        self.views: dict[str, np.ndarray] = {}
        offset = 0
        for name, shape in shapes.items():
            self.views[name] = self.buffer[offset : offset + sizes[name]].reshape(shape)
            offset += sizes[name]


def compute_gradients(grads: dict[str, np.ndarray], rank: int, step: int) -> None:
    """Stand-in for a backward pass: writes every gradient in place. Integer values, so the
    sums are exact in any order and the two ways below must agree bit for bit."""
    for i, g in enumerate(grads.values()):
        g[...] = (rank + 1) * (i + step)


async def one_call_per_array(comm: trioring.Communicator, grads: dict[str, np.ndarray]) -> None:
    for g in grads.values():
        await comm.allreduce(g, op="mean")


async def main() -> None:
    async with trioring.open_communicator() as comm:
        flat = FlatArrays(SHAPES, np.float32)
        compute_gradients(flat.views, comm.rank, step=1)
        separate = {name: g.copy() for name, g in flat.views.items()}
        await one_call_per_array(comm, separate)
        await comm.allreduce(flat.buffer, op="mean")  # every gradient at once
        same = np.array([all(np.array_equal(flat.views[k], separate[k]) for k in SHAPES)])
        await comm.allreduce(same, op="min")  # a logical and: true only if true on every rank
        if comm.rank == 0:
            print(f"{len(SHAPES)} arrays in one buffer of {flat.buffer.nbytes} bytes")
            print(f"one allreduce gives what {len(SHAPES)} allreduces give: {same[0]}")
        if "--time" in sys.argv[1:]:
            times: dict[str, list[float]] = {"one call per array": [], "one call in all": []}
            for step in range(50):
                compute_gradients(flat.views, comm.rank, step)
                await comm.barrier()
                start = time.perf_counter()
                await one_call_per_array(comm, flat.views)
                times["one call per array"].append(time.perf_counter() - start)
                compute_gradients(flat.views, comm.rank, step)
                await comm.barrier()
                start = time.perf_counter()
                await comm.allreduce(flat.buffer, op="mean")
                times["one call in all"].append(time.perf_counter() - start)
            if comm.rank == 0:
                for way, seconds in times.items():
                    print(f"{way}: {statistics.median(seconds) * 1e6:.0f} us (median of 50)")


trio.run(main)
