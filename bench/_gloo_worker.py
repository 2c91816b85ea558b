"""One rank of the Gloo side of bench/compare.py (started by torchrun)."""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np
import torch
import torch.distributed as dist


def iterations(size: int) -> int:
    if size <= 64 * 1024:
        return 200
    if size <= 4 * 1024**2:
        return 40
    return 10


def warmup_iterations(count: int) -> int:
    return max(3, count // 5)  # as trioring bench (trioring/_bench.py)


def main() -> None:
    sizes = [int(s) for s in sys.argv[1].split(",")]
    collectives = sys.argv[2].split(",")
    back_to_back = sys.argv[3:] == ["--back-to-back"]
    dist.init_process_group("gloo")
    rank, n = dist.get_rank(), dist.get_world_size()
    rows = []
    for collective in collectives:
        for size in sizes if collective != "barrier" else [0]:
            count = max(1, size // 4)
            tensor = torch.empty(count, dtype=torch.float32)
            warmup = warmup_iterations(iterations(size))
            times = torch.zeros(warmup + iterations(size), dtype=torch.float64)
            for i in range(len(times)):
                tensor.fill_(rank + 1)
                start = time.perf_counter()
                if collective == "allreduce":
                    dist.all_reduce(tensor)
                elif collective == "broadcast":
                    dist.broadcast(tensor, src=n - 1)
                else:
                    dist.barrier()
                times[i] = time.perf_counter() - start
                if not back_to_back:
                    dist.barrier()  # as trioring bench does (see trioring/_bench.py)
            times = times[warmup:].contiguous()
            dist.all_reduce(times, op=dist.ReduceOp.MAX)
            rows.append(
                {
                    "collective": collective,
                    "size": count * 4 if collective != "barrier" else 0,
                    "median_us": float(np.median(times.numpy())) * 1e6,
                }
            )
    if rank == 0:
        print("GLOO-RESULTS " + json.dumps(rows), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
