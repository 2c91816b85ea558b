"""One rank of the Gloo side of bench/compare.py (started by torchrun): the collectives that
torch.distributed's Gloo backend has, timed as trioring bench times them."""

from __future__ import annotations

import json
import os
import sys
import time
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.distributed as dist
from _harness import iterations, warmup_iterations

if TYPE_CHECKING:
    from collections.abc import Callable


def prepare(collective: str, count: int, rank: int, n: int) -> tuple[int, Callable[[], None]]:
    """(bytes moved, the timed call) of one cell, with sizes as trioring bench's
    (trioring/_bench_cases.py): the larger of one rank's buffers."""
    k = max(1, count // n)
    root = n - 1
    if collective == "allreduce":
        tensor = torch.full((count,), rank + 1.0)
        return tensor.numel() * 4, lambda: dist.all_reduce(tensor)
    if collective == "broadcast":
        tensor = torch.full((count,), rank + 1.0)
        return tensor.numel() * 4, lambda: dist.broadcast(tensor, src=root)
    if collective == "barrier":
        return 0, dist.barrier
    if collective == "reduce":
        tensor = torch.full((count,), rank + 1.0)
        return tensor.numel() * 4, lambda: dist.reduce(tensor, dst=root)
    if collective == "allgather":
        x, out = torch.full((k,), rank + 1.0), torch.empty(n * k)
        return out.numel() * 4, lambda: dist.all_gather_into_tensor(out, x)
    if collective == "reduce_scatter":
        x, out = torch.full((n * k,), rank + 1.0), torch.empty(k)
        return x.numel() * 4, lambda: dist.reduce_scatter_tensor(out, x)
    if collective == "gather":
        x = torch.full((k,), rank + 1.0)
        rows = [torch.empty(k) for _ in range(n)] if rank == root else None
        return n * k * 4, lambda: dist.gather(x, rows, dst=root)
    if collective == "scatter":
        out = torch.empty(k)
        blocks = [torch.full((k,), i + 1.0) for i in range(n)] if rank == root else None
        return n * k * 4, lambda: dist.scatter(out, blocks, src=root)
    if collective == "alltoall":
        x, out = torch.full((n * k,), rank + 1.0), torch.empty(n * k)
        return x.numel() * 4, lambda: dist.all_to_all_single(out, x)
    raise SystemExit(f"_gloo_worker: no Gloo counterpart for {collective!r}")


def main() -> None:
    sizes = [int(s) for s in sys.argv[1].split(",")]
    collectives = sys.argv[2].split(",")
    back_to_back = sys.argv[3:] == ["--back-to-back"]
    dist.init_process_group("gloo")
    rank, n = dist.get_rank(), dist.get_world_size()
    rows = []
    for collective in collectives:
        for size in sizes if collective != "barrier" else [0]:
            nbytes, call = prepare(collective, max(1, size // 4), rank, n)
            warmup = warmup_iterations(iterations(size))
            times = torch.zeros(warmup + iterations(size), dtype=torch.float64)
            for i in range(len(times)):
                start = time.perf_counter()
                call()
                times[i] = time.perf_counter() - start
                if not back_to_back:
                    dist.barrier()  # as trioring bench does (see trioring/_bench.py)
            times = times[warmup:].contiguous()
            dist.all_reduce(times, op=dist.ReduceOp.MAX)
            rows.append(
                {
                    "collective": collective,
                    "size": nbytes,
                    "median_us": float(np.median(times.numpy())) * 1e6,
                }
            )
    if rank == 0:
        print("GLOO-RESULTS " + json.dumps(rows), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
