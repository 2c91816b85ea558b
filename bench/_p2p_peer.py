"""One rank of a peer's side of bench/p2p.py --peers: the ping-pong of bench/p2p.py through
mpi4py (under mpirun) or torch.distributed's Gloo (under torchrun), timed the same way.

    mpirun -n 2 python bench/_p2p_peer.py mpi ROUNDS
    torchrun --nproc-per-node=2 bench/_p2p_peer.py gloo ROUNDS

Rank 0 prints ``P2P-RESULTS <json>``: {size: the median over ROUNDS of half a round trip,
in seconds}. Every echo is checked.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from typing import TYPE_CHECKING

import numpy as np
from _harness import P2P_SIZES, p2p_buffers, p2p_inner

if TYPE_CHECKING:
    from collections.abc import Callable


def pingpong(
    rank: int, rounds: int, barrier: Callable[[], None], send: Callable, recv: Callable
) -> dict[int, float]:
    """Half a round trip between ranks 0 and 1, per size (ranks above 1 only wait)."""
    medians = {}
    for size in P2P_SIZES:
        x, back = p2p_buffers(size)
        inner = p2p_inner(size)
        samples = []
        for _ in range(rounds):
            barrier()
            start = time.perf_counter()
            for _ in range(inner):
                if rank == 0:
                    send(x, 1)
                    recv(back, 1)
                elif rank == 1:
                    recv(back, 0)
                    send(back, 0)
            samples.append((time.perf_counter() - start) / inner / 2)
        if rank == 0 and not np.array_equal(back, x):
            raise SystemExit(f"wrong echo at {size} bytes")
        medians[size] = statistics.median(samples)
    return medians


def main(peer: str, rounds: int) -> None:
    if peer == "mpi":
        import mpi4py

        mpi4py.rc.thread_level = "single"  # as bench/_mpi_worker.py
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
        rank = comm.Get_rank()
        medians = pingpong(
            rank,
            rounds,
            comm.Barrier,
            lambda x, dest: comm.Send([x, MPI.BYTE], dest=dest),
            lambda x, source: comm.Recv([x, MPI.BYTE], source=source),
        )
    else:
        import torch
        import torch.distributed as dist

        dist.init_process_group("gloo")
        rank = dist.get_rank()
        medians = pingpong(
            rank,
            rounds,
            dist.barrier,
            lambda x, dest: dist.send(torch.from_numpy(x), dst=dest),
            lambda x, source: dist.recv(torch.from_numpy(x), src=source),
        )
        dist.destroy_process_group()
    if rank == 0:
        print("P2P-RESULTS " + json.dumps(medians), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
