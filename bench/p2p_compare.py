"""Point-to-point latency against the peers: bench/p2p.py's ping-pong (half a round trip
between two ranks, 8 bytes to 16 MiB) through trioring over Unix sockets, torch's Gloo
(TCP on loopback) and mpi4py over Open MPI (shared memory, and TCP on loopback), in
alternating rounds, each side a fresh job:

    python bench/p2p_compare.py [--rounds 3] [--peers gloo,mpi-shm,mpi-tcp]

Each job reports every size's median over its own samples (bench/p2p.py); the table shows
the median over the rounds and trioring's time over each peer's. Needs what
bench/compare.py needs for the same peers (`make bench` installs it).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import sys
from pathlib import Path

from _machine import describe, machine
from _mpirun import loopback_args
from compare import HERE, LABELS, MPI_MCA, PEERS, free_port, missing, run_job

#: Samples per size in each job (bench/p2p.py's ROUNDS).
SAMPLES = 11


def results(stdout: str) -> dict[int, float]:
    match = re.search(r"P2P-RESULTS (.*)", stdout)
    assert match, stdout
    return {int(size): seconds for size, seconds in json.loads(match.group(1)).items()}


def run_side(side: str, mpirun: str | None) -> dict[int, float]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if side == "trioring":
        command = [sys.executable, "-m", "trioring", "run", "-n", "2", "--transport", "unix"]
        return results(run_job([*command, str(HERE / "p2p.py"), str(SAMPLES)], env))
    worker = str(HERE / "_p2p_peer.py")
    if side == "gloo":
        torchrun = str(Path(sys.executable).with_name("torchrun"))
        return results(
            run_job(
                [
                    torchrun, "--nproc-per-node=2", "--master-addr=127.0.0.1",
                    f"--master-port={free_port()}", worker, "gloo", str(SAMPLES),
                ],
                env,
            )
        )  # fmt: skip
    assert mpirun is not None
    return results(
        run_job(
            [
                mpirun, "--allow-run-as-root", "--oversubscribe", "-n", "2", "--bind-to", "none",
                *MPI_MCA[side], *loopback_args(mpirun), sys.executable, worker, "mpi",
                str(SAMPLES),
            ],
            env,
        )
    )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--peers", default=",".join(PEERS))
    parser.add_argument("--mpirun", help="Open MPI's mpirun (default: mpirun on PATH)")
    args = parser.parse_args()
    peers = [peer for peer in args.peers.split(",") if peer]
    if unknown := [peer for peer in peers if peer not in PEERS]:
        parser.error(f"unknown peers {unknown}; expected some of {', '.join(PEERS)}")
    mpirun = args.mpirun or shutil.which("mpirun")
    if problems := [problem for peer in peers if (problem := missing(peer, mpirun))]:
        raise SystemExit("\n".join(problems))
    sides = ["trioring", *peers]
    runs: dict[str, list[dict[int, float]]] = {side: [] for side in sides}
    for round_ in range(args.rounds):
        for side in sides if round_ % 2 == 0 else reversed(sides):
            runs[side].append(run_side(side, mpirun))
    print(
        f"# ping-pong, one way, median of {args.rounds} alternating rounds; {describe(machine())}"
    )
    header = ["bytes", *(LABELS[side] + " (us)" for side in sides)]
    header += [f"t/{LABELS[peer]}" for peer in peers]
    print("| " + " | ".join(header) + " |")
    print("|" + "---:|" * len(header))
    table = {}
    for size in runs["trioring"][0]:
        row = {side: statistics.median(run[size] for run in runs[side]) for side in sides}
        table[size] = row
        cells = [str(size), *(f"{row[side] * 1e6:.1f}" for side in sides)]
        cells += [f"{row['trioring'] / row[peer]:.2f}" for peer in peers]
        print("| " + " | ".join(cells) + " |")
    print("P2P-COMPARE " + json.dumps({"machine": machine(), "cells": table}))


if __name__ == "__main__":
    main()
